"""The draft ids record on the CPU: the composed op packs windows as the host does; make's streams own their rows."""

from __future__ import annotations

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_contract import Case, gates
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_dspark.kernels import draft_ids
from tensorfold_dspark.kernels.draft_ids import RECORD
from tensorfold_dspark.plugin import MODELS

VOCAB = 100


def test_the_records_tiny_shape_is_the_shipped_drafters_vocabulary_and_block():
    config = Checkpoint.open(MODELS / "tiny-lfm2-moe-dspark").config
    assert (config["vocab_size"], config["block_size"]) == (draft_ids.TINY["vocab"], draft_ids.TINY["depth"])


def test_adjacent_windows_are_packed_as_the_host_packs_them_with_ids_off_the_vocabulary_as_0():
    pending = [7, 8, 9, 10]
    picks = [[1, VOCAB, 3], [-1, 5, 6], [11, 12, 13], [2 ** 31 - 1, 14, 15]]
    counts = [3, 2, 0, 1]
    windows = [[p, *(t if 0 <= t < VOCAB else 0 for t in row[:n])] for p, row, n in zip(pending, picks, counts)]
    host = [token for window in windows for token in window]  # the verify's ids, every window against the next
    starts = np.cumsum([0] + [len(w) for w in windows[:-1]])
    ids = mx.full((len(host) + 2,), 99, mx.uint32)  # two rows of another stream after the windows
    out = draft_ids.draft_ids(ids, mx.array(starts, mx.int32), mx.array(pending, mx.int32),
                              mx.array(picks, mx.int32), mx.array(counts, mx.int32), VOCAB)
    assert out.dtype == mx.uint32 and out.tolist() == host + [99, 99]


def test_no_stream_leaves_the_verifys_ids_as_they_are():
    ids = mx.array([4, 5, 6], mx.uint32)
    empty = mx.zeros((0,), mx.int32)
    out = draft_ids.draft_ids(ids, empty, empty, mx.zeros((0, 3), mx.int32), empty, VOCAB)
    assert out.tolist() == [4, 5, 6]


@pytest.mark.parametrize("label", [s.label for s in (*RECORD.shapes, *RECORD.edges) if s.rows])
def test_make_gives_each_stream_the_depth_plus_one_rows_its_view_reads(label):
    shape = next(s for s in (*RECORD.shapes, *RECORD.edges) if s.label == label)
    for seed in range(20):
        case = gates.make_case(RECORD, shape, shape.rows, np.random.default_rng(seed))
        starts, depth = case["starts"].astype(np.int64), shape.dims["depth"]
        assert (np.diff(starts) >= depth + 1).all() and starts[-1] + depth + 1 <= len(case["ids"])
        assert ((case["counts"] >= 0) & (case["counts"] <= depth)).all()


def test_the_served_shapes_hold_adjacent_full_windows_and_every_kind_of_bad_pick_in_a_window():
    shape = RECORD.shapes[0]
    case = gates.make_case(RECORD, shape, shape.rows, np.random.default_rng(1))
    starts, counts, depth, vocab = case["starts"], case["counts"], shape.dims["depth"], shape.dims["vocab"]
    assert ((np.diff(starts) == depth + 1) & (counts[:-1] == depth)).any()
    assert (counts == 0).any() and ((counts > 0) & (counts < depth)).any()
    taken = np.concatenate([case["picks"][s, :n] for s, n in enumerate(counts)])
    assert (taken >= vocab).any() and (taken < 0).any()


def test_the_sources_launch_one_thread_a_verify_row_and_nothing_for_no_stream():
    for shape in (*RECORD.shapes, *RECORD.edges):
        for kind in ("cuda", "metal"):
            launch = RECORD.implementations[kind].launch(Case(shape, shape.rows, {}, RECORD.row_inputs))
            verify = shape.dims["verify"]
            assert launch.output_shapes == ((verify,),)
            assert launch.grid[0] == (-(-verify // draft_ids.THREADS) * draft_ids.THREADS if shape.rows else 0)


@pytest.mark.skipif(not (shutil.which("nvcc") and os.environ.get("TENSORFOLD_MLX_CUDA_INCLUDE")),
                    reason="needs nvcc and TENSORFOLD_MLX_CUDA_INCLUDE (MLX's CUDA device headers)")
def test_the_cuda_source_and_its_planted_controls_compile_for_sm90():
    from tensorfold_contract import nvcc

    include = os.environ["TENSORFOLD_MLX_CUDA_INCLUDE"]
    assert nvcc.main(["--include", include, "--quick", "--only", "dspark draft ids"]) == 0
