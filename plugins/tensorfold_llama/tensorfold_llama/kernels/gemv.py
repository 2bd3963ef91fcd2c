"""The llama family's GEMV records (bf16, affine 4/8-bit, bf16 with the residual, swiglu or the norm folded in): the
shared row-invariant GEMV at the shapes llama serves."""

from __future__ import annotations

from tensorfold_contract import Shape
from tensorfold_core.row_kernels import gemv_fused, gemv_normed
from tensorfold_core.row_kernels.gemv import OUT, WIDEST_CALL, record, shard_sizes, source  # noqa: F401

from .common import LLAMA_1B, LLAMA_8B, TINY, TINY_DRAFTER

MODELS = (("tiny", TINY, False), ("tiny drafter", TINY_DRAFTER, False), ("1B", LLAMA_1B, True),
          ("8B", LLAMA_8B, True))


def served(bits: int, group: int = 64) -> tuple[Shape, ...]:
    """Each model's projections (q/o, k/v, gate/up, down) and the tiny models' lm_head, at the widest call, bf16 out.
    The tiny heads wait for a GPU: gate 4 over 128 rows of an 8k-column head takes minutes of composed ops on a CPU."""
    extra = {"out": OUT} if bits == 16 else {"group": group, "out": OUT}
    out = []
    for label, m, heavy in MODELS:
        kv = m["kv_heads"] * m["head_dim"]
        projections = [("q/o", m["hidden"], m["hidden"], heavy), ("k/v", kv, m["hidden"], heavy),
                       ("gate/up", m["inter"], m["hidden"], heavy), ("down", m["hidden"], m["inter"], heavy)]
        if not heavy:
            projections.append(("lm_head", m["vocab"], m["hidden"], True))
        if label == "tiny drafter" or (heavy and label == "1B"):
            projections = projections[2:]  # their MLP shapes (and head); their attention shapes add no new case
        if label == "tiny":  # a group's rank of the shipped target (tests/test_group.py): its shards' shapes
            d = m["hidden"]
            projections += [(what, n, k, False) for what, n, k in shard_sizes(
                [("q", d, d), ("k/v", kv, d), ("gate/up", m["inter"], d)], [("o", d, d), ("down", d, m["inter"])],
                bits, group, served=tuple((n, k) for _, n, k, _ in projections))]
        out += [Shape(f"{label} {what} {n}x{k}", {"n": n, "k": k, **extra}, WIDEST_CALL, big)
                for what, n, k, big in projections]
    return tuple(out)


def fused_served(fusion: str) -> tuple[Shape, ...]:
    """Each model's o_proj and down_proj (residual: down_proj adds it where gate|up stores swiglu), down_proj (swiglu
    residual) or gate|up (swiglu: n the swiglu's width), at the widest call: a group's ranks add the residual after
    their sum, so no shard shape is served fused."""
    out = []
    for label, m, heavy in MODELS:
        d, inter = m["hidden"], m["inter"]
        sizes = {"residual": [("o", d, d), ("down", d, inter)], "swiglu residual": [("down", d, inter)],
                 "swiglu": [("gate|up", inter, d)]}[fusion]
        out += [Shape(f"{label} {what} {n}x{k}", {"n": n, "k": k, "out": OUT}, WIDEST_CALL, heavy)
                for what, n, k in sizes]
    return tuple(out)


def normed_served(fusion: str) -> tuple[Shape, ...]:
    """Each model's q|k|v (norm) or gate|up (norm swiglu: n the swiglu's width) behind its RMSNorm, at the widest
    call (a group's rank norms apart: no shard shape is served normed)."""
    out = []
    for label, m, heavy in MODELS:
        d, kv = m["hidden"], m["kv_heads"] * m["head_dim"]
        what, n = ("q|k|v", d + 2 * kv) if fusion == "norm" else ("gate|up", m["inter"])
        out.append(gemv_normed.shape(f"{label} {what} {n}x{d}", n, d, 1e-5, heavy=heavy))
    return tuple(out)


BF16 = record("llama", 16, served(16))
RESIDUAL = gemv_fused.record("llama", "residual", fused_served("residual"))
SWIGLU_RESIDUAL = gemv_fused.record("llama", "swiglu residual", fused_served("swiglu residual"))
SWIGLU = gemv_fused.record("llama", "swiglu", fused_served("swiglu"))
NORM = gemv_normed.record("llama", "norm", normed_served("norm"))
NORM_SWIGLU = gemv_normed.record("llama", "norm swiglu", normed_served("norm swiglu"))
Q4 = record("llama", 4, served(4))
Q8 = record("llama", 8, served(8))
