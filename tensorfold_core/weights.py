"""A checkpoint's tensors onto a family's modules: packed ones quantized in place, all checked, floats cast."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .checkpoint import Checkpoint
from .errors import CheckpointError, OptionError

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def _params(block: dict, where: str) -> dict:
    """A quantization block's {group_size, bits, mode}, refused by name when it is not MLX affine."""
    mode = block.get("mode", "affine")
    if mode != "affine" or "quant_method" in block:
        kind = block.get("quant_method", mode)
        raise CheckpointError(f"{where}: quantization {kind!r} is not read by tensorfold "
                              "(MLX affine only: convert with `mlx_lm.convert -q`)")
    bits, group_size = block.get("bits"), block.get("group_size")
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise CheckpointError(f"{where}: affine quantization with bits={bits} group_size={group_size} is not "
                              f"supported (bits {BITS}, group_size {GROUP_SIZES})")
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def _inferred(path: str, module: nn.Module, weights: dict, ckpt: Checkpoint) -> dict:
    """bits and group size of a packed module the config does not name, from its tensors' shapes (as mlx-lm)."""
    in_dims = module.weight.shape[-1]
    packed, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
    # an expert stack's scales are 3-D like its weight: one matrix of groups per expert
    if packed is None or packed.dtype != mx.uint32 or scales.ndim != module.weight.ndim or in_dims % scales.shape[-1]:
        raise CheckpointError(f"{ckpt.source(f'{path}.scales')}: {path}.scales of shape {tuple(scales.shape)} does "
                              f"not fit a packed {path}.weight of {in_dims} inputs")
    return _params({"group_size": in_dims // scales.shape[-1], "bits": packed.shape[-1] * 32 // in_dims},
                   f"{ckpt.source(f'{path}.weight')}: {path}")


def quantize_in_place(model: nn.Module, weights: dict[str, mx.array], ckpt: Checkpoint) -> None:
    """Swap each Linear, Embedding and expert stack stored packed for its quantized kind, read as stored."""
    # per-module overrides of the block are read by module path: mlx-lm writes its 8-bit routers that way
    block = ckpt.quantization
    config_file = ckpt.path / "config.json"
    if block is None:
        packed = next((k for k in weights if k.endswith(".scales")), None)
        if packed is not None:
            raise CheckpointError(f"{ckpt.source(packed)}: packed tensor {packed!r}, but {config_file} has no "
                                  "quantization block")
        return
    default = _params(block, f"{config_file}")

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):  # the block may name modules that cannot be packed
            return False
        if path in block:  # a per-module override: params, or false for a module kept dense
            override = block[path]
            if override is False or override is None:
                return False
            if override is True:
                return default
            if not isinstance(override, dict):
                raise CheckpointError(f"{config_file}: quantization[{path!r}] is {override!r}, "
                                      "expected a dict or false")
            return _params({**default, **override}, f"{config_file}: quantization[{path!r}]")
        if f"{path}.scales" not in weights:
            return False
        return _inferred(path, module, weights, ckpt)

    nn.quantize(model, class_predicate=predicate)


def check_tensors(model: nn.Module, weights: dict[str, mx.array], ckpt: Checkpoint, *, family: str, flags: str) -> None:
    """Refuse, naming tensor and file, a parameter missing, misshapen or of the wrong kind, or a tensor unread."""
    config = ckpt.path / "config.json"
    expected = dict(tree_flatten(model.parameters()))
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
        raise CheckpointError(f"{ckpt.source(extra[0])}: tensor {extra[0]!r} is not read by the {family} that "
                              f"{config} describes ({len(extra)} such; check {flags})")


def cast_floats(weights: dict[str, mx.array], dtype: str, keep: tuple[str, ...] = ()) -> dict[str, mx.array]:
    """Float tensors (quantization scales and biases too) cast to `dtype`; packed ones and `keep` names stay."""
    if dtype == "auto":
        return weights
    if dtype not in DTYPES:
        raise OptionError(f"dtype {dtype!r}: expected auto, {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    return {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith(keep) else v
            for k, v in weights.items()}


def fill(model: nn.Module, weights: dict[str, mx.array], ckpt: Checkpoint, dtype: str, *, family: str, flags: str,
         keep: tuple[str, ...] = (), evaluate: bool = True) -> None:
    """Load a family's sanitized tensors into its modules: quantized in place, checked, cast, then evaluated (or
    left lazy, for a group's rank: `shard.split` evaluates only its part, so the whole model is never held)."""
    quantize_in_place(model, weights, ckpt)
    check_tensors(model, weights, ckpt, family=family, flags=flags)
    model.update(tree_unflatten(list(cast_floats(weights, dtype, keep).items())))
    if evaluate:
        mx.eval(model.parameters())
