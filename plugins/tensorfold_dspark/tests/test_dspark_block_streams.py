"""The block attention streams record: its gates, each block's bits as the one-block call's, its texts, refusals."""

from __future__ import annotations

import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_contract import Case, run_contract
from tensorfold_contract.helpers import rounded
from tensorfold_contract.kernel_text import served_text
from tensorfold_contract.metal_shim import compiler

from tensorfold_dspark.kernels import block_attention, block_attention_streams as streams
from tensorfold_dspark.kernels.block_attention import mlx_block_attention
from tensorfold_dspark.kernels.block_attention_streams import BLOCK_STREAMS, NAMES, RECORD, rowmap

NAME = "dspark block attention streams"
SEED = 20261208


@pytest.fixture(scope="module")
def report():
    return run_contract(only=[NAME], seed=SEED)


def test_the_record_passes_gates_1_to_4_on_the_cpu_bit_equal_to_the_one_block_record_within_every_device_s_limits(
        report):
    (kernel,) = report.kernels
    mlx = kernel.implementations["mlx"]
    assert [mlx.gates[g].status for g in (1, 2, 3, 4)] == ["pass"] * 4, {g: r.detail for g, r in mlx.gates.items()}
    assert "bit-equal to" in mlx.gates[4].detail  # the claim: each block's rows as the one-block record's call
    assert [kernel.implementations[kind].gates[5].status for kind in ("cuda", "metal")] == ["pass", "pass"]
    assert report.summary()["fail"] == 0 and not kernel.problems


def test_every_control_that_can_run_here_goes_red_at_its_gate(report):
    (kernel,) = report.kernels
    red = {(c.kind, c.name, c.gate) for c in kernel.controls if c.status == "red"}
    assert red == {("mlx", "every block on the first lane's context", 2), ("mlx", "stale context keys attended", 2),
                   ("mlx", "causal inside the block", 2), ("mlx", "block keys cut to the row count", 4),
                   ("cuda", "over-sized threadgroup", 5), ("metal", "over-sized threadgroup", 5)}
    assert all(c.status.startswith("not run (no ") for c in kernel.controls if (c.kind, c.name, c.gate) not in red)
    assert report.summary()["missed"] == 0


def test_tensorfold_contract_only_the_block_streams_exits_0():
    done = subprocess.run([sys.executable, "-m", "tensorfold_core", "contract", "--only", NAME, "--seed", "7"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(rf"^{NAME} +mlx +pass ", done.stdout, re.M), done.stdout


def _hold(dtype, contexts=(300, 41, 0), size=8, heads=8, kv=2, dim=32, seed=5):
    """A hold as the drafter has it: lanes' buffers [1, kv, capacity, dim], blocks' q and keys [1, kv, B, dim]."""
    # each lane its own capacity, NaN past its n; the blocks' keys laid out as model.Attention has them
    rng = np.random.default_rng(seed)

    def array(a):
        return mx.array(rounded(a, "bfloat16" if dtype == mx.bfloat16 else "float32")).astype(dtype)

    lanes = []
    for s, n in enumerate(contexts):
        k, v = rng.standard_normal((2, 1, kv, n + 9 + 5 * s, dim))
        k[:, :, n:], v[:, :, n:] = np.nan, np.nan  # stale rows past n, as a cut leaves them
        lanes.append((array(k), array(v)))
    blocks = [(array(rng.standard_normal((size, heads, dim))), array(rng.standard_normal((1, kv, size, dim))),
               array(rng.uniform(-2, 2, (1, kv, size, dim)))) for _ in contexts]
    return lanes, blocks


def _packed(contexts, lanes, blocks):
    """The served call's arguments for a hold's blocks: q rows and block keys packed block after block."""
    layout = tuple((i * len(q), len(q), n, len(q)) for i, (n, (q, _, _)) in enumerate(zip(contexts, blocks)))
    q = mx.concatenate([q for q, _, _ in blocks])
    bk, bv = (mx.concatenate([b[j][0].transpose(1, 0, 2) for b in blocks]) for j in (1, 2))
    return (q, [k for k, _ in lanes], [v for _, v in lanes], layout, rowmap(layout), bk, bv, 32 ** -0.5)


def _bits(a) -> np.ndarray:
    return np.array(a.view(mx.uint32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_each_block_of_the_mlx_call_gets_the_bits_mlx_block_attention_gives_it_alone_and_no_stale_row_leaks(dtype):
    contexts = (300, 41, 0)  # a long lane, a short one, one before its first absorb
    lanes, blocks = _hold(dtype, contexts)
    out = BLOCK_STREAMS["mlx"](*_packed(contexts, lanes, blocks))
    assert out.dtype == mx.float32 and out.shape == (24, 8, 32)
    assert not np.isnan(np.array(out)).any()
    for s, (n, (k, v), (q, bk, bv)) in enumerate(zip(contexts, lanes, blocks)):
        alone = mlx_block_attention(q, k, v, n, bk, bv, 32 ** -0.5)
        assert np.array_equal(_bits(out[8 * s:8 * s + 8]), _bits(alone)), s


def test_the_rowmap_gives_each_row_its_slot_n_its_block_s_first_key_row_and_b():
    layout = ((0, 2, 300, 8), (2, 0, 40, 8), (2, 3, 0, 8))  # a block with no rows keeps its keys: 16..23 the third's
    assert np.array(rowmap(layout)).tolist() == [[0, 300, 0, 8]] * 2 + [[2, 0, 16, 8]] * 3
    assert rowmap(()).shape == (0, 4)


def test_the_cuda_and_metal_texts_read_exactly_the_arrays_the_served_call_passes_in_the_order_it_passes_them():
    for kind in ("cuda", "metal"):
        source = RECORD.implementations[kind]
        assert source.input_names == NAMES and source.output_names == ("out",)
        words = set(re.findall(r"\b[A-Za-z_]\w*\b", served_text(source.body)))
        assert set(NAMES) <= words and not {"context_keys", "context_values"} & words, kind
        for slots in (1, 2, 4):
            narrow = streams.narrowed_text(source.body, slots)
            lanes = {w for w in re.findall(r"\b[kv]\d\b", narrow)}
            assert lanes == {f"{a}{s}" for a in "kv" for s in range(slots)}, (kind, slots)
    contexts = (300, 41, 0)
    lanes, blocks = _hold(mx.float32, contexts)
    args = _packed(contexts, lanes, blocks)
    inputs, launch = streams._kernel_call(*args)
    q, keys, values, _, rm, bk, bv, _ = args
    assert len(inputs) == len(streams.names(4))  # three lanes take the 4-slot text; the fourth slot is the first's
    expected = [q, *keys, keys[0], *values, values[0], bk, bv, rm]
    assert [a is b for a, b in zip(inputs, expected)] == [True] * len(expected)
    assert np.array(inputs[-1]).tolist() == [24, 8, 2, 309, 55, 19, *[309] * 5]  # rows, heads, kv heads, capacities
    assert launch["output_shapes"] == [(24, 8, 32)] and launch["output_dtypes"] == [mx.float32]


def test_each_contract_case_launches_its_narrowed_text_with_as_many_inputs_as_it_names():
    for shape in (*RECORD.shapes, *RECORD.edges):
        if shape.rows == 0 or shape.heavy:
            continue
        case = Case(shape, 3, RECORD.make(shape.dims, 3, np.random.default_rng(0)), RECORD.row_inputs)
        for kind in ("cuda", "metal"):
            served = RECORD.implementations[kind].at(case)
            assert served.input_names == streams.names(streams.slots_for(shape.dims["blocks"])), shape.label
            assert len(served.inputs(case)) == len(served.input_names), shape.label


def _case(label, rows, seed=3):
    shape = next(s for s in (*RECORD.shapes, *RECORD.edges) if s.label == label)
    return Case(shape, rows, RECORD.make(shape.dims, rows, np.random.default_rng(seed)), RECORD.row_inputs)


def test_a_case_packs_each_block_s_rows_together_over_all_its_block_s_keys_each_lane_shorter_than_the_one_before():
    case = _case("tiny drafter float32, 3 blocks over 300 keys", 8)
    assert case["slot"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert streams._blocks(case) == ((0, 3, 300, 8), (3, 3, 263, 8), (6, 2, 226, 8))
    assert case["block_keys"].shape == (24, 2, 32) and case["k1"].shape == (1, 2, 263 + 37, 32)
    one = case.take_rows(4, 5)  # a one-row call still holds every block's keys
    assert streams._blocks(one) == ((0, 0, 300, 8), (0, 1, 263, 8), (1, 0, 226, 8))
    assert streams.contexts(_case("lanes down to 1 key (40, 3, 1)", 1).dims) == [40, 3, 1]
    assert streams.contexts(_case("no context yet in any lane", 1).dims) == [0, 0, 0]


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("label, rows", [("tiny drafter bfloat16, 3 blocks over 300 keys", 9),
                                         ("a lane with no rows between two", 6),
                                         ("no context yet in any lane", 5),
                                         ("head_dim 128, one split and a key (249 + 8)", 4)])
def test_the_metal_text_emulated_gives_each_row_the_bits_the_one_block_metal_text_gives_its_block(label, rows):
    from tensorfold_contract.metal_emu import run_source
    from tensorfold_contract.serving import ServedCall

    case = _case(label, rows)
    packed = run_source(RECORD.implementations["metal"], case)["out"]
    q, keys, values, blocks, _, bk, bv, _ = streams._call(case)
    for (start, count, _, _), one in zip((b for b in blocks if b[1]), streams._each_block(q, keys, values, blocks,
                                                                                          bk, bv)):
        arrays = dict(zip(("q", "context_keys", "context_values"), one[:3]), block_keys=one[4], block_values=one[5],
                      scale=case["scale"])
        alone = run_source(block_attention.RECORD.implementations["metal"],
                           ServedCall(count, {**case.dims, "context": one[3]}, arrays))["out"]
        assert np.array_equal(_bits(packed[start:start + count]), _bits(alone)), start


@pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")
def test_the_metal_text_emulated_matches_the_reference_keeps_its_rows_and_its_planted_slot_defect_goes_red():
    from tensorfold_contract.metal_emu import emulated, emulated_gate4

    first = lambda light: light[:1]  # noqa: E731
    assert emulated(RECORD)[0] and emulated_gate4(RECORD, shapes=first, rows=4)[0]
    slot = next(c for c in RECORD.controls if c.kind == "metal" and c.gate == 2)
    assert not emulated(RECORD, slot.plant(RECORD.implementations["metal"]))[0]


def _refused(match, *args, kinds=("mlx", "cuda", "metal")):
    for kind in kinds:
        with pytest.raises(ValueError, match=match):
            BLOCK_STREAMS[kind](*args)


def test_a_call_the_kernels_do_not_serve_is_refused_naming_why():
    contexts = (300, 41, 0)
    lanes, blocks = _hold(mx.float32, contexts)
    q, keys, values, layout, rm, bk, bv, scale = _packed(contexts, lanes, blocks)
    nine = tuple((8 * i, 8, 0, 8) for i in range(9))
    _refused("9 lanes' keys and 9 values in one launch: it takes 1 to 8 blocks",
             mx.zeros((72, 8, 32)), [keys[0]] * 9, [values[0]] * 9, nine, rowmap(nine), mx.zeros((72, 2, 32)),
             mx.zeros((72, 2, 32)), scale)
    odd = mx.zeros((1, 3, 50, 32))  # three kv heads where the others have two
    _refused(r"lane 1's keys \(3, 50, 32\) and values \(3, 50, 32\) must both be \[2, capacity, 32\]",
             q, [keys[0], odd, keys[2]], [values[0], odd, values[2]], layout, rm, bk, bv, scale)
    _refused("6 heads are not a multiple of 4 kv heads", mx.zeros((8, 6, 32)), [mx.zeros((1, 4, 10, 32))],
             [mx.zeros((1, 4, 10, 32))], ((0, 8, 5, 8),), rowmap(((0, 8, 5, 8),)), mx.zeros((8, 4, 32)),
             mx.zeros((8, 4, 32)), scale)
    for dim in (48, 512):
        _refused(f"head_dim {dim}: the kernels take 32, 64, 128 or 256", mx.zeros((8, 8, dim)),
                 [mx.zeros((1, 2, 10, dim))], [mx.zeros((1, 2, 10, dim))], ((0, 8, 5, 8),),
                 rowmap(((0, 8, 5, 8),)), mx.zeros((8, 2, dim)), mx.zeros((8, 2, dim)), scale)
    _refused(r"block keys \(24, 2, 32\) and values \(23, 2, 32\) must both be \[keys, kv_heads, 32\]",
             q, keys, values, layout, rm, bk, bv[:23], scale)
    over = ((0, 8, 300, 8), (8, 8, 60, 8), (16, 8, 0, 8))
    _refused("block 1: a context of 60 keys does not fit its lane's buffer of 55",
             q, keys, values, over, rowmap(over), bk, bv, scale)
    gap = ((0, 8, 300, 8), (9, 8, 41, 8), (16, 8, 0, 8))
    _refused("block 1 holds rows 9..16: a block's rows follow the block before's, from row 8",
             q, keys, values, gap, rm, bk, bv, scale)
    _refused("blocks of 24 rows and 24 keys, for q of 24 rows and 16 packed block keys",
             q, keys, values, layout, rm, bk[:16], bv[:16], scale)
    _refused("the lanes' buffers must share one dtype", q, [keys[0].astype(mx.bfloat16), *keys[1:]], values, layout,
             rm, bk, bv, scale)
    _refused(r"rowmap \(23, 4\) is not \[24, 4\]", q, keys, values, layout, rm[:23], bk, bv, scale,
             kinds=("cuda", "metal"))
