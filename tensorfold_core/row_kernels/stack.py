"""The layers' new keys and values stacked in one launch: out[r, l] = layer l's row r, every bit as the layer wrote it.

A forward over stacked caches writes each stream's window of every layer at once, after the last layer; MLX's
`mx.stack` of a model's layers launches one copy a layer, for the keys and again for the values (32 launches a token
of a 16-layer model), where this record's kernel makes both stacks in one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Sequence

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, oversize_threadgroup, swap, variant
from tensorfold_contract.helpers import groups, int_array, kept_array, mx_dtype, rounded, row_scales
from tensorfold_contract.kernel_text import build as build_kernel, narrowed, select_chain

THREADS = 256
# MLX builds a custom kernel for a fixed list of input names: the sources take MAX_LAYERS named keys and values and
# the call's count as a template constant; a model with more layers stacks them with MLX's ops. A launch names its
# layers rounded up to a multiple of SLOTS (each input costs MLX host time at every launch; the rounding keeps the
# texts few, and every planted select valid)
MAX_LAYERS = 32
SLOTS = 8


def names(layers: int) -> tuple[str, ...]:
    return (*(f"k{j}" for j in range(layers)), *(f"v{j}" for j in range(layers)), "dims")


NAMES = names(MAX_LAYERS)


def _pick(prefix: str, pointer: str) -> str:
    """The layer's input by a chain of selects (MLX passes each input as its own pointer)."""
    return f"{pointer} {prefix}l = {select_chain('l', prefix, MAX_LAYERS)};\n"


def slots_for(layers: int) -> int:
    """Layers a launch of `layers` names: all MAX_LAYERS under TENSORFOLD_NARROW_INPUTS=0 (the text they narrow)."""
    if os.environ.get("TENSORFOLD_NARROW_INPUTS") == "0":
        return MAX_LAYERS
    return min(MAX_LAYERS, -(-layers // SLOTS) * SLOTS)


def narrowed_text(body: str, slots: int) -> str:
    return narrowed(body, (" kl = ", " vl = "), slots)


# One thread copies VEC consecutive elements (16 bytes) of one layer's rows, keys and values alike: element i of row r
# of layer l goes to out[r, l, i]. Plain 16-byte loads and stores, so no bit is rounded or flushed on the way.
_BODY = """
constexpr int VEC = 16 / sizeof(T);
const size_t width = (size_t)dims[1];  // elements a row of one layer: kv_heads x head_dim, a multiple of VEC
const size_t n = (size_t)dims[0] * width;
const int l = {layer};
const size_t i = ({thread}) * VEC;
if (l >= LAYERS || i >= n) return;
{picks}const size_t at = ((i / width) * LAYERS + l) * width + i % width;
*reinterpret_cast<{vec}*>(ks + at) = *reinterpret_cast<const {vec}*>(kl + i);
*reinterpret_cast<{vec}*>(vs + at) = *reinterpret_cast<const {vec}*>(vl + i);
"""

CUDA = _BODY.format(layer="blockIdx.y", thread="(size_t)blockIdx.x * blockDim.x + threadIdx.x", vec="uint4",
                    picks=_pick("k", "const T*") + _pick("v", "const T*"))
METAL = _BODY.format(layer="(int)thread_position_in_grid.y", thread="(size_t)thread_position_in_grid.x",
                     vec="device uint4", picks=_pick("k", "const device T*") + _pick("v", "const device T*"))


def stack_mlx(keys: Sequence, values: Sequence):
    """MLX's ops: [rows, layers, kv_heads, head_dim] stacks of the layers' keys and values."""
    import mlx.core as mx

    return mx.stack(list(keys), axis=1), mx.stack(list(values), axis=1)


def make(dims, rows, rng):
    host = {}
    for j in range(dims["layers"]):
        for name in ("k", "v"):
            x = rng.standard_normal((rows, dims["kv_heads"], dims["head_dim"])).astype(np.float32)
            x *= row_scales(rng, rows)[:, :, None]
            host[f"{name}{j}"] = rounded(x, dims["dtype"])
    return host


def reference(case):
    layers = range(case.dims["layers"])
    return {name + "s": np.stack([case[f"{name}{j}"].astype(np.float64) for j in layers], axis=1)
            for name in ("k", "v")}


def _arrays(case, name: str, order=None):
    dt = mx_dtype(case.dims["dtype"])
    return [case.array(f"{name}{j}", dt) for j in (order or range(case.dims["layers"]))]


def mlx_stack(case):
    ks, vs = stack_mlx(_arrays(case, "k"), _arrays(case, "v"))
    return {"ks": ks, "vs": vs}


def layers_swapped(case):
    """Planted: the first two layers' rows swapped."""
    order = [1, 0, *range(2, case.dims["layers"])] if case.dims["layers"] > 1 else None
    ks, vs = stack_mlx(_arrays(case, "k", order), _arrays(case, "v", order))
    return {"ks": ks, "vs": vs}


def values_as_keys(case):
    """Planted: the values' stack made from the keys."""
    ks, _ = stack_mlx(_arrays(case, "k"), _arrays(case, "v"))
    return {"ks": ks, "vs": ks}


def _inputs(case):
    keys, values = _arrays(case, "k"), _arrays(case, "v")
    pad = slots_for(len(keys)) - len(keys)  # a slot past the call's layers is never read
    return [*keys, *keys[:1] * pad, *values, *values[:1] * pad,
            int_array([case.rows, case.dims["kv_heads"] * case.dims["head_dim"]])]


def launch(rows: int, layers: int, kv_heads: int, head_dim: int, dtype) -> Launch:
    if not 1 <= layers <= MAX_LAYERS:
        raise ValueError(f"{layers} layers: the stack kernels take 1 to {MAX_LAYERS}")
    vec = 16 // dtype.size
    if (kv_heads * head_dim) % vec:
        raise ValueError(f"rows of {kv_heads} x {head_dim} elements: the stack kernels copy {vec} at a time")
    shape = (rows, layers, kv_heads, head_dim)
    return Launch(grid=(groups(rows * kv_heads * head_dim // vec, THREADS) * THREADS if rows else 0, layers, 1),
                  threadgroup=(THREADS, 1, 1), output_shapes=(shape, shape), output_dtypes=(dtype, dtype),
                  template=(("T", dtype), ("LAYERS", layers)))


def _launch(case) -> Launch:
    d = case.dims
    return launch(case.rows, d["layers"], d["kv_heads"], d["head_dim"], mx_dtype(d["dtype"]))


def _narrow(source: Source, case) -> Source:
    """The text a case's launch serves: its layers' inputs alone."""
    slots = slots_for(case.dims["layers"])
    return dataclasses.replace(source, name=f"{source.name}{slots}", input_names=names(slots),
                               body=narrowed_text(source.body, slots), narrow=None)


def source(kind: str) -> Source:
    """The text of MAX_LAYERS layers (a case launches its narrowed text: Source.at)."""
    return Source("stack_kv", NAMES, ("ks", "vs"), CUDA if kind == "cuda" else METAL, inputs=_inputs,
                  launch=_launch, narrow=_narrow)


def served_stack(kind: str):
    """What a forward calls on `kind`: (keys, values) of every layer -> their [rows, layers, ...] stacks, one launch."""
    made: dict = {}

    def stack(keys: Sequence, values: Sequence):
        rows, kv, d = keys[0].shape
        if len(keys) > MAX_LAYERS or not rows:  # more layers than the kernel names; nothing to launch
            return stack_mlx(keys, values)
        plan = launch(rows, len(keys), kv, d, keys[0].dtype)
        slots = slots_for(len(keys))
        kernel = made.get(("kernel", slots))
        if kernel is None:
            body = narrowed_text(CUDA if kind == "cuda" else METAL, slots)
            name = f"tf_stack_kv_{hashlib.sha1(body.encode()).hexdigest()[:12]}"  # MLX caches kernels by name
            kernel = made[("kernel", slots)] = build_kernel(kind, name, names(slots), ["ks", "vs"], body)
        pad = slots - len(keys)
        dims = made.get(("dims", rows, kv * d))
        if dims is None:
            dims = made[("dims", rows, kv * d)] = kept_array([rows, kv * d], np.int32)
        ks, vs = kernel(inputs=[*keys, *keys[:1] * pad, *values, *values[:1] * pad, dims],
                        template=list(plan.template), grid=plan.grid, threadgroup=plan.threadgroup,
                        output_shapes=list(plan.output_shapes), output_dtypes=list(plan.output_dtypes))
        return ks, vs

    return stack


STACKS = {"mlx": stack_mlx, "cuda": served_stack("cuda"), "metal": served_stack("metal")}

PICK_K = "l == 0 ? k0 : l == 1 ? k1"


def record(family: str, shapes: tuple[Shape, ...]) -> KernelRecord:
    """`family`'s stack of its layers' keys and values, proven at the shapes it serves."""
    edges = (Shape("1 row, fp32", {"layers": 4, "kv_heads": 2, "head_dim": 32, "dtype": "float32"}, 1),
             Shape("one layer", {"layers": 1, "kv_heads": 2, "head_dim": 32, "dtype": "bfloat16"}, 5),
             Shape("every slot", {"layers": MAX_LAYERS, "kv_heads": 1, "head_dim": 8, "dtype": "bfloat16"}, 3),
             Shape("empty", {"layers": 4, "kv_heads": 2, "head_dim": 32, "dtype": "bfloat16"}, 0))
    swapped = swap(PICK_K, "l == 0 ? k1 : l == 1 ? k0")
    as_keys = swap("const T* vl = l == 0 ? v0", "const T* vl = l == 0 ? k0")
    as_keys_metal = swap("const device T* vl = l == 0 ? v0", "const device T* vl = l == 0 ? k0")
    return KernelRecord(
        name=f"{family} stack kv", family=family,
        description="the layers' new keys and values stacked by row: ks[r, l] = layer l's keys of row r (vs alike), "
                    "every bit as the layer wrote it",
        make=make, reference=reference,
        implementations={"mlx": mlx_stack, "cuda": source("cuda"), "metal": source("metal")},
        shapes=shapes, edges=edges, row_inputs=NAMES[:-1],
        controls=(
            Control("first two layers swapped", "mlx", 2, variant(layers_swapped)),
            Control("values stacked from the keys", "mlx", 2, variant(values_as_keys)),
            Control("first two layers swapped", "cuda", 2, swapped),
            Control("values stacked from the keys", "cuda", 2, as_keys),
            Control("row offset that follows the row count", "cuda", 4,
                    swap("const size_t at = ((i / width) * LAYERS + l) * width + i % width;",
                         "const size_t at = ((((i / width) + n / width / 8) % (n / width)) * LAYERS + l) * width "
                         "+ i % width;")),
            Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
            Control("first two layers swapped", "metal", 2, swapped),
            Control("values stacked from the keys", "metal", 2, as_keys_metal),
            Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
        ))
