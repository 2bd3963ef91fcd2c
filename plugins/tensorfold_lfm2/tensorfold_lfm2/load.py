"""An LFM2 or LFM2-MoE checkpoint to a loaded Model: tensors checked by name and shape, packed ones kept packed."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError, OptionError
from tensorfold_core.specs import LoadOptions

from . import lfm2, lfm2_moe
from .quant import quantize_in_place

ARCHITECTURES = {"lfm2": lfm2, "lfm2_moe": lfm2_moe}
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
KEEP_FLOAT32 = ("expert_bias",)  # the router's choice adds it to float32 scores, as transformers and mlx-lm do


def _check(expected: dict[str, mx.array], weights: dict[str, mx.array], ckpt: Checkpoint) -> None:
    config = ckpt.path / "config.json"
    for name, want in expected.items():
        got = weights.get(name)
        if got is None:
            raise CheckpointError(f"{ckpt.weights_file}: tensor {name!r} is missing "
                                  f"(expected shape {tuple(want.shape)} from {config})")
        if got.shape != want.shape:
            raise CheckpointError(f"{ckpt.source(name)}: tensor {name!r} has shape {tuple(got.shape)}, "
                                  f"expected {tuple(want.shape)} from {config}")
        if (want.dtype == mx.uint32) != (got.dtype == mx.uint32) or not (
                want.dtype == mx.uint32 or mx.issubdtype(got.dtype, mx.floating)):
            raise CheckpointError(f"{ckpt.source(name)}: tensor {name!r} is {got.dtype}, expected "
                                  f"{'packed uint32' if want.dtype == mx.uint32 else 'floating point'}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise CheckpointError(f"{ckpt.source(extra[0])}: tensor {extra[0]!r} is not read by the {ckpt.model_type} "
                              f"that {config} describes ({len(extra)} such; check layer_types, conv_bias, "
                              "num_dense_layers, num_experts, use_expert_bias, tie_word_embeddings, quantization)")


def _cast(weights: dict[str, mx.array], dtype: str) -> dict[str, mx.array]:
    """Cast float tensors (quantization scales and biases too); packed uint32 weights stay as stored."""
    if dtype == "auto":
        return weights
    if dtype not in DTYPES:
        raise OptionError(f"dtype {dtype!r}: expected auto, {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    return {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith(KEEP_FLOAT32) else v
            for k, v in weights.items()}


def load(ckpt: Checkpoint, options: LoadOptions = LoadOptions()) -> lfm2.Model:
    """The families' load hook: build the modules the config describes and fill them from the checkpoint."""
    arch = ARCHITECTURES.get(ckpt.model_type)
    if arch is None:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: model_type {ckpt.model_type!r} is not lfm2 or lfm2_moe")
    config = dict(ckpt.config)
    args = arch.ModelArgs.from_config(config, str(ckpt.path / "config.json"))
    weights = ckpt.tensors()
    if args.tie_word_embeddings is None:
        args.tie_word_embeddings = "lm_head.weight" not in weights
    model = arch.Model(args)
    weights = model.sanitize(weights)
    quantize_in_place(model, weights, ckpt)
    _check(dict(tree_flatten(model.parameters())), weights, ckpt)
    weights = _cast(weights, options.dtype)
    model.update(tree_unflatten(list(weights.items())))
    mx.eval(model.parameters())
    embed = model.model.embed_tokens
    model.dtype = (embed.scales if hasattr(embed, "scales") else embed.weight).dtype
    return model
