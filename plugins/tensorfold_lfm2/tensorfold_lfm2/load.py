"""An LFM2 or LFM2-MoE checkpoint to a loaded Model: tensors checked by name and shape, packed ones kept packed."""

from __future__ import annotations

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError
from tensorfold_core.families import activation_dtype
from tensorfold_core.kernels import BUILTIN
from tensorfold_core.shard import split
from tensorfold_core.specs import LoadOptions
from tensorfold_core.weights import fill

from . import lfm2, lfm2_moe
from .ops import OPS
from .serving import serve_kernels
from .shard import plan

ARCHITECTURES = {"lfm2": lfm2, "lfm2_moe": lfm2_moe}
FLAGS = ("layer_types, conv_bias, num_dense_layers, num_experts, use_expert_bias, tie_word_embeddings, "
         "quantization")  # config keys that decide which tensors are read
KEEP_FLOAT32 = ("expert_bias",)  # the router's choice adds it to float32 scores, as transformers and mlx-lm do


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
    fill(model, model.sanitize(weights), ckpt, options.dtype, family=ckpt.model_type, flags=FLAGS, keep=KEEP_FLOAT32,
         evaluate=options.shard is None)  # a rank evaluates only its shard
    del weights  # the model holds them now: a rank's cuts free each whole matrix once read
    model.dtype = activation_dtype(model.model.embed_tokens)
    if options.shard is not None:  # a group's rank: its part of the weights, before kernels are prepared for them
        split(model, plan(model), *options.shard, source=str(ckpt.path))
    model.kernels = ({op: BUILTIN for op in OPS} if options.builtin_kernels
                     else serve_kernels(model, gather=options.shard is None))
    if arch is lfm2_moe:  # MLX's experts (the CPU's): every expert over a wide window's rows where that is faster
        lfm2_moe.time_all_experts(model)
    return model
