"""The split bf16 GEMV: a tile's warps spread over blocks where a call has few, every sum left where it was."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_contract import Shape
from tensorfold_contract.helpers import groups
from tensorfold_core.row_kernels import gemv, gemv_fused
from tensorfold_core.row_kernels.gemv_sources import CUDA_BF16

ROWS = (0, 1, 2, 5, 8, 9, 16, 17, 33, 64, 65, 128, 300)
COLUMNS = (1, 33, 256, 2048, 3072, 8192, 8463, 16384)


def _records():
    served = (Shape("q/o 2048x2048", {"n": 2048, "k": 2048, "out": gemv.OUT}, gemv.WIDEST_CALL),)
    return [gemv.record("test", 16, served), *(gemv_fused.record("test", f, served) for f in gemv_fused.FUSIONS)]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", COLUMNS)
def test_a_split_launch_runs_the_same_warps_over_more_blocks_of_fewer_warps(rows, n):
    unsplit = gemv.bf16_launch(rows, n, gemv.OUT, splits=1)
    for splits in (1, 2, 4, 8):
        launch = gemv.bf16_launch(rows, n, gemv.OUT, splits=splits)
        assert launch.threadgroup == (gemv.WARPS // splits * 32, 1, 1)
        assert launch.grid == unsplit.grid  # the same warps: 8 a tile, whatever blocks hold them
        assert dict(launch.template)["SPLIT"] == splits


@pytest.mark.parametrize("rows", ROWS[1:])
@pytest.mark.parametrize("n", COLUMNS)
def test_split_doubles_only_while_a_call_has_fewer_blocks_than_the_sms_want(rows, n):
    maxt, mt, _ = gemv.tiles(rows)
    blocks = groups(n, 16 * mt) * groups(rows, 8 * maxt)
    chosen = gemv.split(rows, n)
    assert chosen in (1, 2, 4, 8)
    assert blocks * chosen >= gemv.BLOCKS_WANTED or chosen == gemv.WARPS
    assert chosen == 1 or blocks * chosen // 2 < gemv.BLOCKS_WANTED


def test_a_one_row_call_of_2048_columns_splits_and_a_wide_call_does_not():
    assert gemv.split(1, 2048) == 8 and gemv.split(1, 3072) == 4 and gemv.split(1, 16384) == 1
    assert gemv.split(128, 2048) == 1 and gemv.split(17, 2048) == 4


def test_gate_4_meets_every_split_and_the_unsplit_kernel_on_one_served_shape():
    # rows 1..128 of a call are held to their one-row call, which splits: so every SPLIT is held to SPLIT 8
    assert {gemv.split(rows, 2048) for rows in range(1, gemv.WIDEST_CALL + 1)} == {1, 2, 4, 8}


def test_the_scratch_holds_a_counter_a_tile_then_each_tile_s_chains_of_its_rows():
    assert gemv.scratch_words(1, 2048, (1, 2, 1), 1) == 1  # unsplit: never read
    tiles = 2048 // 32
    assert gemv.scratch_words(1, 2048, (1, 2, 1), 8) == tiles + tiles * 8 * 32 * 1
    assert gemv.scratch_words(300, 48, (2, 2, 1), 8) == 2 * 19 + 2 * 19 * 8 * 32 * 16
    launch = gemv.bf16_launch(5, 40, gemv.OUT)
    made = gemv.scratch(launch)
    assert made.dtype == mx.int32 and made.size == gemv.scratch_words(5, 40, gemv.tiles(5), gemv.split(5, 40))
    assert not mx.any(made).item()


def test_both_folds_share_one_warp_order_loop_and_one_store_so_every_text_swap_reaches_the_split():
    assert CUDA_BF16.count("for (int p = 1; p < WARPS; ++p) v += chain(p);") == 1
    assert CUDA_BF16.count("y[(size_t)row * N + col] = static_cast<T>(v);") == 1
    assert CUDA_BF16.count("atomicAdd") == 1 and CUDA_BF16.count("__threadfence()") == 2
    assert "done[tile] = 0" in CUDA_BF16  # the last block leaves the counter as it found it


@pytest.mark.parametrize("record", _records(), ids=lambda r: r.name)
def test_every_bf16_record_plants_its_controls_and_runs_both_folds_at_its_edges(record):
    cuda = record.implementations["cuda"]
    for control in record.controls:
        control.plant(record.implementations[control.kind])  # a swap whose text moved raises here
    assert {"warp sums folded in reverse when many rows", "split warp sums folded in reverse when many rows"} <= \
        {c.name for c in record.controls if c.kind == "cuda" and c.gate == 4}
    splits = {dict(cuda.launch(SimpleNamespace(rows=s.rows, dims=s.dims)).template)["SPLIT"]
              for s in record.edges if s.rows}
    assert 1 in splits and len(splits) > 1


@pytest.mark.parametrize("record", _records(), ids=lambda r: r.name)
def test_metal_keeps_a_tile_s_warps_in_one_threadgroup(record):
    metal = record.implementations["metal"]
    for shape in (*record.shapes, *record.edges):
        launch = metal.launch(SimpleNamespace(rows=shape.rows, dims=shape.dims))
        assert launch.threadgroup == (gemv.WARPS * 32, 1, 1) and "SPLIT" not in dict(launch.template)
        assert "scratch" not in metal.input_names


def test_the_split_control_reverses_the_fold_only_where_the_kernel_splits():
    record = _records()[0]
    control = next(c for c in record.controls if c.name == "split warp sums folded in reverse when many rows")
    body = control.plant(record.implementations["cuda"]).body
    assert "if (rows > 1 && SPLIT > 1) { v = chain(WARPS - 1);" in body


def test_served_calls_share_one_scratch_a_size_across_modules(monkeypatch):
    from tensorfold_contract import serving

    launches = []

    def kernel(inputs, **launch):  # stands in for the built cuda kernel
        launches.append((inputs, launch))
        return [mx.zeros(launch["output_shapes"][0], launch["output_dtypes"][0])]

    monkeypatch.setattr(serving, "_kernel", lambda kind, source, shared: kernel)
    weights = {"w": mx.zeros((40, 64), mx.bfloat16)}
    prepared = serving.Prepared("cuda", gemv.source("cuda", 16), {"n": 40, "k": 64, "out": gemv.OUT},
                                lambda: weights, "x")
    other = serving.Prepared("cuda", gemv.source("cuda", 16), {"n": 40, "k": 64, "out": gemv.OUT},
                             lambda: weights, "x")
    prepared(mx.ones((1, 64), mx.bfloat16))
    prepared(mx.ones((1, 64), mx.bfloat16))
    prepared(mx.ones((2, 64), mx.bfloat16))
    other(mx.ones((1, 64), mx.bfloat16))
    (one, launch), (again, _), (two, _), (others, _) = launches
    assert again[3] is one[3] and others[3] is one[3] and two[3] is not one[3]
    assert gemv.scratch(gemv.bf16_launch(1, 40, gemv.OUT)) is not gemv.scratch(gemv.bf16_launch(1, 40, gemv.OUT))
    assert dict(launch["template"])["SPLIT"] == 8 and launch["threadgroup"] == (32, 1, 1)


def test_the_tile_bench_checks_every_split_bit_equal_before_it_times_one(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import bench_gemv_tiles as bench

    seen = []

    def build(kind, source, shared):
        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            split = dict(template)["SPLIT"]
            seen.append((split, threadgroup[0], inputs[3].size))
            y = (inputs[0].astype(mx.float32) @ inputs[1].astype(mx.float32).T).astype(mx.bfloat16)
            return [y + 1 if split == 4 and output_shapes[0][0] > 1 else y]  # SPLIT 4 is off at many rows
        return kernel

    monkeypatch.setattr(bench, "_build", build)
    monkeypatch.setattr(bench, "LAUNCHES", 2)
    monkeypatch.setattr(bench, "REPS", 1)
    args = SimpleNamespace(warps="8", splits="1,2,4,8", tiles="served", shapes="64x64", rows="1,3", seconds=600,
                           json=None)
    cells, failures = bench.sweep(args)
    assert [c["rows"] for c in cells] == [1, 3]
    assert sorted(cells[0]["best_by_split"]) == ["1", "2", "4", "8"]
    assert sorted(cells[1]["best_by_split"]) == ["1", "2", "8"]  # the one that differs is never timed
    assert any("SPLIT=4" in f and "differs" in f for f in failures)
    assert {(split, threads) for split, threads, _ in seen} == {(1, 256), (2, 128), (4, 64), (8, 32)}
    assert np.all([size > 1 for split, _, size in seen if split > 1])
