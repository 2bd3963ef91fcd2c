"""At load, each kernel record about to serve meets its float64 reference once, on this machine, before it serves."""

# The contract proves a record on the machines it ran on; a user's machine may be one it never met (a Metal GPU,
# where no record has run). One small case a record, run by the implementation this backend serves, catches a kernel
# that does not build or computes something else here; its op then stays with MLX's own, with a warning naming why.
# It proves no row invariance (the load probe checks that) and no edge: `tensorfold contract` does.

from __future__ import annotations

import os

import numpy as np

from .gates import compare, make_case, run
from .record import KernelRecord

SELF_TEST_ENV = "TENSORFOLD_SELF_TEST"  # "0": serve the records untested (a measurement of load time)
ROWS = 2  # a window's two rows: the served path's multi-row code, cheap to build


def failures(records: list[KernelRecord], kind: str) -> dict[str, str]:
    """Record name -> why, for each of `records` whose `kind` implementation misses its reference here."""
    if os.environ.get(SELF_TEST_ENV, "1") == "0":
        return {}
    out = {}
    for record in records:
        key = (id(record), kind)
        if key not in _SEEN:  # once a process: the record kept with its verdict, so its id stays its own
            _SEEN[key] = (record, _failure(record, kind))
        if _SEEN[key][1]:
            out[record.name] = _SEEN[key][1]
    return out


_SEEN: dict = {}


def _failure(record: KernelRecord, kind: str) -> str:
    """Why the record's `kind` implementation failed its one case ("" where it passed)."""
    shapes = [s for s in record.shapes if not s.heavy and s.rows > 0] or list(record.shapes)
    shape = min(shapes, key=lambda s: int(np.prod([v for v in s.dims.values() if isinstance(v, int)] or [1])))
    try:
        case = make_case(record, shape, min(ROWS, shape.rows), np.random.default_rng(0))
        ok, why, _ = compare(record, case, run(kind, record.implementations[kind], case), record.reference(case))
    except Exception as exc:  # a kernel that does not build here, or dies: the op stays with MLX's own
        ok, why = False, f"{shape.label}: {type(exc).__name__}: {str(exc)[:300]}"
    return "" if ok else why
