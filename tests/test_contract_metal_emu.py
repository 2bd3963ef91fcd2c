"""Every metal source, run on the host's threads as an emulated threadgroup, matches its record's float64 reference
and gives each row the bits of its 1-row call."""

from __future__ import annotations

import pytest

from tensorfold_contract.metal_shim import compiler
from tensorfold_contract.metal_emu import emulated, emulated_gate4, emulated_rows
from tensorfold_contract.record import Source
from tensorfold_contract.registry import discover

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")
METAL = [reg.record for reg in discover() if reg.record is not None
         and isinstance(reg.record.implementations.get("metal"), Source)]


@pytest.mark.parametrize("record", METAL, ids=[r.name for r in METAL])
def test_the_metal_source_run_emulated_matches_its_reference_and_its_rows_do_not_depend_on_the_row_count(record):
    ok, why = emulated(record)
    assert ok, why
    ok, why = emulated_rows(record)
    assert ok, why


def test_a_planted_metal_defect_misses_the_reference_when_emulated():
    record = next(r for r in METAL if r.name == "dspark confidence head")
    control = next(c for c in record.controls if c.kind == "metal" and c.gate != 5)
    ok, why = emulated(record, control.plant(record.implementations["metal"]))
    assert not ok and "tiny drafter" in why


def test_a_barrier_only_some_threads_reach_is_reported_not_hung():
    record = next(r for r in METAL if r.name == "llama rmsnorm")
    metal = record.implementations["metal"]
    import dataclasses

    stuck = dataclasses.replace(metal, body=metal.body.replace(
        "threadgroup_barrier(mem_flags::mem_threadgroup);",
        "if (thread_position_in_threadgroup.x == 0) threadgroup_barrier(mem_flags::mem_threadgroup);", 1))
    assert stuck.body != metal.body
    ok, why = emulated(record, stuck)
    assert not ok and ("wait at different points" in why or "returned before" in why), why


GATE4 = [r for r in METAL if any(c.kind == "metal" and c.gate == 4 for c in r.controls)]


@pytest.mark.parametrize("record", GATE4, ids=[r.name for r in GATE4])
def test_a_planted_metal_gate_4_control_goes_red_under_the_emulated_gate_4_where_the_source_stays_green(record):
    from tensorfold_contract.metal import GATE4_ROWS

    rows = min(GATE4_ROWS, record.max_rows)
    control = next(c for c in record.controls if c.kind == "metal" and c.gate == 4)
    ok, why = emulated_gate4(record, control.plant(record.implementations["metal"]), rows=rows)
    assert not ok and "differs from its 1-row call" in why
    caught = next(s for s in record.shapes if why.startswith(f"{s.label}:"))
    ok, why = emulated_gate4(record, shapes=lambda light: [caught], rows=rows)
    assert ok, why
