"""The packed-streams conv record: its gates on the CPU, each stream's bits as the stream conv gives them, its texts."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from tensorfold_contract import Case, run_contract
from tensorfold_contract.metal_shim import compiler

NAME = "lfm2 streams conv"
SEED = 20261207


@pytest.fixture(scope="module")
def report():
    return run_contract(only=[NAME], seed=SEED)


def test_the_streams_conv_record_passes_gates_1_to_4_on_the_cpu_and_its_launches_stay_within_every_device(report):
    (kernel,) = report.kernels
    mlx = kernel.implementations["mlx"]
    assert [mlx.gates[g].status for g in (1, 2, 3, 4)] == ["pass"] * 4, {g: r.detail for g, r in mlx.gates.items()}
    assert "bit-equal to" in mlx.gates[4].detail  # the claim: each stream's rows as the stream conv record's
    assert [kernel.implementations[kind].gates[5].status for kind in ("cuda", "metal")] == ["pass", "pass"]
    assert report.summary()["fail"] == 0 and not kernel.problems


def test_every_streams_conv_control_that_can_run_here_goes_red_at_its_gate(report):
    (kernel,) = report.kernels
    red = {(c.kind, c.name) for c in kernel.controls if c.status == "red"}
    assert red == {("mlx", "every row on the first stream's tail"), ("mlx", "dropped last tap"),
                   ("mlx", "row-count-dependent tap order"), ("cuda", "over-sized threadgroup"),
                   ("metal", "over-sized threadgroup")}
    assert all(c.status == "not run (no CUDA device)" for c in kernel.controls if (c.kind, c.name) not in red)
    assert report.summary()["missed"] == 0


def test_tensorfold_contract_only_the_streams_conv_exits_0():
    done = subprocess.run([sys.executable, "-m", "tensorfold_core", "contract", "--only", NAME, "--seed", "7"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(rf"^{NAME} +mlx +pass ", done.stdout, re.M), done.stdout


def _case(label, rows, seed=3):
    from tensorfold_lfm2.kernels import conv_streams

    record = conv_streams.RECORD
    shape = next(s for s in (*record.shapes, *record.edges) if s.label == label)
    return Case(shape, rows, record.make(shape.dims, rows, np.random.default_rng(seed)), record.row_inputs)


def test_a_case_packs_each_stream_s_rows_together_the_first_ones_one_more_each_after_the_state_the_row_before_leaves():
    case = _case("tiny-lfm2 bfloat16, 3 streams", 8)
    assert case["slot"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    for r in (1, 2, 4, 5, 7):  # a row after another of its stream: the tail that row leaves
        assert np.array_equal(case["tails"][r], np.concatenate([case["tails"][r - 1], case["bx"][r - 1:r]])[1:])
    assert not np.array_equal(case["tails"][3][-1], case["bx"][2])  # a stream's first row: its own tail
    idle = _case("a stream with no rows between two", 5)
    assert idle["slot"].tolist() == [0, 0, 0, 2, 2]


def _served_single(tail, rows, w, bias):
    """The stream conv record as a forward calls it for one stream (ServedConv over the family's conv module)."""
    import mlx.nn as nn

    from tensorfold_lfm2.kernels import conv
    from tensorfold_lfm2.serving import ServedConv

    C, L = w.shape
    module = nn.Conv1d(C, C, kernel_size=L, groups=C, bias=bias is not None)
    module.weight = w[:, :, None]
    if bias is not None:
        module.bias = bias
    return ServedConv(module, conv.RECORD, "mlx").run(tail[None], rows)


def _bits(a) -> np.ndarray:
    import mlx.core as mx

    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a.view(mx.uint32))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("bias", [False, True])
def test_each_stream_of_a_packed_call_gets_the_bits_the_stream_conv_gives_its_window_after_its_own_tail(dtype, bias):
    import mlx.core as mx

    from tensorfold_lfm2.kernels.common import mx_dtype, rounded
    from tensorfold_lfm2.kernels.conv_streams import STREAMS_CONV, rowmap

    rng, dt, C, L, layer = np.random.default_rng(11), mx_dtype(dtype), 96, 3, 1
    counts = (5, 0, 3, 1)  # windows of different lengths, one stream with none between two with rows
    tails = np.full((len(counts), 3, L - 1, C), np.nan, np.float32)  # the layers not read are NaN
    tails[:, layer] = rounded(rng.standard_normal((len(counts), L - 1, C)), dtype)
    bx = mx.array(rounded(rng.standard_normal((sum(counts), C)), dtype)).astype(dt)
    w = mx.array(rounded(0.5 * rng.standard_normal((C, L)), dtype)).astype(dt)
    b = mx.array(rounded(0.1 * rng.standard_normal(C), dtype)).astype(dt) if bias else None
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    spans = tuple((int(s), n) for s, n in zip(starts, counts))
    tails = mx.array(tails).astype(dt)
    y, states = STREAMS_CONV["mlx"](bx, tails, layer, spans, rowmap(spans), w, b)
    assert y.shape == (sum(counts), C) and states.shape == (sum(counts), L - 1, C) and y.dtype == dt
    assert not np.isnan(np.array(y.astype(mx.float32))).any()  # the other layers never leak in
    for s, (start, n) in enumerate(spans):
        if n:
            want_y, want_states = _served_single(tails[s, layer], bx[start:start + n], w, b)
            assert np.array_equal(_bits(y[start:start + n]), _bits(want_y)), s
            assert np.array_equal(_bits(states[start:start + n]), _bits(want_states)), s


def test_the_cuda_and_metal_sources_read_exactly_the_arrays_the_served_call_passes_in_the_order_it_passes_them():
    import mlx.core as mx

    from tensorfold_lfm2.kernels import conv_streams

    record = conv_streams.RECORD
    for kind in ("cuda", "metal"):
        source = record.implementations[kind]
        assert source.input_names == conv_streams.NAMES and source.output_names == ("y", "states")
        indexed = set(re.findall(r"\b([A-Za-z_]\w*)\[", source.body))
        assert indexed == {*source.input_names, *source.output_names}, kind
    spans = ((0, 2), (2, 0), (2, 3))
    bx, tails, w, rm = mx.zeros((5, 64)), mx.zeros((3, 4, 2, 64)), mx.ones((64, 3)), conv_streams.rowmap(spans)
    assert np.array(rm).tolist() == [[0, 0], [0, 0], [2, 2], [2, 2], [2, 2]]
    for bias in (None, mx.ones(64)):
        inputs, launch = conv_streams._kernel_call(bx, tails, 3, spans, rm, w, bias)
        assert [a is b for a, b in zip(inputs[:5], (bx, tails, rm, w, w if bias is None else bias))] == [True] * 5
        assert np.array(inputs[5]).tolist() == [5, 64, 4, 3]  # rows, channels, layers, the layer read
        assert launch["template"] == [("T", mx.float32), ("L", 3), ("HAS_BIAS", bias is not None)]
        assert launch["output_shapes"] == [(5, 64), (5, 2, 64)]
    case = _case("L=4, bias bf16", 5)
    assert len(record.implementations["cuda"].inputs(case)) == len(conv_streams.NAMES)


def test_a_call_the_kernels_do_not_serve_is_refused_naming_its_shapes():
    import mlx.core as mx

    from tensorfold_lfm2.kernels.conv_streams import STREAMS_CONV, rowmap

    bx, w, rm = mx.zeros((3, 64)), mx.zeros((64, 3)), rowmap(((0, 3),))
    with pytest.raises(ValueError, match=r"tails \(1, 2, 3, 64\) are not \[streams, layers, 2, 64\]"):
        STREAMS_CONV["cuda"](bx, mx.zeros((1, 2, 3, 64)), 1, ((0, 3),), rm, w, None)
    with pytest.raises(ValueError, match="layer 2 of tails of 2 layers"):
        STREAMS_CONV["cuda"](bx, mx.zeros((1, 2, 2, 64)), 2, ((0, 3),), rm, w, None)
    with pytest.raises(ValueError, match=r"rowmap \(2, 2\) is not \[3, 2\]"):
        STREAMS_CONV["metal"](bx, mx.zeros((1, 2, 2, 64)), 1, ((0, 2),), rowmap(((0, 2),)), w, None)


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")
def test_each_planted_cuda_defect_planted_in_the_metal_text_goes_red_when_emulated_where_the_source_is_green():
    from tensorfold_contract.metal_emu import emulated, emulated_gate4

    from tensorfold_lfm2.kernels import conv_streams

    record = conv_streams.RECORD
    metal = record.implementations["metal"]
    first = lambda light: light[:1]
    assert emulated(record)[0] and emulated_gate4(record, shapes=first, rows=4)[0]
    for control in (c for c in record.controls if c.kind == "cuda" and c.gate in (2, 4)):
        planted = control.plant(metal)  # the same edit: the two texts share the lines it swaps
        ok, why = emulated(record, planted) if control.gate == 2 else emulated_gate4(record, planted, shapes=first,
                                                                                     rows=4)
        assert not ok, control.name


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("label", ["tiny-lfm2 bfloat16, 3 streams", "a stream with no rows between two", "L=2, bias"])
def test_the_metal_text_emulated_gives_each_stream_the_bits_the_stream_conv_s_metal_text_gives_it(label):
    from tensorfold_contract.metal_emu import run_source
    from tensorfold_contract.serving import ServedCall

    from tensorfold_lfm2.kernels import conv, conv_streams

    case = _case(label, 9)
    packed = run_source(conv_streams.RECORD.implementations["metal"], case)
    bx, tails, layer, spans, _, w, bias = conv_streams._call(case)
    for s, (start, n) in enumerate(spans):
        if n:
            arrays = {"tails": tails[s, layer], "bx": bx[start:start + n], "w": w,
                      **({"bias": bias} if bias is not None else {})}
            alone = run_source(conv.RECORD.implementations["metal"], ServedCall(n, case.dims, arrays))
            for name in ("y", "states"):
                assert np.array_equal(_bits(packed[name][start:start + n]), _bits(alone[name])), (s, name)
