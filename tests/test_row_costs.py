"""Forwards timed at start: a timed engine that may draft primes its shared rounds' cost lines, band by band."""

from __future__ import annotations

import pytest

from tensorfold_core.lanes.engine import Engine
from tensorfold_core.lanes.guards import SharedGuard
from tensorfold_core.lanes.row_costs import TIME_ROWS_ENV, band_counts
from tensorfold_core.loading import load_model


@pytest.fixture(scope="module")
def model(tiny_llama_path):
    return load_model(str(tiny_llama_path))[0]


@pytest.fixture
def timing(monkeypatch):
    """Forwards timed at start on this CPU too (a GPU's default)."""
    monkeypatch.setenv(TIME_ROWS_ENV, "1")


def test_each_band_of_shared_rounds_is_timed_at_its_widest_count_that_fits_the_slots():
    assert band_counts(1) == []
    assert band_counts(4) == [2, 4]
    assert band_counts(6) == [2, 4, 6]
    assert band_counts(16) == [2, 4, 8, 16]


def test_a_timed_engine_that_may_draft_primes_a_line_for_each_band_with_forwards_of_one_and_five_rows(model, timing):
    engine = Engine(model, timed=True)
    timed = engine.time_rows(8)
    assert {streams: sorted(forwards) for streams, forwards in timed.items()} == \
        {2: [2, 10], 4: [4, 20], 8: [8, 40]}
    assert all(ms > 0 for forwards in timed.values() for ms in forwards.values())
    for streams, forwards in timed.items():
        line = engine.planner.shared_costs[SharedGuard.band(streams)]
        assert line.timed  # in ms from the first round: a hold's pass can be weighed against its rows
        assert line.round_ms(5 * streams) >= line.round_ms(streams) > 0


def test_an_engine_that_is_untimed_runs_alone_or_fixes_its_depth_times_nothing(model, timing):
    assert Engine(model).time_rows(8) == {}
    assert Engine(model, timed=True, shared_rounds=False).time_rows(8) == {}
    assert Engine(model, timed=True, fixed_depth=2).time_rows(8) == {}
    assert Engine(model, timed=True, copy_drafts=False).time_rows(8) == {}  # no drafter, no copies: nothing drafts


def test_the_timed_forwards_leave_the_model_serving_the_same_tokens(model, timing):
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.testing import solo

    request = GenerationRequest(prompt_ids=[5, 9, 2, 7], max_tokens=12)
    before = solo(model, request)
    assert Engine(model, timed=True).time_rows(4)
    assert solo(model, request) == before


def test_on_the_cpu_a_server_keeps_the_prior_unless_asked_and_time_rows_0_keeps_it_anywhere(served, model,
                                                                                           monkeypatch):
    assert served.host.engine.planner.shared_costs == {}  # the CPU's shares are the prior's own
    assert Engine(model, timed=True).time_rows(4) == {}
    monkeypatch.setenv(TIME_ROWS_ENV, "1")
    assert sorted(Engine(model, timed=True).time_rows(4)) == [2, 4]
    monkeypatch.setenv(TIME_ROWS_ENV, "0")
    engine = Engine(model, timed=True)
    assert engine.time_rows(8) == {} and engine.planner.shared_costs == {}


def test_a_gpu_times_its_forwards_by_default_and_the_cpu_does_not(monkeypatch):
    import mlx.core as mx

    from tensorfold_core.lanes import row_costs

    monkeypatch.delenv(TIME_ROWS_ENV, raising=False)
    assert not row_costs.times_rows()
    monkeypatch.setattr(row_costs.mx, "default_device", lambda: mx.Device(mx.DeviceType.gpu))
    assert row_costs.times_rows()
    monkeypatch.setenv(TIME_ROWS_ENV, "0")
    assert not row_costs.times_rows()
