"""A llama checkpoint to a loaded Model: tensors checked by name and shape, packed layers kept packed, dtype applied."""

from __future__ import annotations

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.families import activation_dtype
from tensorfold_core.kernels import BUILTIN
from tensorfold_core.shard import split
from tensorfold_core.specs import LoadOptions
from tensorfold_core.weights import fill

from .model import Model, ModelArgs
from .ops import OPS
from .serving import serve_kernels
from .shard import plan

FLAGS = "attention_bias, mlp_bias, tie_word_embeddings, quantization"  # config keys that decide which tensors are read


def load(ckpt: Checkpoint, options: LoadOptions = LoadOptions()) -> Model:
    """The family's load hook: build the modules the config describes and fill them from the checkpoint."""
    args = ModelArgs.from_config(ckpt.config, str(ckpt.path / "config.json"))
    weights = ckpt.tensors()
    if args.tie_word_embeddings is None:
        args.tie_word_embeddings = "lm_head.weight" not in weights
    model = Model(args)
    fill(model, model.sanitize(weights), ckpt, options.dtype, family="llama", flags=FLAGS,
         evaluate=options.shard is None)  # a rank evaluates only its shard
    del weights  # the model holds them now: a rank's cuts free each whole matrix once read
    model.dtype = activation_dtype(model.model.embed_tokens)
    if options.shard is not None:  # a group's rank: its part of the weights, before kernels are prepared for them
        split(model, plan(model), *options.shard, source=str(ckpt.path))
    model.kernels = ({op: BUILTIN for op in OPS} if options.builtin_kernels
                     else serve_kernels(model, compiled=options.shard is None))
    return model
