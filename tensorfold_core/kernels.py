"""Which implementation backs each of a family's row-path ops on this backend: one table per family, read at load."""

from __future__ import annotations

import os
import warnings
from typing import Callable, Mapping

from .errors import OptionError

BACKENDS = ("cpu", "cuda", "metal")
BUILTIN = "mlx"  # MLX's own op: served where the row-invariance probe proves it (the CPU today)
KERNELS_ENV = "TENSORFOLD_KERNELS"  # "builtin" or "records": override the table (tests, measurements); "table": none
# ops (comma-separated, as the table names them) left to MLX on top of the rest: a measurement's attribution of time
BUILTIN_OPS_ENV = "TENSORFOLD_KERNELS_BUILTIN"
RECORDS_KIND = {"cpu": "mlx", "cuda": "cuda", "metal": "metal"}  # a record's implementation each backend runs
# "1": a drafter runs MLX's own ops instead of the kernel tables (a measurement: bench variant `:drafter-builtin`)
DRAFTER_BUILTIN_ENV = "TENSORFOLD_DRAFTER_BUILTIN"
# where rope runs by rows, every stream's attention of a layer is one launch over caches of one buffer each (the
# default where the packed-streams record serves); "0" launches it a stream at a time, to measure (docs/gpu.md)
STREAMS_ENV = "TENSORFOLD_STREAM_ATTENTION"
# where the streams attention serves, the layers' new keys and values stacked in one launch of the stack kv record
# (the default where it serves); "0" stacks them with MLX's ops, a copy a layer, to measure
STACK_KV_ENV = "TENSORFOLD_STACK_KV"
# the switches that leave an op's record unused whatever the table says (the families' ops of these names)
SWITCHES = {"attention streams": (STREAMS_ENV,), "conv streams": (STREAMS_ENV,),
            "block attention streams": (STREAMS_ENV,), "stack kv": (STREAMS_ENV, STACK_KV_ENV)}


def backend() -> str:
    """The backend this process computes on: cpu, cuda or metal."""
    import mlx.core as mx  # plugins read their tables without loading MLX

    if mx.default_device().type == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def served(table: Mapping[str, Mapping[str, str]], on: str | None = None) -> dict[str, str]:
    """Each op's implementation on backend `on` (default: this one): `mlx` for MLX's built-in, else the name of
    the kernel record whose implementation for that backend serves it. TENSORFOLD_KERNELS=records serves every op
    that has a record through it (on the CPU through the record's composed `mlx` implementation), =builtin none;
    TENSORFOLD_KERNELS_BUILTIN then leaves the ops it lists to MLX."""
    on = on or backend()
    override = os.environ.get(KERNELS_ENV, "")
    if override not in ("", "table", "builtin", "records"):
        raise OptionError(f"{KERNELS_ENV}={override}: expected table, builtin or records")
    left = {op.strip() for op in os.environ.get(BUILTIN_OPS_ENV, "").split(",") if op.strip()}
    if left - set(table):
        raise OptionError(f"{BUILTIN_OPS_ENV}: no op {sorted(left - set(table))[0]!r} in this family's table "
                          f"(it has: {', '.join(table)})")
    out = {}
    for op, choices in table.items():
        chosen = choices.get(on, BUILTIN)
        record = next((name for name in choices.values() if name != BUILTIN), None)
        if override == "builtin" or op in left:
            chosen = BUILTIN
        elif override == "records" and record is not None:
            chosen = record
        out[op] = chosen
    return out


def describe(table: Mapping[str, Mapping[str, str]]) -> dict:
    """The table as `capabilities --json` shows it: every backend's choice, and what this process serves."""
    here = backend()
    serving = {op: _label(name, here) for op, name in served(table).items()}
    for op, switches in SWITCHES.items():  # a loaded model also says where its path does not apply (`unused`)
        if any(os.environ.get(name, "1") == "0" for name in switches):
            unused(serving, (op,), *switches)
    return {"backend": here, "serving": serving, "table": {op: dict(choices) for op, choices in table.items()}}


def _label(name: str, on: str) -> str:
    return name if name == BUILTIN else f"{name} ({RECORDS_KIND[on]})"


def records_served(table: Mapping[str, Mapping[str, str]], records: Callable[[], list]) -> tuple[dict, str, dict]:
    """What a family's forward serves here: (op -> the kernel record serving it, the records' implementation kind,
    op -> its label for `Model.kernels`). `records` (the plugin's, loading MLX and the contract) is called only
    where some op is served by a record; an op whose record has no implementation for this backend, or whose
    implementation misses its reference in the load self-test (tensorfold_contract.selftest), stays built-in."""
    here = backend()
    choice, kind = served(table, here), RECORDS_KIND[here]
    by_name = {record.name: record for record in records()} if any(n != BUILTIN for n in choice.values()) else {}
    usable = {op: by_name[name] for op, name in choice.items()
              if name != BUILTIN and kind in by_name[name].implementations}
    labels = {op: (f"{name} ({kind})" if op in usable else BUILTIN) for op, name in choice.items()}
    if usable:
        from tensorfold_contract.selftest import failures

        failed = failures(list({id(r): r for r in usable.values()}.values()), kind)
        for op in [op for op, record in usable.items() if record.name in failed]:
            name = usable.pop(op).name
            labels[op] = f"{BUILTIN} ({name} ({kind}) failed its load self-test)"
            warnings.warn(f"{op}: the kernel record {name!r} ({kind}) missed its float64 reference on this "
                          f"machine ({failed[name]}); MLX's own op serves it instead (`tensorfold contract --only "
                          f"{name!r}` shows more)", RuntimeWarning, stacklevel=2)
    return usable, kind, labels


def unused(labels: dict, ops, *switches: str) -> None:
    """Relabel `ops` whose records this forward does not call as MLX's, saying why: the first of `switches` set to
    0 (a measurement), else that their path does not apply here; a label names what runs, not what the table chose."""
    why = next((f"{name}=0" for name in switches if os.environ.get(name, "1") == "0"), "not on this forward's path")
    for op in ops:
        if op in labels and not labels[op].startswith(BUILTIN):
            labels[op] = f"{BUILTIN} ({labels[op]} unused: {why})"


def missing_records(table: Mapping[str, Mapping[str, str]], records: list) -> list[str]:
    """What a family's table names and its plugin does not ship: a record, or its implementation for a backend."""
    by_name = {record.name: record for record in records}
    out = []
    for op, choices in table.items():
        out += [f"{op}: no {on} column" for on in BACKENDS if on not in choices]
        for on, name in choices.items():
            if name == BUILTIN:
                continue
            if name not in by_name:
                out.append(f"{op} on {on}: no record {name!r}")
            elif RECORDS_KIND[on] not in by_name[name].implementations:
                out.append(f"{op} on {on}: {name!r} has no {RECORDS_KIND[on]} implementation")
    return out
