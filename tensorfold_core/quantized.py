"""MLX affine-packed linears that unpack their codes for calls of many rows on CUDA, where MLX's own builds slowly."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .kernels import backend

# MLX 0.32.4's CUDA quantized_matmul builds a kernel at its first call of 8 or more rows for each shape, ~40 s of one
# CPU core each on the H200 (docs/gpu.md): a drafter on MLX's ops stalled for minutes in its first holds or catch-ups.
# From this many rows a call on CUDA unpacks the codes for MLX's plain matmul (a GEMM's work; fewer read them in place)
UNPACK_FROM_ROWS_ON_CUDA = 8


def _unpacked_product(module: nn.Module, x: mx.array) -> mx.array | None:
    """x @ W.T through unpacked codes where the call has `module.unpack_from` rows or more; None: call as packed."""
    if module.unpack_from is None or x.size < module.unpack_from * x.shape[-1]:
        return None
    weight = mx.dequantize(module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
                           bits=module.bits, mode=module.mode)
    return x @ weight.T


class PackedLinear(nn.QuantizedLinear):
    """A linear's affine codes; a call of `unpack_from` rows or more unpacks them first (None: never)."""

    unpack_from: int | None = None

    def __call__(self, x: mx.array) -> mx.array:
        y = _unpacked_product(self, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class PackedEmbedding(nn.QuantizedEmbedding):
    """An embedding's affine codes; read as a tied head (`as_linear`), a call of `unpack_from` rows or more unpacks."""

    unpack_from: int | None = None

    def as_linear(self, x: mx.array) -> mx.array:
        y = _unpacked_product(self, x)
        return super().as_linear(x) if y is None else y


PACKED = {nn.QuantizedLinear: PackedLinear, nn.QuantizedEmbedding: PackedEmbedding}


def unpack_many_rows(model: nn.Module, unpack_from: int | None = None) -> int:
    """Make every affine QuantizedLinear and QuantizedEmbedding of `model` a Packed one that unpacks from
    `unpack_from` rows (default: 8 on CUDA, never elsewhere); how many it changed. For models that run MLX's own ops
    (drafters): the families' served projections run their kernel records on CUDA instead."""
    if unpack_from is None:
        unpack_from = UNPACK_FROM_ROWS_ON_CUDA if backend() == "cuda" else None
    changed = 0
    for _, module in model.named_modules():
        if type(module) in PACKED and module.mode == "affine":
            module.__class__ = PACKED[type(module)]  # the same arrays and fields: only the calls change, no copy
            changed += 1
        if type(module) in PACKED.values():
            module.unpack_from = unpack_from
    return changed
