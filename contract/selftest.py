"""At load, each kernel record about to serve meets its float64 reference once, on this machine, before it serves."""

# The contract proves a record on the machines it ran on; a user's machine may be one it never met (a Metal GPU,
# where no record has run). One small case a record, run by the implementation this backend serves, catches a kernel
# that does not build or computes something else here; its op then stays with MLX's own, with a warning naming why.
# It proves no row invariance (the load probe checks that) and no edge: `tensorfold contract` does.
# A GPU kernel's case builds kernels the served path does not (18-22 s a load of a 1B llama on the H200), so a pass
# of a cuda or metal source is remembered on disk under everything that decides its bits: the kernel's text and
# launch, the case, MLX's version and the device. A failure is never remembered: the next load tries again.

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from .gates import compare, make_case, run
from .record import KernelRecord, Source

SELF_TEST_ENV = "TENSORFOLD_SELF_TEST"  # "0": serve the records untested (a measurement of load time)
# the file of remembered passes; "0" remembers none (default: $XDG_CACHE_HOME or ~/.cache, tensorfold/self-test.json)
SELF_TEST_CACHE_ENV = "TENSORFOLD_SELF_TEST_CACHE"
# what of mx.device_info() names the kind of GPU (CUDA's and Metal's names for it)
DEVICE_KEYS = ("device_name", "architecture", "compute_capability_major", "compute_capability_minor")
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


def one_case(record: KernelRecord) -> tuple:
    """The record's (shape, case) of the self-test: its smallest light shape at two rows, seeded."""
    shapes = [s for s in record.shapes if not s.heavy and s.rows > 0] or list(record.shapes)
    shape = min(shapes, key=lambda s: int(np.prod([v for v in s.dims.values() if isinstance(v, int)] or [1])))
    return shape, make_case(record, shape, min(ROWS, shape.rows), np.random.default_rng(0))


def _failure(record: KernelRecord, kind: str) -> str:
    """Why the record's `kind` implementation failed its one case ("" where it passed)."""
    impl, key, shape = record.implementations[kind], None, None
    try:
        shape, case = one_case(record)
        key = source_key(record, kind, shape, case)
        if key is not None and key in _passed():
            return ""
        ok, why, _ = compare(record, case, run(kind, impl, case), record.reference(case))
    except Exception as exc:  # a kernel that does not build here, or dies: the op stays with MLX's own
        ok, why = False, f"{shape.label if shape else 'its case'}: {type(exc).__name__}: {str(exc)[:300]}"
    if ok and key is not None:
        _remember(key, f"{record.name} ({kind})")
    return "" if ok else why


def source_key(record: KernelRecord, kind: str, shape, case) -> str | None:
    """What decides the `kind` source's bits on this case here, hashed; None for composed ops (cheap to run, and
    their code is not one text)."""
    impl = record.implementations[kind]
    if not isinstance(impl, Source):
        return None
    import mlx.core as mx

    source, launch = impl.at(case), impl.at(case).launch(case)
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    device = sorted((k, str(v)) for k, v in info.items() if k in DEVICE_KEYS)  # not its free memory, nor which card
    what = [record.name, kind, source.name, source.header, source.body, source.input_names, source.output_names,
            shape.label, sorted(shape.dims.items(), key=str), case.rows, repr(launch), mx.__version__, device,
            str(mx.default_device())]
    return hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()


def _cache_file() -> Path | None:
    where = os.environ.get(SELF_TEST_CACHE_ENV)
    if where is not None:
        return None if where in ("", "0") else Path(where)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tensorfold" / "self-test.json"


def _passed() -> dict:
    """The remembered passes (none where the file is missing, unreadable or not ours)."""
    path = _cache_file()
    try:
        passed = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
    return passed if isinstance(passed, dict) else {}


def _remember(key: str, what: str) -> None:
    """Add a pass to the file, written whole and renamed into place; a home it cannot write remembers nothing."""
    path = _cache_file()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        passed = {**_passed(), key: what}
        part = path.with_name(f".{path.name}.{os.getpid()}")
        part.write_text(json.dumps(passed, indent=0, sort_keys=True))
        os.replace(part, path)
    except OSError:
        pass
