"""The gates: 1 builds and launches, 2 served shapes, 3 edge shapes, 4 bit-equality, 5 launch limits."""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import devices
from .kernel_text import build, served_text
from .record import Case, KernelRecord, Shape, Source

INT_POISON = 2147483520.0  # exact in float32 and far past any id or flag, so an unwritten int output shows

# Hears (gate, shape label) before each shape a gate runs: an isolated run reports it, so a crash is placed.
OnShape = Callable[[int, str], None]


@dataclass
class GateResult:
    """One gate on one implementation: pass, fail, known (a finding excuses it) or not run, with the why."""

    gate: int
    status: str
    detail: str = ""
    problems: list = field(default_factory=list)  # gate 5: (limits name, problem) pairs
    failures: list = field(default_factory=list)  # gates 1-4: (shape label, why) of each red shape
    seconds: float | None = None  # how long the gate took, where it ran (an implementation's gates 1-4)

    @property
    def red(self) -> bool:
        return self.status in ("fail", "known")

    def as_json(self) -> dict:
        out = {"status": self.status, "detail": self.detail}
        if self.gate == 5:
            out["problems"] = [{"limits": name, "problem": text} for name, text in self.problems]
        elif self.failures:
            out["failed"] = [label for label, _ in self.failures]
        if self.seconds is not None:
            out["seconds"] = round(self.seconds, 3)
        return out

    @classmethod
    def from_json(cls, gate: int, data: dict) -> "GateResult":
        """The inverse of as_json (an isolated run's child reports gates this way); failures keep their labels."""
        problems = [(p["limits"], p["problem"]) for p in data.get("problems", [])]
        failures = [tuple(f) for f in data["failures"]] if "failures" in data else \
            [(label, data.get("detail", "")) for label in data.get("failed", [])]
        return cls(gate, data["status"], data.get("detail", ""), problems, failures, data.get("seconds"))


def _failed(gate: int, failures: list[tuple[str, str]]) -> GateResult:
    """A red gate from its red shapes: every one named, so a known finding can excuse exactly those."""
    shown = [why for _, why in failures[:4]]
    more = f"; and {len(failures) - 4} more shapes" if len(failures) > 4 else ""
    return GateResult(gate, "fail", "; ".join(shown) + more, failures=list(failures))


def make_case(record: KernelRecord, shape: Shape, rows: int, rng: np.random.Generator) -> Case:
    return Case(shape, rows, record.make(shape.dims, rows, rng), record.row_inputs)


class Inputs:
    """One record's inputs and references, drawn once per run: its implementations and controls meet the same."""

    def __init__(self, record: KernelRecord, seed: int):
        self.record, self.seed = record, seed
        self._cases: dict = {}
        self._refs: dict = {}

    def case(self, shape: Shape, rows: int) -> Case:
        key = (shape.label, rows)
        if key not in self._cases:
            rng = np.random.default_rng([self.seed, *(zlib.crc32(str(k).encode()) for k in (self.record.name, *key))])
            self._cases[key] = make_case(self.record, shape, rows, rng)
        return self._cases[key]

    def reference(self, case: Case) -> dict:
        key = (case.shape.label, case.rows)
        if key not in self._refs:
            self._refs[key] = self.record.reference(case)
        return self._refs[key]


def _kernel_name(kind: str, source: Source) -> str:
    """A name that changes with the text: MLX caches compiled kernels by name, in memory and on disk."""
    text = "\0".join([kind, served_text(source.header), served_text(source.body), *source.input_names, "|",
                      *source.output_names])
    return f"tf_{source.name}_{hashlib.sha1(text.encode()).hexdigest()[:12]}"


_BUILT: dict = {}


def _build(kind: str, source: Source, dynamic_shared: int):
    key = (kind, _kernel_name(kind, source), dynamic_shared)
    if key not in _BUILT:
        _BUILT[key] = build(kind, key[1], source.input_names, source.output_names, source.body, source.header,
                            dynamic_shared)
    return _BUILT[key]


def _poison(dtypes) -> float:
    """NaN where every output is floating; else an int sentinel (NaN cast to an int is undefined)."""
    return float("nan") if all(d in _floating() for d in dtypes) else INT_POISON


def _floating():
    import mlx.core as mx

    return (mx.float16, mx.bfloat16, mx.float32, mx.float64)


def run_source(kind: str, source: Source, case: Case) -> dict:
    """Launch a source kernel with every output pre-filled with poison, so an element it never writes fails."""
    import mlx.core as mx

    source = source.at(case)
    launch = source.launch(case)
    poison = _poison(launch.output_dtypes)
    if 0 in launch.grid:  # nothing to launch (the empty call): outputs stay poison, so they had better be empty
        outs = [mx.full(s, poison, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes)]
    else:
        kernel = _build(kind, source, launch.dynamic_shared)
        outs = kernel(inputs=source.inputs(case), template=list(launch.template), grid=launch.grid,
                      threadgroup=launch.threadgroup, output_shapes=list(launch.output_shapes),
                      output_dtypes=list(launch.output_dtypes), init_value=poison)
    return source.outputs(list(outs), case)


def run(kind: str, impl, case: Case) -> dict:
    """One call of an implementation on a case, evaluated."""
    import mlx.core as mx

    outs = run_source(kind, impl, case) if isinstance(impl, Source) else impl(case)
    mx.eval(list(outs.values()))
    return outs


def host(a) -> tuple[np.ndarray, np.ndarray]:
    """An mx.array on the host: (values as float64 or int64, raw bits for bit-equality)."""
    import mlx.core as mx

    if a.size == 0:
        # a zero-size array is all shape: build it here and never read MLX's buffer (MLX 0.32.4 on CUDA hands
        # numpy a zero-size result it never allocated, and reading one back crashed the H200 run with SIGSEGV)
        floating = mx.issubdtype(a.dtype, mx.floating)
        shape = tuple(a.shape)
        return np.zeros(shape, np.float64 if floating else np.int64), np.zeros(shape, f"u{a.dtype.size}")
    if a.dtype == mx.bfloat16:
        return np.array(a.astype(mx.float32)).astype(np.float64), np.array(a.view(mx.uint16))
    values = np.array(a)
    bits = values.view(f"u{values.dtype.itemsize}") if values.dtype.kind == "f" else values
    return (values.astype(np.float64) if values.dtype.kind == "f" else values.astype(np.int64)), bits


def _same(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise equality in which NaN equals NaN."""
    same = got == want
    return same | (np.isnan(got) & np.isnan(want)) if got.dtype.kind == "f" else same


def compare(record: KernelRecord, case: Case, outs: dict, expected: dict) -> tuple[bool, str, float]:
    """Outputs against the reference within the record's tolerance; (ok, why, worst error / allowed)."""
    worst, label = 0.0, case.shape.label
    for name, want in expected.items():
        if name not in outs:
            return False, f"{label}: no output {name!r}", float("inf")
        got, _ = host(outs[name])
        want = np.asarray(want)
        if got.shape != want.shape:
            return False, f"{label}: {name} has shape {got.shape}, expected {want.shape}", float("inf")
        tol = record.tolerance_for(case.dims, name)
        finite = np.isfinite(want) if want.dtype.kind == "f" else np.ones(want.shape, bool)
        # exact outputs must be equal; elsewhere non-finite references (-inf) must be met exactly and finite ones
        # by finite values (a poison NaN left in an unwritten element fails here)
        bad = ~_same(got, want) if tol.exact else (~finite & ~_same(got, want)) | (finite & ~np.isfinite(got))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            return False, f"{label}: {name}{list(where)} = {got[where]}, expected {want[where]}", float("inf")
        if tol.exact or got.size == 0:
            continue
        rows = want.shape[0]
        err = np.where(finite, np.abs(got - want), 0.0).reshape(rows, -1).max(axis=1)
        allowed = tol.atol + tol.rtol * np.where(finite, np.abs(want), 0.0).reshape(rows, -1).max(axis=1)
        ratio = err / np.maximum(allowed, np.finfo(np.float64).tiny)
        row = int(np.argmax(ratio))
        worst = max(worst, float(ratio[row]))
        if ratio[row] > 1.0:
            return False, (f"{label}: {name} row {row} off by {err[row]:.3g}, allowed {allowed[row]:.3g} "
                           f"(rtol {tol.rtol:g}, atol {tol.atol:g})"), worst
    return True, "", worst


def gate_build(record: KernelRecord, kind: str, impl, shapes: list[Shape], inputs: Inputs,
               on_shape: OnShape | None = None) -> GateResult:
    """Gate 1: the implementation builds and one call launches and evaluates."""
    shape = shapes[0]
    if on_shape is not None:
        on_shape(1, shape.label)
    try:
        run(kind, impl, inputs.case(shape, 1))
    except Exception as exc:  # any failure to build or launch is the finding
        return _failed(1, [(shape.label, f"{shape.label}: {type(exc).__name__}: {str(exc)[:300]}")])
    return GateResult(1, "pass", f"{shape.label}")


def gate_match(gate: int, record: KernelRecord, kind: str, impl, shapes: list[Shape], inputs: Inputs,
               every: bool = False, on_shape: OnShape | None = None) -> GateResult:
    """Gates 2 and 3: each shape's outputs match the float64 host reference on fresh inputs.

    A control stops at its first red shape; an implementation (`every`) runs them all, so each red one is named.
    """
    worst, exact, failures = 0.0, True, []
    for shape in shapes:
        if on_shape is not None:
            on_shape(gate, shape.label)
        try:
            case = inputs.case(shape, shape.rows)
            exact = exact and all(record.tolerance_for(shape.dims, name).exact for name in inputs.reference(case))
            ok, why, ratio = compare(record, case, run(kind, impl, case), inputs.reference(case))
        except Exception as exc:
            ok, why, ratio = False, f"{shape.label}: {type(exc).__name__}: {str(exc)[:300]}", 0.0
        if not ok:
            failures.append((shape.label, why))
            if not every:
                break
            continue
        worst = max(worst, ratio)
    if failures:
        return _failed(gate, failures)
    if exact:
        return GateResult(gate, "pass", f"{len(shapes)} shapes, exact")
    return GateResult(gate, "pass", f"{len(shapes)} shapes, worst error {worst:.2f} of allowed")


def _bits(outs: dict) -> dict:
    return {name: host(a)[1] for name, a in outs.items()}


def _differs(a: dict, b: dict, row_a: int | None = None, row_b: int | None = None) -> str | None:
    for name in a:
        x = a[name] if row_a is None else a[name][row_a]
        y = b.get(name)
        if y is None:
            return f"{name} missing"
        y = y if row_b is None else y[row_b]
        if x.shape != y.shape or not np.array_equal(x, y):
            return name
    return None


def gate_bits(record: KernelRecord, kind: str, impl, shapes: list[Shape], inputs: Inputs, others: dict,
              every: bool = False, on_shape: OnShape | None = None) -> GateResult:
    """Gate 4: each row of a k-row call bit-equal to its 1-row call (k = 1..max_rows), repeats, and claims."""
    claim = record.bit_equal_to.get(kind)
    checked, failures = [], []
    for shape in shapes:
        if on_shape is not None:
            on_shape(4, shape.label)
        why = _bits_of_shape(record, kind, impl, shape, inputs, others, claim, checked)
        if why:
            failures.append((shape.label, why))
            if not every:
                break
    if failures:
        return _failed(4, failures)
    n = record.max_rows
    what = f"rows 1..{n} and repeats bit-equal on {len(shapes)} shapes"
    if claim is not None:
        named = claim if isinstance(claim, str) else "the replaced kernel"
        what += "; " + ("; ".join(sorted(set(checked))) if checked else f"bit-equal to {named}")
    return GateResult(4, "pass", what)


def _bits_of_shape(record: KernelRecord, kind: str, impl, shape: Shape, inputs: Inputs, others: dict, claim,
                   checked: list, runner=None, rows: int | None = None) -> str | None:
    """Gate 4 on one shape: why it is red, or None. `runner(impl, case)` runs a call (default: on this device; the
    metal emulator passes its own, and may ask for fewer `rows` than the record's most)."""
    n = rows or record.max_rows
    call = runner or (lambda impl, case: run(kind, impl, case))
    try:
        case = inputs.case(shape, n)
        singles = [_bits(call(impl, case.take_rows(i, i + 1))) for i in range(n)]
        for k in range(1, n + 1):
            many = _bits(call(impl, case.take_rows(0, k)))
            for i in range(k):
                name = _differs(singles[i], many, 0, i)
                if name:
                    return f"{shape.label}: {name} row {i} of a {k}-row call differs from its 1-row call"
        again = _bits(call(impl, case))
        if _differs(many, again):
            return f"{shape.label}: a repeat of the {n}-row call differs"
        if claim is not None:
            if isinstance(claim, str) and claim not in others:
                checked.append(f"claim vs {claim} not run here")
            else:
                theirs = run(claim, others[claim], case) if isinstance(claim, str) else claim(case)
                name = _differs(many, _bits(theirs))
                if name:
                    what = claim if isinstance(claim, str) else getattr(claim, "__name__", "replaced")
                    return f"{shape.label}: {name} not bit-equal to {what}, as claimed"
    except Exception as exc:
        return f"{shape.label}: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def gate_limits(record: KernelRecord, kind: str, impl, device: devices.Device) -> GateResult:
    """Gate 5: every launch on every served and edge shape within the limits recorded for each device kind."""
    if not isinstance(impl, Source):
        return GateResult(5, "n/a", "composed ops: MLX sizes its own launches")
    problems: list[tuple[str, str]] = []
    limits = devices.limits_for(kind, device)
    for shape in (*record.shapes, *record.edges):
        try:
            launch = impl.launch(Case(shape, shape.rows, {}, record.row_inputs))
        except Exception as exc:
            problems.append(("launch", f"{shape.label}: {type(exc).__name__}: {exc}"))
            continue
        for lim in limits:
            for text in devices.check(launch, lim):
                if (lim.name, text) not in problems:
                    problems.append((lim.name, text))
    names = ", ".join(lim.name for lim in limits)
    if problems:
        return GateResult(5, "fail", "; ".join(f"{n}: {t}" for n, t in problems[:4]), problems)
    return GateResult(5, "pass", f"within {names}")
