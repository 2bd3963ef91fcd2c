"""A DSpark checkpoint to a loaded drafter: tensors checked by name and shape, linears quantized one at a time."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError
from tensorfold_core.quantized import serve_codes
from tensorfold_core.weights import check_tensors

from .model import Model, ModelArgs

BITS = 8  # the drafter serves 8-bit MLX affine codes whatever the checkpoint holds
GROUP_SIZES = (64, 32)  # the first that divides a matrix's inputs
FLAGS = ("dflash_config.target_layer_ids, num_hidden_layers, dflash_config.markov_rank, "
         "dflash_config.enable_confidence_head")  # config keys that decide which tensors are read
DENSE = ("confidence_head",)  # one output row: nothing to save by packing it


def args_of(ckpt: Checkpoint) -> ModelArgs:
    """The drafter's config from its config.json, refused naming the key (the published layout, section docs)."""
    args = ModelArgs.from_config(ckpt.config, str(ckpt.path / "config.json"))
    if ckpt.quantization is not None:
        raise CheckpointError(f"{ckpt.path / 'config.json'}: a quantization block: the dspark drafter reads the "
                              "published float checkpoint and packs it to 8-bit codes itself")
    return args


def _group_size(name: str, inputs: int, ckpt: Checkpoint) -> int:
    for size in GROUP_SIZES:
        if inputs % size == 0:
            return size
    raise CheckpointError(f"{ckpt.source(name)}: tensor {name!r} has {inputs} inputs, which no 8-bit group size "
                          f"({', '.join(map(str, GROUP_SIZES))}) divides")


def _quantized(module: nn.Module, weight: mx.array, group_size: int) -> nn.Module:
    """The module's 8-bit affine twin holding `weight`'s codes, evaluated (the float matrix is dropped after)."""
    module.weight = weight
    if isinstance(module, nn.Embedding):
        packed = nn.QuantizedEmbedding.from_embedding(module, group_size, BITS)
    else:
        packed = nn.QuantizedLinear.from_linear(module, group_size, BITS)
    mx.eval(packed.parameters())
    return packed


def _module(model: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else model[part]
    return model


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(_module(model, parent) if parent else model, leaf, module)


def load(ckpt: Checkpoint, dtype: mx.Dtype) -> Model:
    """Build the modules the config describes and fill them; each linear and embedding is read, cast to `dtype`
    and packed alone, so the float file is never resident beside the codes."""
    model = Model(args_of(ckpt))
    weights = model.sanitize(ckpt.tensors())  # lazy: a tensor is read from the file when evaluated
    check_tensors(model, weights, ckpt, family="dspark drafter", flags=FLAGS)
    packable = [path for path, module in model.named_modules()  # paths only: no float matrix outlives its turn
                if isinstance(module, (nn.Linear, nn.Embedding)) and not path.startswith(DENSE)]
    for path in packable:
        module, name = _module(model, path), f"{path}.weight"
        weight = weights.pop(name).astype(dtype)
        packed = _quantized(module, weight, _group_size(name, weight.shape[-1], ckpt))
        if f"{path}.bias" in weights:
            packed.bias = weights.pop(f"{path}.bias").astype(dtype)
        _replace(model, path, packed)
        del weight, module
    model.update(tree_unflatten([(name, w.astype(dtype)) for name, w in weights.items()]))
    mx.eval(model.parameters())
    serve_codes(model)  # unpacked once on the CPU, for calls of many rows on CUDA (tensorfold_core.quantized)
    return model
