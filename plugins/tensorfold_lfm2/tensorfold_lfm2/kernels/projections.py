"""The lfm2 families' records of the shared row kernels: the GEMV (every projection, each expert's alone, the router's
gate, the tied head), RMSNorm (the blocks' and the per-head q/k norms), window attention (a stream a launch, and every
stream of a forward in one) and the stack of the attention layers' new keys and values, at lfm2's shapes."""

from __future__ import annotations

from tensorfold_contract import Shape
from tensorfold_core.row_kernels import attention, attention_streams, gemv, gemv_fused, gemv_normed, rmsnorm, stack
from tensorfold_core.row_kernels.gemv import WIDEST_CALL

from .common import LFM2_1B, TINY_LFM2, TINY_MOE, TINY_MOE_MLP

MODELS = (("tiny-lfm2", TINY_LFM2, False), ("LFM2-1.2B", LFM2_1B, True))
ATTENTION_LAYERS = {"tiny-lfm2": 2, "LFM2-1.2B": 6}  # the stacked caches' layers: the layers that attend
CONV_LAYERS = {"tiny-lfm2": 4, "LFM2-1.2B": 10}  # and the conv layers, whose tails the same kernel stacks


def projections(bits: int, group: int = 64) -> tuple[Shape, ...]:
    """Each model's projections (n x k) at the widest call, bf16 out; heads only on a GPU (minutes on a CPU)."""
    extra = {"out": gemv.OUT} if bits == 16 else {"group": group, "out": gemv.OUT}
    out = []
    for label, m, heavy in MODELS:
        d, kv = m["hidden"], m["kv_heads"] * m["head_dim"]
        sizes = [("conv in_proj", 3 * d, d), ("q/out_proj", d, d), ("k/v", kv, d), ("w1/w3", m["ff"], d),
                 ("w2", d, m["ff"])]
        if label == "tiny-lfm2":  # the MoE's experts and router gate (its dense layers share the shapes above)
            expert = TINY_MOE_MLP["expert_ff"]
            sizes += [("expert gate/up", expert, d), ("expert down", d, expert),
                      ("router gate", TINY_MOE["experts"], d)]
            # a group's rank (tests/test_group.py): conv in_proj's B, C and x blocks split alike, every expert too
            columns = [("conv in_proj", 3 * d, d), ("q", d, d), ("k/v", kv, d), ("w1/w3", m["ff"], d)]
            rows = [("out_proj", d, d), ("w2", d, m["ff"])]
            sizes += gemv.shard_sizes(columns, rows, bits, group, served=tuple((n, k) for _, n, k in sizes),
                                      pairs=(("expert gate/up", "expert down", expert, d),))
        out += [Shape(f"{label} {what} {n}x{k}", {"n": n, "k": k, **extra}, gemv.WIDEST_CALL, heavy)
                for what, n, k in sizes]
        out.append(Shape(f"{label} head {m['vocab']}x{d}", {"n": m["vocab"], "k": d, **extra}, gemv.WIDEST_CALL, True))
    return tuple(out)


def fused_projections(fusion: str) -> tuple[Shape, ...]:
    """Each model's out_proj and w2 (residual: they add it), w1|w3 (swiglu: n the swiglu's width), at the widest
    call; a group's ranks add the residual after their sum, so no shard shape is served fused."""
    out = []
    for label, m, heavy in MODELS:
        d, ff = m["hidden"], m["ff"]
        sizes = {"residual": [("out_proj", d, d), ("w2", d, ff)], "swiglu": [("w1|w3", ff, d)]}[fusion]
        out += [Shape(f"{label} {what} {n}x{k}", {"n": n, "k": k, "out": gemv.OUT}, gemv.WIDEST_CALL, heavy)
                for what, n, k in sizes]
    return tuple(out)


def normed_projections(fusion: str) -> tuple[Shape, ...]:
    """Each model's operator norm read by conv in_proj and by q|k|v (norm), its ffn norm by w1|w3 storing swiglu
    (norm swiglu: n the swiglu's width), at the widest call."""
    out = []
    for label, m, heavy in MODELS:
        d, kv = m["hidden"], m["kv_heads"] * m["head_dim"]
        sizes = [("in_proj", 3 * d), ("q|k|v", d + 2 * kv)] if fusion == "norm" else [("w1|w3", m["ff"])]
        out += [gemv_normed.shape(f"{label} {what} {n}x{d}", n, d, 1e-5, heavy=heavy) for what, n in sizes]
    return tuple(out)


def records() -> list:
    norms = tuple(rmsnorm.shape(f"{label} {what} bf16", width, "bfloat16")
                  for label, m, _ in MODELS for what, width in (("hidden", m["hidden"]), ("q/k head", m["head_dim"])))
    heads = (attention.shape("tiny-lfm2 bf16, 700 keys", TINY_LFM2, 700),
             attention.shape("tiny-lfm2 fp32, 40 keys", TINY_LFM2, 40, "float32"),
             attention.shape("LFM2-1.2B bf16, 4096 keys", LFM2_1B, 4096, heavy=True))
    return [gemv.record("lfm2", 16, projections(16)),
            gemv_fused.record("lfm2", "residual", fused_projections("residual")),
            gemv_fused.record("lfm2", "swiglu", fused_projections("swiglu")),
            gemv_normed.record("lfm2", "norm", normed_projections("norm")),
            gemv_normed.record("lfm2", "norm swiglu", normed_projections("norm swiglu")),
            gemv.record("lfm2", 4, projections(4)),
            gemv.record("lfm2", 8, projections(8)), rmsnorm.record("lfm2", (rmsnorm.shape("tiny-lfm2 fp32", 256),
                                                                            *norms)),
            attention.record("lfm2", heads), attention_streams.record("lfm2", streams_heads()),
            stack.record("lfm2", stacks())]


def streams_heads() -> tuple[Shape, ...]:
    """The packed-streams attention at the heads lfm2 serves: 8 streams and fewer, fp32 and bf16."""
    return (attention_streams.shape("tiny-lfm2 fp32, 3 streams, 500 keys", TINY_LFM2, 500, 3, "float32"),
            attention_streams.shape("tiny-lfm2 bf16, 8 streams, 300 keys", TINY_LFM2, 300, 8),
            attention_streams.shape("LFM2-1.2B bf16, 8 streams, 600 keys", LFM2_1B, 600, 8),
            attention_streams.shape("LFM2-1.2B bf16, 4 streams, 4096 keys", LFM2_1B, 4096, 4, heavy=True))


def stacks() -> tuple[Shape, ...]:
    """The attention layers' keys and values stacked at each model's count of them, and the conv layers' tails
    ([rows, L - 1, hidden] each), bf16 and fp32."""
    keys = tuple(Shape(f"{label} {dtype}, {ATTENTION_LAYERS[label]} layers",
                       {"layers": ATTENTION_LAYERS[label], "kv_heads": m["kv_heads"], "head_dim": m["head_dim"],
                        "dtype": dtype}, WIDEST_CALL)
                 for label, m, _ in MODELS for dtype in ("bfloat16", "float32"))
    tails = tuple(Shape(f"{label} {dtype}, {CONV_LAYERS[label]} conv layers' tails",
                        {"layers": CONV_LAYERS[label], "kv_heads": m["conv_L"] - 1, "head_dim": m["hidden"],
                         "dtype": dtype}, WIDEST_CALL)
                  for label, m, _ in MODELS for dtype in ("bfloat16", "float32"))
    return keys + tails
