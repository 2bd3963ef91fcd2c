"""Modules that serve a family's row-kernel records in place of MLX's: projections, norms; and the swap that puts
them into a loaded model."""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
from tensorfold_contract.helpers import kept_array

from .. import traces
from ..kernels import RECORDS_KIND


FUSED_ENV = "TENSORFOLD_FUSED"  # "0": every projection its own launch, no op folded in (to measure what fusing saves)
# "0": o_proj and down_proj launched apart from the residual add and swiglu (to measure what folding them in saves)
RESIDUAL_ENV = "TENSORFOLD_FUSED_RESIDUAL"
# "down": swiglu computed by down_proj as it reads gate|up's output, not stored by gate|up (to measure the two)
SWIGLU_ENV = "TENSORFOLD_SWIGLU_IN"
# "0": a layer's norms launched apart from the q|k|v and gate|up launches that read them (to measure the fold)
NORM_ENV = "TENSORFOLD_NORM_IN"
COMPILE_ENV = "TENSORFOLD_COMPILE"  # "0": no layer part compiled (a measurement); "1": compiled even untested
# "0": q and k roped a stream at a time in its attention step, not a row at a time in the layer's compiled first part
ROPE_ROWS_ENV = "TENSORFOLD_ROPE_ROWS"
# where the streams attention serves, every layer of a forward is one mx.compile'd call, a trace a shape (the
# default); "0" calls each layer's compiled parts and its attention from Python, to measure (docs/gpu.md)
WHOLE_ENV = "TENSORFOLD_WHOLE_FORWARD"
# the times a whole forward's key is met untraced before it is traced: 1 (the default) leaves a shape met once (a
# prompt's last chunk) untraced; 0 traces at once, so a new key costs one slow round, not two (bench `:trace-first`)
TRACE_AFTER_ENV = "TENSORFOLD_WHOLE_TRACE_AFTER"

log = logging.getLogger(__name__)


def projection_op(module: nn.Module, activations: mx.Dtype) -> str | None:
    """The op tables' name for a projection (None: no record serves it): the GEMV records take bf16 activations, and
    bf16 weights or 4/8-bit affine codes with bf16 scales."""
    if activations != mx.bfloat16 or "weight" not in module or module.weight.ndim != 2:
        return None
    if "scales" in module:
        affine = module.bits in (4, 8) and module.mode == "affine" and module.scales.dtype == mx.bfloat16
        return f"projection q{module.bits}" if affine else None
    return "projection bf16" if module.weight.dtype == mx.bfloat16 else None


class Served(nn.Module):
    """A module whose call a kernel record serves; its weights, and what else it is asked, stay the inner one's."""

    def __getattr__(self, key: str):
        try:
            return super().__getattr__(key)
        except AttributeError:
            inner = self.get("inner")  # None while the module itself is being built
            if inner is None:
                raise
            return getattr(inner, key)


class RecordLinear(Served):
    """A projection (or a tied head) served by a GEMV record's implementation: one launch for all of a forward's
    rows, bf16 out (the record's served output), the weights read once per block of rows."""

    def __init__(self, inner: nn.Module, record, kind: str):
        from tensorfold_contract.serving import Prepared

        from .gemv import OUT

        super().__init__()
        self.inner = inner  # the projection's weights stay its own, under `inner`
        m = inner
        if "scales" in m:  # affine codes: QuantizedLinear, QuantizedEmbedding or one expert's slice
            dims = {"n": m.weight.shape[0], "k": m.weight.shape[1] * 32 // m.bits, "group": m.group_size}
            weights = lambda: {"wq": m.weight, "scales": m.scales, "biases": m.biases}  # noqa: E731
        else:
            dims = {"n": m.weight.shape[0], "k": m.weight.shape[1]}
            weights = lambda: {"w": m.weight}  # noqa: E731
        # kept out of the module tree: a plain attribute MLX's parameter walk never enters
        object.__setattr__(self, "launch", Prepared(kind, record.implementations[kind], {**dims, "out": OUT},
                                                   weights, "x"))
        object.__setattr__(self, "biased", "bias" in inner)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.launch(x)["y"]
        return y + self.inner.bias if self.biased else y


class RecordFused:
    """Projections of the same rows (q/k/v, gate/up) served as one launch of a GEMV record over their weights stacked
    by output columns; each part's output is bit-equal to its own launch, since in the GEMV kernels a column's sum
    reads its own weight row alone, whatever the matrix's width."""

    def __init__(self, parts: Sequence[nn.Module], record, kind: str):
        from tensorfold_contract.serving import Prepared

        from .gemv import OUT

        first = parts[0]
        names = ("weight", "scales", "biases") if "scales" in first else ("weight",)
        stacked = {name: mx.concatenate([part[name] for part in parts]) for name in names}
        mx.eval(stacked)
        bounds = [0]
        for part in parts:
            bounds.append(bounds[-1] + part.weight.shape[0])
        for part, lo, hi in zip(parts, bounds, bounds[1:]):  # each part's weights become a view of the stack: no twin
            part.update({name: stacked[name][lo:hi] for name in names})
        # made here, on the loading thread's stream: a lazy view met first by another thread has no stream there
        mx.eval([part[name] for part in parts for name in names])
        if "scales" in first:
            dims = {"n": bounds[-1], "k": first.weight.shape[1] * 32 // first.bits, "group": first.group_size}
            arrays = {"wq": stacked["weight"], "scales": stacked["scales"], "biases": stacked["biases"]}
        else:
            dims, arrays = {"n": bounds[-1], "k": first.weight.shape[1]}, {"w": stacked["weight"]}
        self.launch = Prepared(kind, record.implementations[kind], {**dims, "out": OUT}, lambda: arrays, "x")
        self.bounds, self.biases = bounds, [part.get("bias") for part in parts]
        self.dims, self.arrays = dims, arrays

    def __call__(self, x: mx.array) -> list[mx.array]:
        y = self.launch(x)["y"]
        outs = [y[:, lo:hi] for lo, hi in zip(self.bounds, self.bounds[1:])]
        return [out if bias is None else out + bias for out, bias in zip(outs, self.biases)]

    def joined(self, x: mx.array) -> mx.array:
        """The parts' outputs side by side as one launch writes them (no biases: a part's bias is not added here)."""
        return self.launch(x)["y"]


class RecordResidual:
    """A bf16 projection whose launch also adds the residual, and for a down projection reads swiglu of the gate and
    up halves of its input (a fused GEMV record, `tensorfold_core.row_kernels.gemv_fused`): one launch where there
    were two or three, each (row, column) sum the plain GEMV's."""

    def __init__(self, inner: nn.Module, record, kind: str):
        from tensorfold_contract.serving import Prepared

        from .gemv import OUT

        dims = {"n": inner.weight.shape[0], "k": inner.weight.shape[1], "out": OUT}
        self.launch = Prepared(kind, record.implementations[kind], dims, lambda: {"w": inner.weight}, "x")

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.launch(x, res=residual)["y"]


class RecordSwiglu:
    """A gate|up launch that stores swiglu of its two halves (the fused `swiglu` GEMV record over the same stacked
    weights): each gate and up sum the plain GEMV's, rounded to bf16, then swiglu's steps as MLX's bf16 ops round."""

    def __init__(self, gate_up: RecordFused, record, kind: str):
        from tensorfold_contract.serving import Prepared

        from .gemv import OUT

        dims = {"n": gate_up.bounds[1], "k": gate_up.dims["k"], "out": OUT}
        self.launch = Prepared(kind, record.implementations[kind], dims, lambda: gate_up.arrays, "x")

    def __call__(self, x: mx.array) -> mx.array:
        return self.launch(x)["y"]


def _bf16_unbiased(stacked: RecordFused, halves: bool) -> bool:
    """Whether a stacked launch has bf16 weights and no biases (and, with `halves`, two equal parts: gate and up)."""
    two = len(stacked.bounds) == 3 and stacked.bounds[2] == 2 * stacked.bounds[1]
    return "w" in stacked.arrays and all(b is None for b in stacked.biases) and (two or not halves)


class RecordNormed:
    """An RMSNorm folded into the bf16 launch that reads its rows (q|k|v, or gate|up storing swiglu): the normed gemv
    record over the same stacked weights, each row normed as the rmsnorm record norms it, then the GEMV's sums."""

    def __init__(self, stacked: RecordFused, norm: nn.RMSNorm, record, kind: str, swiglu: bool):
        from tensorfold_contract.serving import Prepared

        from .gemv import OUT

        n = stacked.bounds[1] if swiglu else stacked.bounds[-1]
        dims = {"n": n, "k": stacked.dims["k"], "eps": norm.eps, "out": OUT}
        self.launch = Prepared(kind, record.implementations[kind], dims,
                               lambda: {"w": stacked.arrays["w"], "nw": norm.weight}, "x")  # eps rides in the dims

    def __call__(self, x: mx.array) -> mx.array:
        return self.launch(x)["y"]


def normed_fused(stacked: RecordFused | None, norm: nn.Module, usable: Mapping[str, object], kind: str,
                 swiglu: bool) -> RecordNormed | None:
    """The norm-reading launch for a bf16 q|k|v (or gate|up of two equal halves, `swiglu`) without biases behind a
    bf16 RMSNorm, where the table serves it; None elsewhere, or where TENSORFOLD_NORM_IN=0 asks the norm its own
    launch (a measurement)."""
    op = "projection bf16 rmsnorm swiglu" if swiglu else "projection bf16 rmsnorm"
    inner = norm.inner if isinstance(norm, Served) else norm
    if stacked is None or op not in usable or os.environ.get(NORM_ENV, "1") == "0":
        return None
    if not isinstance(inner, nn.RMSNorm) or inner.weight.dtype != mx.bfloat16 or not _bf16_unbiased(stacked, swiglu):
        return None
    return RecordNormed(stacked, inner, usable[op], kind, swiglu)


def swiglu_fused(gate_up: RecordFused | None, usable: Mapping[str, object], kind: str) -> RecordSwiglu | None:
    """The swiglu-storing launch for a bf16 gate|up of two equal halves without biases, where the table serves it;
    None elsewhere, or where TENSORFOLD_SWIGLU_IN=down asks down_proj to compute it as it reads (a measurement)."""
    op = "projection bf16 swiglu"
    if gate_up is None or op not in usable or os.environ.get(SWIGLU_ENV, "gate_up") == "down":
        return None
    if not _bf16_unbiased(gate_up, halves=True):
        return None
    return RecordSwiglu(gate_up, usable[op], kind)


def residual_fused(projection: nn.Module, usable: Mapping[str, object], kind: str, activations: mx.Dtype,
                   op: str) -> RecordResidual | None:
    """The fused launch for a bf16 projection without a bias where the table serves `op` by a record; None elsewhere,
    or where TENSORFOLD_FUSED=0 or TENSORFOLD_FUSED_RESIDUAL=0 asks each op its own launch (a measurement)."""
    inner = projection.inner if isinstance(projection, Served) else projection
    apart = os.environ.get(FUSED_ENV, "1") == "0" or os.environ.get(RESIDUAL_ENV, "1") == "0"
    if op not in usable or apart or "bias" in inner:
        return None
    if projection_op(inner, activations) != "projection bf16":
        return None
    return RecordResidual(inner, usable[op], kind)


def fused(parts: Sequence[nn.Module], usable: Mapping[str, object], kind: str,
          activations: mx.Dtype) -> RecordFused | None:
    """One launch for projections that read the same rows, where one record serves them all alike (same op, group
    size and input width); None where it does not, or where TENSORFOLD_FUSED=0 asks each its own (a measurement)."""
    inner = [part.inner if isinstance(part, Served) else part for part in parts]
    ops = {projection_op(part, activations) for part in inner}
    op = ops.pop() if len(ops) == 1 else None
    if op not in usable or os.environ.get(FUSED_ENV, "1") == "0":
        return None
    if len({(part.weight.shape[1], getattr(part, "group_size", None), getattr(part, "bits", None))
            for part in inner}) != 1:
        return None
    return RecordFused(inner, usable[op], kind)


class RecordNorm(Served):
    """An RMSNorm served by the rmsnorm record's implementation, one launch a call; leading axes are rows (a
    per-head norm's [rows, heads, head_dim] is rows x heads rows of head_dim)."""

    def __init__(self, inner: nn.RMSNorm, record, kind: str):
        from tensorfold_contract.serving import Prepared

        super().__init__()
        self.inner = inner  # the norm's weight stays its own, under `inner`
        eps = kept_array([inner.eps], "float32")
        implementation = record.implementations[kind]

        def prepared(dtype: mx.Dtype) -> Prepared:  # one a dtype: the record's dims name the activation dtype
            dims = {"d": inner.weight.shape[-1], "dtype": str(dtype).removeprefix("mlx.core."), "eps": inner.eps}
            return Prepared(kind, implementation, dims, lambda: {"w": inner.weight, "eps": eps}, "x")

        object.__setattr__(self, "launches", {})
        object.__setattr__(self, "prepared", prepared)

    def __call__(self, x: mx.array) -> mx.array:
        launch = self.launches.get(x.dtype)
        if launch is None:
            launch = self.launches[x.dtype] = self.prepared(x.dtype)
        if x.ndim == 2:
            return launch(x)["out"]
        return launch(x.reshape(-1, x.shape[-1]))["out"].reshape(x.shape)


Swap = Callable[[nn.Module], nn.Module]


def swaps(usable: Mapping[str, object], kind: str, activations: mx.Dtype) -> tuple[Swap, Swap]:
    """(projection, norm): each turns a module into its record-served twin where the table serves its op by a
    record (`usable`: op -> record), and leaves it as it is elsewhere."""

    def projection(module: nn.Module) -> nn.Module:
        op = projection_op(module, activations)
        return RecordLinear(module, usable[op], kind) if op in usable else module

    def norm(module: nn.Module) -> nn.Module:
        return RecordNorm(module, usable["rms_norm"], kind) if "rms_norm" in usable else module

    return projection, norm


def swap_tree(module: nn.Module, projection: Swap, norm: Swap) -> None:
    """Every Linear (plain or quantized) under `module` through `projection`, every RMSNorm through `norm`."""
    for name, child in module.children().items():
        items = enumerate(child) if isinstance(child, list) else [(None, child)]
        for index, sub in items:
            if isinstance(sub, (nn.Linear, nn.QuantizedLinear)):
                new = projection(sub)
            elif isinstance(sub, nn.RMSNorm):
                new = norm(sub)
            elif isinstance(sub, nn.Module) and not isinstance(sub, Served):
                swap_tree(sub, projection, norm)
                continue
            else:
                continue
            if index is None:
                setattr(module, name, new)
            else:
                child[index] = new


class KeyCompiled:
    """Functions mx.compile'd once for each key: each compiled function holds the one trace, and past `keep` of them
    the least recently used is dropped with its trace, so a server meeting ever new shapes does not grow MLX's
    compile cache without end. With `after` n, a key is traced only once it was met n times before: a shape met
    once (a prompt's last chunk, a passing mix of streams) costs no trace, which costs several plain calls."""

    def __init__(self, keep: int = 64, after: int = 0):
        self.keep, self.after = keep, after
        self.compiled: dict = {}
        self.met: dict = {}  # key -> times met untraced (the most recent 4 * keep keys)

    def get(self, key, make: Callable[[], Callable]) -> Callable | None:
        """The compiled function of `key`, made by mx.compile(make()) when the key is met past `after` times; None
        before that (the caller runs the function uncompiled)."""
        compiled = self.compiled.pop(key, None)
        if compiled is None:
            met = self.met.pop(key, 0)
            if met < self.after:
                self.met[key] = met + 1
                if len(self.met) > 4 * self.keep:
                    del self.met[next(iter(self.met))]
                return None
            compiled = mx.compile(make())
            traces.note()  # the trace runs at the call just after: the round that makes it is not timed
            if len(self.compiled) >= self.keep:
                del self.compiled[next(iter(self.compiled))]
        self.compiled[key] = compiled  # last in the dict: the most recently used
        return compiled


def whole_forward_traces() -> KeyCompiled:
    """A family's whole-forward traces, one a key, traced after TENSORFOLD_WHOLE_TRACE_AFTER untraced meetings."""
    return KeyCompiled(after=int(os.environ.get(TRACE_AFTER_ENV, "1")))


class ShapeCompiled(KeyCompiled):
    """`fn` mx.compile'd once for each row count (the first axis of its first input)."""

    def __init__(self, fn: Callable, keep: int = 64):
        super().__init__(keep)
        self.fn = fn

    def __call__(self, first: mx.array, *rest: mx.array):
        return self.get(first.shape[0], lambda: self.fn)(first, *rest)


def compiling(usable: Mapping[str, object], kind: str) -> bool:
    """Whether a family compiles its layers' parts: where records serve on a GPU (a compiled call replays the kernels
    it traced, without the Python that builds them again and without MLX's custom-kernel binding, which assembles a
    kernel's whole source text on every call), on the CPU where MLX can build its kernels (fewer, fused ops a
    step), or as TENSORFOLD_COMPILE says."""
    wanted = os.environ.get(COMPILE_ENV, "")
    if wanted in ("0", "1"):
        return wanted == "1"
    return cpu_compiles() if kind == RECORDS_KIND["cpu"] else bool(usable)


def rope_by_rows(usable: Mapping[str, object], kind: str, record_attends: bool = False) -> bool:
    """Whether q and k are roped a row at a time in each attention layer's compiled first part: where the window
    attention record serves, and on the CPU; not where the parts run op by op, nor with TENSORFOLD_ROPE_ROWS=0."""
    return (compiling(usable, kind) and (record_attends or kind == RECORDS_KIND["cpu"])
            and os.environ.get(ROPE_ROWS_ENV, "1") != "0")


@functools.cache
def cpu_compiles() -> bool:
    """Whether MLX's CPU backend builds compiled kernels here: it runs the system's C++ compiler at a kernel's first
    call, and a machine without one serves its layers op by op (the same bits, a few percent slower)."""
    try:
        mx.eval(mx.compile(lambda x: x * 2.0 + 1.0)(mx.ones(4, dtype=mx.float32)))
        return True
    except Exception as error:  # MLX raises the compiler's failure as it met it
        log.warning("layers run op by op: MLX could not build a compiled CPU kernel (%s)", error)
        return False


def compile_halves(layers: Sequence[nn.Module], usable: Mapping[str, object], kind: str,
                   traceable: Callable[[nn.Module], Sequence[bool]] | None = None) -> bool:
    """Compile each layer's cache-free parts (its `halves`, or else its `before` and `after`) where `compiling` says,
    those `traceable` allows (a part that reads arrays on the host, an MoE's picks, runs op by op). Weights are read
    at the trace, so they are fixed from here; every row count, window and stream goes through the same parts, so
    the row invariance is the kernels' own."""
    if not compiling(usable, kind):
        return False
    for layer in layers:
        halves = layer.halves or (layer.before, layer.after)
        allowed = traceable(layer) if traceable else [True] * len(halves)
        object.__setattr__(layer, "halves", tuple(ShapeCompiled(half) if ok else half
                                                  for half, ok in zip(halves, allowed)))
    return True
