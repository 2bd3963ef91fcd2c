"""What a kernel record says: reference, implementations, shapes, tolerances, controls and known findings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Union

import numpy as np

KINDS = ("mlx", "cuda", "metal")


@dataclass(frozen=True)
class Shape:
    """One call the server makes: named dims, the rows it carries (0: the empty call), and whether it is heavy."""

    label: str
    dims: Mapping[str, Any]
    rows: int = 16
    heavy: bool = False  # too slow for composed ops on the CPU backend: run only where a GPU runs them


@dataclass(frozen=True)
class Tolerance:
    """How far an output may stray from the reference, per row: atol + rtol * the row's largest |reference|."""

    rtol: float = 0.0
    atol: float = 0.0

    @property
    def exact(self) -> bool:
        return self.rtol == 0.0 and self.atol == 0.0


EXACT = Tolerance()


class Case:
    """One call's inputs: host arrays drawn for a shape, and the device arrays made from them (cached)."""

    def __init__(self, shape: Shape, rows: int, host: dict[str, np.ndarray], row_inputs: tuple[str, ...],
                 shared: dict | None = None):
        self.shape, self.rows, self.host, self.row_inputs = shape, rows, host, row_inputs
        self._own: dict = {}  # device arrays of per-row inputs: this call's only
        self._shared = shared if shared is not None else {}  # the rest (weights): one copy for every row slice

    @property
    def dims(self) -> Mapping[str, Any]:
        return self.shape.dims

    def __getitem__(self, name: str) -> np.ndarray:
        return self.host[name]

    def array(self, name: str, dtype=None):
        """The input as an mx.array (cast to `dtype` when given), made once per case."""
        import mlx.core as mx

        cache = self._own if name in self.row_inputs else self._shared
        key = (name, str(dtype))
        if key not in cache:
            value = mx.array(self.host[name])
            cache[key] = value.astype(dtype) if dtype is not None else value
        return cache[key]

    def take_rows(self, start: int, stop: int) -> "Case":
        """The same call on rows start..stop only; arrays that are not per row stay shared."""
        host = {k: (v[start:stop] if k in self.row_inputs else v) for k, v in self.host.items()}
        return Case(self.shape, stop - start, host, self.row_inputs, self._shared)


@dataclass(frozen=True)
class Launch:
    """One launch of a source kernel: grid in threads (as mx.fast kernels take it), group size, outputs, memory."""

    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtypes: tuple
    template: tuple = ()
    static_shared: int = 0  # bytes the body declares (__shared__ / threadgroup arrays), for gate 5
    dynamic_shared: int = 0  # bytes asked of mx.fast.cuda_kernel(shared_memory=...)

    @property
    def threads(self) -> int:
        x, y, z = self.threadgroup
        return x * y * z

    @property
    def shared(self) -> int:
        return self.static_shared + self.dynamic_shared


@dataclass(frozen=True)
class Source:
    """A kernel body for mx.fast.cuda_kernel or mx.fast.metal_kernel, and how to launch it on a case."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    body: str
    inputs: Callable[[Case], list]  # the device arrays, in input_names order
    launch: Callable[[Case], Launch]
    header: str = ""
    finish: Callable[[list, Case], dict] | None = None  # kernel outputs -> the record's outputs; default by name
    # the text a case launches, where fewer inputs serve it (MLX's launch costs grow with its inputs): a function of
    # this source, planted or not, and the case
    narrow: Callable[["Source", Case], "Source"] | None = None

    def at(self, case: Case) -> "Source":
        """The source `case` launches: this one, or the narrower one `narrow` makes of it."""
        return self if self.narrow is None else self.narrow(self, case)

    def outputs(self, arrays: list, case: Case) -> dict:
        if self.finish is not None:
            return self.finish(arrays, case)
        return dict(zip(self.output_names, arrays))


Implementation = Union[Callable[[Case], dict], Source]  # mlx: composed ops on a case; cuda / metal: a Source


@dataclass(frozen=True)
class Control:
    """A planted defect: a variant (or a transform) of one implementation, which the named gate must catch."""

    name: str
    kind: str  # the implementation it is planted into: "mlx", "cuda" or "metal"
    gate: int  # the gate (2..5) that must go red
    plant: Callable[[Implementation], Implementation]


@dataclass(frozen=True)
class Finding:
    """A known, explained red gate: excused where it matches, and counted as a known finding.

    The narrower the better: `case` names the one shape label it excuses, `symptom` a text the failure must show
    (an error message, "off by"), and `mlx` the MLX versions it was seen on. A gate is excused only when every
    red case in it is matched; a red case on another MLX version stays red, with a note to re-check the finding.
    """

    note: str
    kind: str  # implementation kind
    gate: int
    backend: str | None = None  # "cpu", "cuda" or "metal": where it applies; None: everywhere
    case: str | None = None  # the shape label it excuses; None: any case
    symptom: str | None = None  # a text the failure's detail must contain; None: any failure
    mlx: str | tuple[str, ...] | None = None  # the MLX versions it was seen on; None: every version

    def versions(self) -> tuple[str, ...] | None:
        return (self.mlx,) if isinstance(self.mlx, str) else self.mlx

    def matches(self, kind: str, gate: int, backend: str, case: str | None = None, text: str = "",
                mlx: str | None = None, any_version: bool = False) -> bool:
        versions = self.versions()
        return (self.kind == kind and self.gate == gate and self.backend in (None, backend)
                and self.case in (None, case) and (self.symptom is None or self.symptom in text)
                and (any_version or versions is None or mlx in versions))


@dataclass(frozen=True)
class KernelRecord:
    """One kernel under contract: everything the gates need, nothing about any family's model."""

    name: str
    family: str
    make: Callable[[Mapping[str, Any], int, np.random.Generator], dict[str, np.ndarray]]  # host inputs
    reference: Callable[[Case], dict[str, np.ndarray]]  # float64 (or exact integer) outputs, on the host
    implementations: Mapping[str, Implementation]
    shapes: tuple[Shape, ...]  # served shapes (gate 2, gate 4)
    edges: tuple[Shape, ...] = ()  # gate 3: 1 row, widest window, sizes off the tile, empty where legal
    tolerance: Tolerance | Mapping[str, Tolerance] | Callable[[Mapping[str, Any]], Any] = EXACT
    row_inputs: tuple[str, ...] = ()  # inputs whose axis 0 is the row; every output's axis 0 is the row
    max_rows: int = 16  # the widest window: gate 4 checks k = 1..max_rows
    controls: tuple[Control, ...] = ()
    findings: tuple[Finding, ...] = ()
    bit_equal_to: Mapping[str, Any] = field(default_factory=dict)  # kind -> another kind, or a callable(case)
    description: str = ""

    def tolerance_for(self, dims: Mapping[str, Any], output: str) -> Tolerance:
        tol = self.tolerance(dims) if callable(self.tolerance) else self.tolerance
        return tol.get(output, EXACT) if isinstance(tol, Mapping) else tol

    def problems(self) -> list[str]:
        """What makes this record unfit to run, in words (empty when it is well formed)."""
        out = []
        unknown = set(self.implementations) - set(KINDS)
        if unknown:
            out.append(f"unknown implementation kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
        if not self.shapes:
            out.append("no served shapes")
        if len(self.controls) < 2:
            out.append(f"{len(self.controls)} controls (a record carries at least 2 planted defects)")
        for control in self.controls:
            if control.kind not in self.implementations:
                out.append(f"control {control.name!r} plants into {control.kind!r}, which the record lacks")
            if control.gate not in (2, 3, 4, 5):
                out.append(f"control {control.name!r} expects gate {control.gate} (2..5)")
        return out
