"""MLX affine-packed linears that unpack their codes where MLX's own product is slow: for calls of many rows on CUDA
(it builds slowly), once at load on the CPU (it costs a row what BLAS costs a whole window)."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from .kernels import backend

# MLX 0.32.4's CUDA quantized_matmul builds a kernel at its first call of 8 or more rows for each shape, ~40 s of one
# CPU core each on the H200 (docs/gpu.md): a drafter on MLX's ops stalled for minutes in its first holds or catch-ups.
# From this many rows a call on CUDA unpacks the codes for MLX's plain matmul (a GEMM's work; fewer read them in place)
UNPACK_FROM_ROWS_ON_CUDA = 8
# MLX 0.32.4's CPU quantized_matmul costs in proportion to its rows with no BLAS behind it (a DSpark hold of 4 drafts
# 5.3 ms against 2.6 with the codes unpacked, docs/dspark.md): on the CPU a drafter keeps its codes unpacked beside
# them, once, while that copy stays this small (a CPU drafter of billions of parameters keeps its codes alone)
UNPACK_ONCE_BYTES = 256 * 2 ** 20
UNPACK_ONCE_ENV = "TENSORFOLD_UNPACK_ONCE"  # "0": a CPU drafter reads its codes in place (a measurement's knob)


def _dequantized(module: nn.Module) -> mx.array:
    return mx.dequantize(module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
                         bits=module.bits, mode=module.mode)


def _unpacked_product(module: nn.Module, x: mx.array) -> mx.array | None:
    """x @ W.T through unpacked codes: those kept at load, or where the call has `module.unpack_from` rows or more
    those unpacked for it; None: call as packed."""
    if module.unpacked is not None:
        return x @ module.unpacked.T
    if module.unpack_from is None or x.size < module.unpack_from * x.shape[-1]:
        return None
    return x @ _dequantized(module).T


class PackedLinear(nn.QuantizedLinear):
    """A linear's affine codes; a call of `unpack_from` rows or more unpacks them first (None: never), and every call
    reads `unpacked` where they were unpacked once (not a parameter: the codes stay the module's weights)."""

    unpack_from: int | None = None
    unpacked: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        y = _unpacked_product(self, x)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class PackedEmbedding(nn.QuantizedEmbedding):
    """An embedding's affine codes; read as a tied head (`as_linear`), a call of `unpack_from` rows or more unpacks
    (or reads `unpacked`, as PackedLinear); a lookup reads `unpacked` where the codes were unpacked once."""

    unpack_from: int | None = None
    unpacked: mx.array | None = None

    def __call__(self, x: mx.array) -> mx.array:
        # dequantizing is elementwise, so the unpacked rows are the looked-up codes' bits in one gather (not four)
        return super().__call__(x) if self.unpacked is None else self.unpacked[x]

    def as_linear(self, x: mx.array) -> mx.array:
        y = _unpacked_product(self, x)
        return super().as_linear(x) if y is None else y


PACKED = {nn.QuantizedLinear: PackedLinear, nn.QuantizedEmbedding: PackedEmbedding}


def _packed(model: nn.Module) -> list[nn.Module]:
    """Every affine QuantizedLinear and QuantizedEmbedding of `model`, made Packed ones (the same arrays and fields:
    only their calls change, no copy)."""
    out = []
    for _, module in model.named_modules():
        if type(module) in PACKED and module.mode == "affine":
            module.__class__ = PACKED[type(module)]
        if type(module) in PACKED.values():
            out.append(module)
    return out


def unpack_many_rows(model: nn.Module, unpack_from: int | None = None) -> int:
    """Make every affine QuantizedLinear and QuantizedEmbedding of `model` a Packed one that unpacks from
    `unpack_from` rows (default: 8 on CUDA, never elsewhere); how many it set. For models that run MLX's own ops
    (drafters): the families' served projections run their kernel records on CUDA instead."""
    if unpack_from is None:
        unpack_from = UNPACK_FROM_ROWS_ON_CUDA if backend() == "cuda" else None
    packs = _packed(model)
    for module in packs:
        module.unpack_from = unpack_from
    return len(packs)


def unpack_once(model: nn.Module, limit_bytes: int = UNPACK_ONCE_BYTES) -> int:
    """Unpack every affine module's codes of `model` once, kept beside them for every call, if all of them unpacked
    take at most `limit_bytes`; how many it unpacked (0: over the limit, the codes read in place)."""
    packs = _packed(model)
    unpacked = [_dequantized(module) for module in packs]
    if sum(w.size * w.itemsize for w in unpacked) > limit_bytes:
        return 0
    mx.eval(unpacked)
    for module, weight in zip(packs, unpacked):
        object.__setattr__(module, "unpacked", weight)  # an attribute, not a parameter (mlx.nn would make it one)
    return len(packs)


def serve_codes(model: nn.Module) -> str:
    """How a drafter's affine codes are read on this backend: unpacked once on the CPU (within UNPACK_ONCE_BYTES),
    unpacked for calls of many rows on CUDA, in place otherwise; the words for it."""
    if backend() == "cpu" and os.environ.get(UNPACK_ONCE_ENV) != "0" and unpack_once(model):
        return "unpacked once"
    unpack_many_rows(model)
    return f"unpacked from {UNPACK_FROM_ROWS_ON_CUDA} rows" if backend() == "cuda" else "in place"
