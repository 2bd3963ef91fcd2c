"""The Markov pick's cuda and metal sources: their launches, their planted controls, and their sm_90 build."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from tensorfold_contract import Case, Source, gates, run_contract
from tensorfold_dspark.kernels import markov
from tensorfold_dspark.kernels.markov import RECORD

NOT_RUN = {"cuda": "not run (no CUDA device)", "metal": "not run (no Metal device)"}


@pytest.fixture(scope="module")
def report():
    return run_contract(only=["dspark markov pick"], seed=20261202)


def _launch(kind: str, shape, rows: int):
    return RECORD.implementations[kind].launch(Case(shape, rows, {}, RECORD.row_inputs))


def test_the_record_ships_cuda_and_metal_sources_beside_the_mlx_pick():
    assert {kind: type(impl) for kind, impl in RECORD.implementations.items() if kind != "mlx"} == {
        "cuda": Source, "metal": Source}
    assert RECORD.problems() == []


def test_the_sources_are_not_run_here_but_their_launches_fit_every_device_s_limits(report):
    (kernel,) = report.kernels
    for kind, why in NOT_RUN.items():
        assert kernel.implementations[kind].status == why
        assert kernel.implementations[kind].gates[5].status == "pass", kernel.implementations[kind].gates[5].detail
    assert report.summary()["limit_problems"] == 0


def test_the_mlx_pick_still_passes_and_every_control_that_runs_here_is_red(report):
    (kernel,) = report.kernels
    assert kernel.implementations["mlx"].status == "pass"
    for control in kernel.controls:
        assert control.status in ("red", NOT_RUN.get(control.kind)), (control.name, control.status, control.detail)
    assert {(c.kind, c.gate) for c in kernel.controls if c.gate == 5 and c.status == "red"} == {("cuda", 5),
                                                                                                 ("metal", 5)}
    assert report.summary()["missed"] == 0


def test_the_cuda_controls_plant_edits_of_the_cuda_source_caught_by_gates_2_4_and_5():
    cuda = RECORD.implementations["cuda"]
    planted = {c.name: (c.gate, c.plant(cuda)) for c in RECORD.controls if c.kind == "cuda"}
    assert {name: gate for name, (gate, _) in planted.items()} == {
        "ties to the highest id": 2, "NaN rows not flagged": 2, "W1 of the next row's token": 2,
        "row-count-dependent tie order in the fold": 4, "over-sized threadgroup": 5}
    for name, (gate, source) in planted.items():
        if gate == 5:
            assert _threads(source) > 1024 >= _threads(cuda)
        else:
            assert (source.header, source.body) != (cuda.header, cuda.body), name


def _threads(source: Source) -> int:
    return source.launch(Case(RECORD.shapes[0], 16, {}, RECORD.row_inputs)).threads


def test_a_row_is_one_block_whose_kernel_text_never_follows_the_row_count():
    for kind in ("cuda", "metal"):
        for shape in (*RECORD.shapes, *RECORD.edges):
            launches = [_launch(kind, shape, rows) for rows in range(RECORD.max_rows + 1)]
            assert {(launch.template, launch.threadgroup) for launch in launches} == {
                (launches[0].template, (markov.THREADS, 1, 1))}
            assert [launch.grid for launch in launches] == [(rows * markov.THREADS, 1, 1)
                                                            for rows in range(RECORD.max_rows + 1)]


def test_an_empty_call_launches_no_block_and_gives_empty_ids_and_flags():
    empty = next(shape for shape in RECORD.edges if shape.rows == 0)
    launch = _launch("cuda", empty, 0)
    assert launch.grid[0] == 0 and launch.output_shapes == ((0,), (0,))
    case = gates.make_case(RECORD, empty, 0, np.random.default_rng(0))
    outs = gates.run("cuda", RECORD.implementations["cuda"], case)
    assert [tuple(a.shape) for a in outs.values()] == [(0,), (0,)]


def test_a_team_of_lanes_shares_each_vocab_entry_by_the_rank_alone():
    assert [markov._team(rank) for rank in (16, 64, 96, 256, 512)] == [1, 4, 8, 16, 16]


def test_a_rank_off_the_16_code_chunks_is_refused_at_launch():
    shape = markov._shape("rank 40", 100, 40, group=8, rows=2)
    with pytest.raises(ValueError, match="16-code chunks"):
        RECORD.implementations["cuda"].launch(Case(shape, 2, {}, RECORD.row_inputs))


def test_the_launches_declare_the_shared_memory_their_bodies_use():
    for kind in ("cuda", "metal"):
        source = RECORD.implementations[kind]
        arrays = source.body.count("__shared__" if kind == "cuda" else "threadgroup float") + \
            source.body.count("threadgroup int")
        assert arrays == 3 and _launch(kind, RECORD.shapes[-1], 16).static_shared == 3 * 32 * 4


@pytest.mark.skipif(not (shutil.which("nvcc") and os.environ.get("TENSORFOLD_MLX_CUDA_INCLUDE")),
                    reason="needs nvcc and TENSORFOLD_MLX_CUDA_INCLUDE (MLX's CUDA device headers)")
def test_the_cuda_source_and_its_planted_controls_compile_for_sm90():
    from tensorfold_contract import nvcc

    include = os.environ["TENSORFOLD_MLX_CUDA_INCLUDE"]
    assert nvcc.main(["--include", include, "--quick", "--only", "dspark markov pick"]) == 0
