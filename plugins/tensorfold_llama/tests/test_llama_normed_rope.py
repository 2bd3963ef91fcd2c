"""The normed q|k|v GEMV storing roped heads gives the bits of the two launches it replaces (the normed GEMV, then the
rope qkv record), emulated from its metal text; a text that rounds differently is caught."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tensorfold_contract.gates import make_case
from tensorfold_contract.metal_emu import run_source
from tensorfold_contract.metal_shim import compiler
from tensorfold_contract.serving import ServedCall
from tensorfold_llama.kernels import gemv, normed_rope, rope_qkv

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")


def _bits(array) -> np.ndarray:
    import mlx.core as mx

    return np.array(array.view(mx.uint16))


def folded_and_apart(source, shape, rows: int) -> tuple[dict, dict]:
    """One case's (q, k, v) from `source` and from the normed GEMV then the rope qkv record, emulated, as bits."""
    case = make_case(normed_rope.RECORD, shape, rows, np.random.default_rng(7))
    folded = run_source(source, case)
    dims = case.dims
    y = run_source(gemv.NORM.implementations["metal"], ServedCall(rows, dims, {
        name: case.array(name) for name in ("x", "w", "nw")}))["y"]
    apart = run_source(rope_qkv.NEOX.implementations["metal"], ServedCall(rows, dims, {
        "qkv": y, "positions": case.array("positions"), "freqs": case.array("freqs")}))
    return ({name: _bits(folded[name]) for name in normed_rope.OUTPUTS},
            {name: _bits(apart[part]) for name, part in zip(normed_rope.OUTPUTS, "qkv")})


@pytest.mark.parametrize("label", ["tiny q|k|v at 1000", "head_dim 80, one head of each"])
def test_the_folded_launch_gives_the_bits_of_the_normed_gemv_then_the_rope_qkv_record(label):
    shape = next(s for s in (*normed_rope.SHAPES, *normed_rope.EDGES) if s.label == label)
    folded, apart = folded_and_apart(normed_rope.RECORD.implementations["metal"], shape, 3)
    for name in normed_rope.OUTPUTS:
        assert np.array_equal(folded[name], apart[name]), name


def test_a_fold_that_ropes_the_unrounded_sums_does_not_give_those_bits():
    metal = normed_rope.RECORD.implementations["metal"]
    unrounded = dataclasses.replace(metal, body=metal.body.replace(
        "const float b = static_cast<float>(hi);", "const float b = v;"))
    assert unrounded.body != metal.body
    folded, apart = folded_and_apart(unrounded, normed_rope.SHAPES[0], 3)
    assert not np.array_equal(folded["yq"], apart["yq"])
    assert np.array_equal(folded["yv"], apart["yv"])  # v is copied, never roped
