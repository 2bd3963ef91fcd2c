"""The lfm2 kernel records: both pass gates 1-4 on the CPU, every control is red, and they prove the served code."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tensorfold_contract import Case, run_contract

SEED = 20261207
NAMES = {"lfm2 stream conv", "lfm2_moe router top-k", "lfm2 gemv bf16", "lfm2 gemv q4", "lfm2 gemv q8", "lfm2 rmsnorm",
         "lfm2 window attention", "lfm2 gemv bf16 + residual", "lfm2 gemv bf16 gate|up swiglu",
         "lfm2 gemv bf16 rmsnorm", "lfm2 gemv bf16 rmsnorm gate|up swiglu", "lfm2 streams conv",
         "lfm2 window attention streams", "lfm2 stack kv"}  # the family's own three, and its shared row kernels
MODELS = os.path.join(os.path.dirname(__file__), "..", "tensorfold_lfm2", "models")


@pytest.fixture(scope="module")
def report():
    return run_contract(only=["lfm2"], seed=SEED)


def test_every_lfm2_record_passes_gates_1_to_4_on_the_cpu_mlx_implementation(report):
    assert {k.name for k in report.kernels} == NAMES
    for kernel in report.kernels:
        mlx = kernel.implementations["mlx"]
        assert [mlx.gates[g].status for g in (1, 2, 3, 4)] == ["pass"] * 4, (
            kernel.name, {g: r.detail for g, r in mlx.gates.items()})
        for kind in set(kernel.implementations) - {"mlx"}:
            assert kernel.implementations[kind].gates[5].status == "pass"  # launch limits need no device
    summary = report.summary()
    assert summary["pass"] == len(NAMES) and summary["fail"] == 0 and summary["limit_problems"] == 0


def test_every_lfm2_control_that_can_run_here_is_red_as_planted(report):
    for kernel in report.kernels:
        assert len([c for c in kernel.controls if c.status == "red"]) >= 2, kernel.name
        for c in kernel.controls:
            assert c.status in ("red", "not run (no CUDA device)", "not run (no Metal device)"), (kernel.name, c)
    summary = report.summary()
    assert summary["missed"] == 0 and summary["red"] == summary["controls"] >= 12


def test_tensorfold_contract_only_lfm2_exits_0_and_lists_every_record():
    done = subprocess.run([sys.executable, "-m", "tensorfold_core", "contract", "--only", "lfm2", "--seed", "7"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in NAMES:
        assert re.search(rf"^{re.escape(name)} +mlx +pass ", done.stdout, re.M), done.stdout
    n = len(NAMES)
    assert f"{n} kernels: {n} pass gates 1-4 where they ran ({2 * n} implementations not run: {n} no CUDA device, " \
        f"{n} no Metal device), 0 fail" in done.stdout.splitlines()[-1]


def _case(record, label, rows=16, seed=5, **change):
    shape = next(s for s in (*record.shapes, *record.edges) if s.label == label)
    shape = dataclasses.replace(shape, dims={**shape.dims, **change}, rows=rows)
    return Case(shape, rows, record.make(shape.dims, rows, np.random.default_rng(seed)), record.row_inputs)


def test_each_row_of_the_conv_input_starts_from_the_state_the_row_before_it_leaves():
    from tensorfold_lfm2.kernels import conv

    case = _case(conv.RECORD, "LFM2-1.2B bfloat16")
    ref = conv.reference(case)
    assert np.array_equal(ref["states"][:-1], case["tails"][1:])
    assert np.array_equal(ref["states"][-1], np.concatenate([case["tails"][-1], case["bx"][-1:]])[1:])


# --- the router record against the family's SparseMoeBlock ------------------------------------------------------------


def _served_routing(case):
    """SparseMoeBlock.__call__ itself, its gate an identity and its experts a probe: (experts, weights) per row."""
    import mlx.core as mx
    import mlx.nn as nn

    from tensorfold_lfm2 import lfm2_moe
    from tensorfold_lfm2.kernels.common import mx_dtype

    class Probe(nn.Module):  # expert j of a row returns the unit vector e_j: the block's sum leaves weight j there
        def __call__(self, x, experts):
            self.experts = experts
            k = experts.shape[-1]
            return mx.broadcast_to(mx.eye(k, dtype=x.dtype), (*experts.shape, k))

    config = json.load(open(os.path.join(MODELS, "tiny-lfm2-moe", "config.json")))
    d = case.dims
    args = lfm2_moe.ModelArgs.from_config({**config, "num_experts": d["experts"], "num_experts_per_tok": d["top_k"],
                                           "norm_topk_prob": d["norm"], "routed_scaling_factor": d["scale"],
                                           "use_expert_bias": d["bias"]})
    block = lfm2_moe.SparseMoeBlock(args)
    block.gate, block.switch_mlp = nn.Identity(), Probe()
    if d["bias"]:
        block.expert_bias = case.array("bias")
    weights = block(case.array("logits", mx_dtype(d["dtype"])))
    return np.array(block.switch_mlp.experts).astype(np.int64), weights


def _assert_served_routing_is_the_record(case):
    """The family's picks are the record's, best first, and its weights the record's mlx ones, bit for bit."""
    import mlx.core as mx

    from tensorfold_lfm2.kernels import router

    ref, ours = router.reference(case), router.mlx_router(case)
    experts, weights = _served_routing(case)
    weights = np.array(weights.astype(mx.float32))
    assert np.array_equal(experts, ref["indices"])
    tol = router.tolerance(case.dims)["weights"]
    assert np.all(np.abs(weights - ref["weights"]) <= tol.rtol * np.abs(ref["weights"]).max(-1, keepdims=True))
    # the same picks in the same order: the k-term sum rounds alike, whatever k
    assert np.array_equal(experts, np.array(ours["indices"]))
    assert np.array_equal(weights, np.array(ours["weights"].astype(mx.float32)))


@pytest.mark.parametrize("label", ["tiny-lfm2-moe bfloat16", "tiny-lfm2-moe float32", "32 experts top-4 bfloat16",
                                   "32 experts top-4 float32"])
def test_the_router_record_is_what_sparse_moe_block_computes_on_rows_without_ties(label):
    from tensorfold_lfm2.kernels import router

    _assert_served_routing_is_the_record(_case(router.RECORD, label, ties=False))


@pytest.mark.parametrize("label", ["tiny-lfm2-moe bfloat16", "tiny-lfm2-moe float32", "32 experts top-4 bfloat16",
                                   "32 experts top-4 float32", "no expert bias bf16", "64 experts top-8"])
def test_sparse_moe_block_gives_an_exact_tie_at_the_pick_boundary_to_the_lowest_expert_id(label):
    from tensorfold_lfm2.kernels import router

    case = _case(router.RECORD, label)  # rows 1, 4, 7, ...: a tie planted at the boundary; 2, 5, 8, ...: at the top
    experts, _ = _served_routing(case)
    k = case.dims["top_k"]
    choice = router._choice(router._scores(case["logits"], case.dims["dtype"]), case.host.get("bias"))
    for r in range(1, case.rows, 3):  # the boundary's tied pair: the lower id is picked, the higher left out
        lower, higher = router._order(choice[r])[k - 1:k + 1]
        assert choice[r][lower] == choice[r][higher] and lower < higher
        assert lower in experts[r] and higher not in experts[r]
    _assert_served_routing_is_the_record(case)


def test_router_rows_plant_exact_ties_at_the_boundary_and_keep_every_other_pick_clear_of_an_ulp():
    from tensorfold_lfm2.kernels import router

    for label in ("32 experts top-4 bfloat16", "64 experts top-8", "no expert bias bf16"):
        case = _case(router.RECORD, label)
        d = case.dims
        choice = router._choice(router._scores(case["logits"], d["dtype"]), case.host.get("bias"))
        for r, row in enumerate(choice):
            top = router._order(row)
            assert router._conflict(case["logits"][r], case.host.get("bias"), d) is None
            if r % 3 == 1:  # the chosen one of the tied pair is the lower id
                k = d["top_k"]
                assert row[top[k - 1]] == row[top[k]] and top[k - 1] < top[k]


@pytest.mark.skipif(not (shutil.which("nvcc") and os.environ.get("TENSORFOLD_MLX_CUDA_INCLUDE")),
                    reason="needs nvcc and TENSORFOLD_MLX_CUDA_INCLUDE (MLX's CUDA device headers)")
def test_the_lfm2_cuda_sources_and_their_planted_controls_compile_for_sm90():
    from tensorfold_contract import nvcc

    assert nvcc.main(["--include", os.environ["TENSORFOLD_MLX_CUDA_INCLUDE"], "--quick", "--only", "lfm2"]) == 0
