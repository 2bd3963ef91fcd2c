"""The window attention record: its reference, its mlx implementation's gates, its controls and its sources."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from tensorfold_contract import gates, nvcc, run_contract
from tensorfold_core.row_kernels import attention
from tensorfold_llama.kernels.attention import RECORD, SPLIT, mlx_window_attention

SEED = 20261201


@pytest.fixture(scope="module")
def report():
    return run_contract(only=["llama window attention"], seed=SEED)


def _case(label: str, rows: int | None = None, seed: int = 0):
    shape = next(s for s in (*RECORD.shapes, *RECORD.edges) if s.label == label)
    return gates.make_case(RECORD, shape, shape.rows if rows is None else rows, np.random.default_rng(seed))


def _direct(case) -> np.ndarray:
    """Softmax attention one (row, head) at a time over the whole buffer, masked by position."""
    q, k, v = (case[n].astype(np.float64) for n in ("q", "k", "v"))
    window, scale = case.dims["window"], float(case["scale"][0])
    out = np.zeros(q.shape)
    for r, p in enumerate(case["pos"]):
        for h in range(q.shape[1]):
            kv = h // (q.shape[1] // k.shape[0])
            j = np.arange(k.shape[1])
            seen = (j <= p) & ((j > p - window) if window else True)
            s = np.full(k.shape[1], -np.inf)
            s[seen] = k[kv, seen] @ q[r, h] * scale
            w = np.exp(s - s.max())
            out[r, h] = (w[seen] / w.sum()) @ v[kv, seen]
    return out


@pytest.mark.parametrize("label", ["tiny bf16, 700 keys", "tiny bf16, sliding window 300, 700 keys",
                                   "window across a split boundary (254..269)", "p = 0"])
def test_the_record_s_reference_is_softmax_attention_over_each_row_s_own_keys(label):
    case = _case(label)
    np.testing.assert_allclose(attention.reference(case)["out"], _direct(case), rtol=1e-12, atol=1e-12)


def test_the_mlx_implementation_passes_gates_1_to_4_on_the_cpu(report):
    (kernel,) = report.kernels
    mlx = kernel.implementations["mlx"]
    assert mlx.status == "pass", {g: r.detail for g, r in mlx.gates.items()}
    assert [mlx.gates[g].status for g in (1, 2, 3, 4)] == ["pass"] * 4
    assert "bit-equal on 6 shapes" in mlx.gates[4].detail and "4 heavy shapes left to a GPU" in mlx.gates[2].detail


def test_every_control_that_can_run_here_is_red_as_planted(report):
    (kernel,) = report.kernels
    red = [c for c in kernel.controls if c.status == "red"]
    assert {c.name for c in red if c.kind == "mlx"} == {
        "split size by row count", "splits cut from the cache's end", "splits folded in reverse when many rows",
        "dropped last key", "fp16 value accumulator"}
    for c in kernel.controls:
        assert c.status in ("red", "not run (no CUDA device)"), (c.name, c.kind, c.status, c.detail)
    # the gate-4 controls are red because rows differ, not because a call failed
    assert all("differs from its 1-row call" in c.detail for c in red if c.gate == 4)


def test_the_cuda_and_metal_implementations_are_not_run_here_and_within_launch_limits(report):
    (kernel,) = report.kernels
    for kind, why in (("cuda", "not run (no CUDA device)"), ("metal", "not run (no Metal device)")):
        assert kernel.implementations[kind].status == why
        assert kernel.implementations[kind].gates[5].status == "pass"


def test_a_row_is_bit_equal_whether_the_cache_ends_at_its_key_or_runs_on_past_it():
    import mlx.core as mx

    case = _case("tiny bf16, 700 keys")
    q, k, v = (mx.array(case[n]).astype(mx.bfloat16) for n in ("q", "k", "v"))
    offset, scale = int(case["pos"][0]), float(case["scale"][0])
    whole = mlx_window_attention(q, k, v, offset, scale)
    for r in (0, 7, 15):
        p = offset + r
        for end in (p + 1, p + 2, k.shape[1]):  # exactly its keys, one more, the whole buffer (stale keys: NaN)
            alone = mlx_window_attention(q[r:r + 1], k[:, :end], v[:, :end], p, scale)
            assert np.array_equal(np.array(alone[0].view(mx.uint32)), np.array(whole[r].view(mx.uint32))), (r, end)


def test_the_splits_sit_at_absolute_positions_so_a_window_s_offset_never_moves_them():
    import mlx.core as mx

    case = _case("tiny bf16, 700 keys")
    q, k, v = (mx.array(case[n]).astype(mx.float32) for n in ("q", "k", "v"))
    scale = float(case["scale"][0])
    # the same row at position 600 in windows starting at 585, 595 and 600
    row = mlx_window_attention(q[:1], k, v, 600, scale)
    for start in (585, 595):
        qs = mx.concatenate([mx.zeros((600 - start, *q.shape[1:]), mx.float32), q[:1]])
        many = mlx_window_attention(qs, k, v, start, scale)
        assert np.array_equal(np.array(many[-1]), np.array(row[0]))
    assert 585 // SPLIT == 595 // SPLIT == 600 // SPLIT == 2


def test_the_entry_points_refuse_a_call_no_kernel_serves_and_say_why():
    import mlx.core as mx

    q, k = mx.zeros((2, 8, 32)), mx.zeros((3, 40, 32))
    with pytest.raises(ValueError, match="8 heads are not a multiple of 3 kv heads"):
        mlx_window_attention(q, k, k, 0, 1.0)
    k = mx.zeros((1, 2, 40, 32))  # the KVCache's own layout is taken as it is
    with pytest.raises(ValueError, match=r"positions 39\.\.40 do not fit a cache of 40 keys"):
        mlx_window_attention(q, k, k, 39, 1.0)
    with pytest.raises(ValueError, match="head_dim 48"):
        mlx_window_attention(mx.zeros((1, 8, 48)), mx.zeros((2, 40, 48)), mx.zeros((2, 40, 48)), 0, 1.0)
    assert mlx_window_attention(q, k, k, 38, 1.0).shape == (2, 8, 32)


def test_the_metal_source_names_only_thread_attributes_mx_fast_metal_kernel_declares():
    # MLX adds an attribute to the kernel's signature only for the names it declares (simd_lane_id is not one)
    code = re.sub(r"//[^\n]*", "", RECORD.implementations["metal"].body)
    used = set(re.findall(r"\b(?:simd|thread)\w*", code))
    assert used == {"thread_position_in_threadgroup", "threadgroup_position_in_grid", "thread_index_in_simdgroup",
                    "simd_shuffle_xor", "threadgroup", "threadgroup_barrier"}


# The cuda body in a plain kernel of its own (MLX's wrapper needs MLX's device headers; see the next test).
_WRAPPER = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
extern "C" __global__ void attn(const {t}* q, const {t}* k, const {t}* v, const float* scale, const int* dims,
                                float* out) {{
  constexpr int D = {d};
  constexpr int SPLIT = {split};
  constexpr int GROUPS = {groups};
  constexpr int KC = {kc};
  constexpr int VC = {vc};
{body}
}}
"""


def _nvcc(text: str) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "attn.cu")
        with open(path, "w") as f:
            f.write(text)
        done = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-o", os.devnull, path],
                              capture_output=True, text=True)
    return done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc (CUDA's compiler) on PATH to build for sm_90")
def test_the_cuda_source_and_its_planted_controls_compile_for_sm90():
    cuda = RECORD.implementations["cuda"]
    bodies = [("cuda", cuda.body)] + [(c.name, c.plant(cuda).body) for c in RECORD.controls
                                      if c.kind == "cuda" and c.gate != 5]
    builds = [(name, t, d) for name, _ in bodies[:1] for t, d in (("float", 32), ("__nv_bfloat16", 64),
                                                                  ("__nv_bfloat16", 128))]
    builds += [(name, "__nv_bfloat16", 64) for name, _ in bodies[1:]]
    texts = {name: body for name, body in bodies}
    chunks = dict(attention.chunks())
    jobs = [_WRAPPER.format(t=t, d=d, split=attention.SPLIT, groups=attention.GROUPS, kc=chunks["KC"],
                            vc=chunks["VC"], body=texts[name])
            for name, t, d in builds]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(_nvcc, jobs))
    failed = [(b, log[-1500:]) for b, (ok, log) in zip(builds, results) if not ok]
    assert not failed, failed


@pytest.mark.skipif(not (shutil.which("nvcc") and os.environ.get("TENSORFOLD_MLX_CUDA_INCLUDE")),
                    reason="needs nvcc and TENSORFOLD_MLX_CUDA_INCLUDE (MLX's CUDA device headers)")
def test_the_cuda_source_compiles_as_mlx_wraps_it_for_sm90():
    include = os.environ["TENSORFOLD_MLX_CUDA_INCLUDE"]
    assert nvcc.main(["--include", include, "--quick", "--only", "llama window attention"]) == 0


def test_the_packed_streams_call_refuses_shapes_no_kernel_serves_naming_the_numbers():
    import mlx.core as mx

    from tensorfold_core.row_kernels.attention_streams import STREAMS_ATTENTION, packed

    q, kn = mx.zeros((2, 8, 32), mx.bfloat16), mx.zeros((2, 2, 32), mx.bfloat16)
    cache = mx.zeros((2, 2, 40, 32), mx.bfloat16)
    streams = packed([(0, 2, 10)])
    with pytest.raises(ValueError, match="9 streams in one launch: it takes 1 to 8"):
        STREAMS_ATTENTION["cuda"](q, kn, kn, [cache] * 9, [cache] * 9, streams, 1, 0.17)
    with pytest.raises(ValueError, match="do not match queries"):
        STREAMS_ATTENTION["cuda"](q, kn, kn, [cache[0]], [cache[0]], streams, 1, 0.17)  # a cache of one layer's shape
    with pytest.raises(ValueError, match="8 heads over 3 kv heads"):
        three = mx.zeros((2, 3, 32), mx.bfloat16)
        STREAMS_ATTENTION["cuda"](q, three, three, [mx.zeros((2, 3, 40, 32))], [mx.zeros((2, 3, 40, 32))], streams,
                                  1, 0.17)
