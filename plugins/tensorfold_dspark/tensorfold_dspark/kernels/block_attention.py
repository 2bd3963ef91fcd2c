"""The DSpark block's attention under contract: each block row over its lane's context keys and its whole block."""

# The layout is what the drafter holds at the call (model.Attention): q [rows, heads, head_dim], normed and rotated;
# the lane's context keys and values as its buffer [1 or none, kv_heads, capacity, head_dim] with the first n rows
# valid, passed whole (rows past n may be stale after a cut, and a [..., :n, :] slice would be copied); and the
# block's own keys and values [1 or none, kv_heads, B, head_dim], laid out as model.Attention has them. They stay in a
# buffer of their own rather than appended after the context: the lane holds only absorbed target rows (a block's
# drafts must never enter it), and appending into a copy moves the whole context every layer, the concatenation the
# drafter pays today. One block of rows (one lane) a call.

from __future__ import annotations

import functools
import hashlib

import numpy as np

from tensorfold_contract import Control, Finding, KernelRecord, Launch, Shape, Source, Tolerance, \
    oversize_threadgroup, swap, variant
from tensorfold_contract.helpers import EPS32, kept_array, mx_dtype, rounded
from tensorfold_contract.kernel_text import build as build_kernel
from tensorfold_core.row_kernels.attention import GROUPS, SPLIT, STALE, THREADS, VMAX

from .block_attention_sources import CUDA, METAL

QSPREAD = 1.0  # q rows scaled by 10^(-QSPREAD..QSPREAD): flat and one-hot softmaxes alike
NAMES = ("q", "context_keys", "context_values", "block_keys", "block_values", "scale", "dims")
TINY = dict(heads=8, kv_heads=2, head_dim=32, block=8)  # the shipped tiny-lfm2-moe-dspark
LFM2_24B = dict(heads=32, kv_heads=8, head_dim=64, block=9)  # LiquidAI's LFM2.5-24B-A2B-DSpark


def check(q, context_keys, context_values, n: int, block_keys, block_values) -> tuple[int, ...]:
    """(rows, heads, head_dim, kv_heads, capacity, block) of a call; a shape no kernel here serves is refused."""
    if q.ndim != 3:
        raise ValueError(f"block attention takes q as [rows, heads, head_dim], got shape {tuple(q.shape)}")
    rows, heads, dim = q.shape
    shapes = [tuple(a.shape) for a in (context_keys, context_values, block_keys, block_values)]
    shapes = [s[1:] if len(s) == 4 and s[0] == 1 else s for s in shapes]  # the lane's [1, kv_heads, ., head_dim]
    ck, cv, bk, bv = shapes
    if len(ck) != 3 or ck != cv or ck[2] != dim:
        raise ValueError(f"context keys {ck} and values {cv} must both be [kv_heads, capacity, {dim}]")
    if len(bk) != 3 or bk != bv or bk[0] != ck[0] or bk[2] != dim:
        raise ValueError(f"block keys {bk} and values {bv} must both be [{ck[0]}, block, {dim}]")
    kv_heads, capacity, block = ck[0], ck[1], bk[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} heads are not a multiple of {kv_heads} kv heads")
    if dim % 32 or SPLIT % dim:
        raise ValueError(f"head_dim {dim}: the kernels take 32, 64, 128 or 256")
    if not 0 <= n <= capacity:
        raise ValueError(f"a context of {n} keys does not fit its buffer of {capacity}")
    if block < 1:
        raise ValueError("a block holds at least its pending token's key")
    return rows, heads, dim, kv_heads, capacity, block


def mlx_block_attention(q, context_keys, context_values, n: int, block_keys, block_values, scale: float):
    """The drafter's own call, `model.block_attention`, on the record's layouts; float32 out."""
    import mlx.core as mx

    from ..model import block_attention

    rows, heads, dim, kv_heads, capacity, block = check(q, context_keys, context_values, n, block_keys, block_values)
    if rows == 0:
        return mx.zeros((0, heads, dim), mx.float32)
    context = [a.reshape(1, kv_heads, capacity, dim) for a in (context_keys, context_values)]
    own = [a.reshape(1, kv_heads, block, dim) for a in (block_keys, block_values)]
    o = block_attention(q[None].transpose(0, 2, 1, 3), context[0], context[1], n, own[0], own[1], scale)
    return o[0].transpose(1, 0, 2).astype(mx.float32)


def _attend(q, context_keys, context_values, n: int, block_keys, block_values, scale: float, *,
            context_end: int | None = None, block_end: int | None = None, causal: bool = False):
    """The drafter's call written out with the knobs the planted defects turn (served: model.block_attention)."""
    import mlx.core as mx

    rows, heads, dim, kv_heads, capacity, block = check(q, context_keys, context_values, n, block_keys, block_values)
    if rows == 0:
        return mx.zeros((0, heads, dim), mx.float32)
    context_end = n if context_end is None else context_end
    block_end = block if block_end is None else block_end
    k, v = (mx.concatenate([c.reshape(1, kv_heads, capacity, dim)[..., :context_end, :],
                            b.reshape(1, kv_heads, block, dim)[..., :block_end, :]], axis=2)
            for c, b in ((context_keys, block_keys), (context_values, block_values)))
    mask = None
    if causal:  # block key i seen by rows i.. only
        keys = mx.arange(context_end + block_end)[None]
        mask = ((keys < context_end) | (keys - context_end <= mx.arange(rows)[:, None]))[None, None]
    o = mx.fast.scaled_dot_product_attention(q[None].transpose(0, 2, 1, 3), k, v, scale=scale, mask=mask)
    return o[0].transpose(1, 0, 2).astype(mx.float32)


@functools.lru_cache(maxsize=1024)
def _geometry(rows: int, heads: int, dim: int) -> Launch:
    """One block of THREADS per (row, head): grid in threads, x the head, y the row."""
    import mlx.core as mx

    return Launch(grid=(heads * THREADS if rows else 0, rows, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((rows, heads, dim),), output_dtypes=(mx.float32,),
                  template=(("D", dim), ("SPLIT", SPLIT), ("GROUPS", GROUPS)),
                  # wmax, wsum, ew, part, smax, ssum and sval, each one a group
                  static_shared=4 * GROUPS * (2 * (SPLIT // 32) + 2 * SPLIT + 2 + dim))


@functools.lru_cache(maxsize=256)
def _small(values: tuple, dtype: str):
    """A small array a call reads (dims, scale), made once for every layer's call of a hold."""
    return kept_array(values, dtype)


def _kernel_inputs(q, context_keys, context_values, n: int, block_keys, block_values, scale: float) -> list:
    rows, heads, _, kv_heads, capacity, block = check(q, context_keys, context_values, n, block_keys, block_values)
    # the lane's [1, kv_heads, capacity, head_dim] goes in as it is: the same memory as [kv_heads, capacity, head_dim]
    return [q, context_keys, context_values, block_keys, block_values, _small((scale,), "float32"),
            _small((rows, heads, kv_heads, capacity, n, block), "int32")]


_BUILT: dict = {}


def _source_attention(kind: str, q, context_keys, context_values, n: int, block_keys, block_values, scale: float):
    import mlx.core as mx

    rows, heads, dim, *_ = check(q, context_keys, context_values, n, block_keys, block_values)
    if rows == 0:
        return mx.zeros((0, heads, dim), mx.float32)
    kernel = _BUILT.get(kind)
    if kernel is None:
        body = CUDA if kind == "cuda" else METAL
        # named by its text: MLX caches compiled kernels by name, in memory and on disk
        name = f"tf_dspark_block_attention_{hashlib.sha1(body.encode()).hexdigest()[:12]}"
        kernel = _BUILT[kind] = build_kernel(kind, name, NAMES, ["out"], body)
    launch = _geometry(rows, heads, dim)
    (out,) = kernel(inputs=_kernel_inputs(q, context_keys, context_values, n, block_keys, block_values, scale),
                    template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
                    output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))
    return out


def cuda_block_attention(q, context_keys, context_values, n: int, block_keys, block_values, scale: float):
    """The cuda kernel; pass the lane's whole buffer (a [..., :n, :] slice is copied to be made contiguous)."""
    return _source_attention("cuda", q, context_keys, context_values, n, block_keys, block_values, scale)


def metal_block_attention(q, context_keys, context_values, n: int, block_keys, block_values, scale: float):
    """The metal kernel, the same algorithm as cuda's (never run here: no Apple machine)."""
    return _source_attention("metal", q, context_keys, context_values, n, block_keys, block_values, scale)


# What a hold could call, by implementation kind: out[r] = softmax(scale q[r] [ck[:n]; bk]^T) [cv[:n]; bv], float32
# [rows, heads, head_dim] for q of any float dtype
BLOCK_ATTENTION = {"mlx": mlx_block_attention, "cuda": cuda_block_attention, "metal": metal_block_attention}


def make(dims, rows, rng):
    """`rows` block rows over a context of dims["context"] keys in a buffer holding STALE NaN keys past it."""
    h, kv, d, n, b, dtype = (dims[k] for k in ("heads", "kv_heads", "head_dim", "context", "block", "dtype"))
    spread = 10.0 ** rng.uniform(-QSPREAD, QSPREAD, size=(rows, h, 1))
    host = {"q": rounded(rng.standard_normal((rows, h, d)) * spread, dtype)}
    for where, keys in (("context", n + STALE), ("block", b)):
        host[f"{where}_keys"] = rounded(rng.standard_normal((kv, keys, d)), dtype)
        host[f"{where}_values"] = rounded(rng.uniform(-VMAX, VMAX, (kv, keys, d)), dtype)
    host["context_keys"][:, n:] = np.nan  # a kernel that reads past n fails gate 2
    host["context_values"][:, n:] = np.nan
    host["scale"] = np.array([d ** -0.5], np.float32)
    return host


def reference(case):
    """Softmax attention in float64 on the host: every row over the n context keys and all the block's keys."""
    n = case.dims["context"]
    q = case["q"].astype(np.float64)
    k, v = (np.concatenate([case[f"context_{a}"][:, :n], case[f"block_{a}"]], axis=1).astype(np.float64)
            for a in ("keys", "values"))
    rows, h, d = q.shape
    kv = k.shape[0]
    s = np.einsum("rkgd,knd->rkgn", q.reshape(rows, kv, h // kv, d), k) * float(case["scale"][0])
    w = np.exp(s - s.max(axis=-1, keepdims=True, initial=-np.inf))
    out = np.einsum("rkgn,knd->rkgd", w, v) / w.sum(axis=-1)[..., None]
    return {"out": out.reshape(rows, h, d)}


def tolerance(dims):
    # in units of VMAX (an output can average out to ~0, so no relative bound): fp32 scores err by about
    # u sqrt(head_dim) times their size (up to ~10^QSPREAD), and each moves its weight by that much; the fp32 sums of
    # exp and of weighted values add about u sqrt(keys). The served bf16 call (MLX's SDPA in the input dtype) also
    # rounds q * scale and then the scores to bf16: two errors of u_bf16 times a score (up to ~3 * 10^QSPREAD), each
    # moving the output by up to twice that; and it rounds the weights and the output once each
    keys = dims["context"] + dims["block"]
    fp32 = EPS32 * (32 + 2 * np.sqrt(dims["head_dim"]) * 10 ** QSPREAD + 4 * np.sqrt(keys))
    bf16 = 2.0 ** -9 * (4 + 4 * 3 * 10 ** QSPREAD) if dims["dtype"] == "bfloat16" else 0.0
    return Tolerance(atol=VMAX * (fp32 + bf16))


def _call(case):
    """The call a hold makes: the lane's whole buffer (NaN past n), the block's keys, the rows' queries."""
    dt = mx_dtype(case.dims["dtype"])
    return (case.array("q", dt), case.array("context_keys", dt), case.array("context_values", dt),
            case.dims["context"], case.array("block_keys", dt), case.array("block_values", dt),
            float(case["scale"][0]))


def composed(**knobs):
    """The mlx implementation on a case; a planted defect turns one of _attend's knobs."""
    return lambda case: {"out": _attend(*_call(case), **knobs)}


def source(kind: str) -> Source:
    return Source("dspark_block_attention", NAMES, ("out",), CUDA if kind == "cuda" else METAL,
                  inputs=lambda case: _kernel_inputs(*_call(case)),
                  launch=lambda case: _geometry(case.rows, case.dims["heads"], case.dims["head_dim"]))


def block_cut_to_the_row_count(case):
    """Planted: a call attends only as many block keys as it has rows (a hold's rows are its block, until not)."""
    return {"out": _attend(*_call(case), block_end=min(case.rows, case.dims["block"]))}


def stale_context_attended(case):
    """Planted: the lane's whole buffer attended, the rows past n too."""
    return {"out": _attend(*_call(case), context_end=case.dims["context"] + STALE)}


def edits(*pairs: tuple[str, str]):
    """Plant several edits of a source's text at once, each on a line it holds once."""
    plants = [swap(old, new) for old, new in pairs]

    def plant(impl):
        for one in plants:
            impl = one(impl)
        return impl

    return plant


# The cuda source's planted defects
CUDA_DROPPED_LAST_CONTEXT_KEY = swap("if (base + t >= T) sc = NEG_INF;",
                                     "if (base + t >= T || base + t == n - 1) sc = NEG_INF;")
_HALF = "(rows > 1 ? SPLIT / 2 : SPLIT)"
CUDA_SPLIT_BY_ROW_COUNT = edits(  # splits of SPLIT / 2 keys when more than one row shares the call
    ("const int last = (T - 1) / SPLIT;", f"const int last = (T - 1) / {_HALF};"),
    ("const int base = (first + g) * SPLIT;", f"const int base = (first + g) * {_HALF};"),
    ("if (base + t >= T) sc = NEG_INF;", f"if (base + t >= T || t >= {_HALF}) sc = NEG_INF;"))
CUDA_BLOCK_FROM_ROW_COUNT = swap("const int B = dims[5];", "const int B = min(dims[5], rows);")
CUDA_FP16_ACCUMULATOR = swap("acc = fmaf(ew[g][j16 + i - base], vs[i], acc);",  # in both runs, context and block
                             "acc = __half2float(__float2half(fmaf(ew[g][j16 + i - base], vs[i], acc)));", count=2)

# Declared by kinship, not yet seen: this record has not met a GPU. In MLX's sources SDPA on CUDA picks its path by
# the query's row count and head_dim (a vector kernel, cuDNN or the matmul fallback), so a row's bits may follow the
# call's rows; and MLX's CUDA matmul was TF32-like on the H200 (the window attention's and the Markov pick's receipts).
# A draft that differs costs acceptance, never a reply's ids: the target verifies every draft.
ON_CUDA = (Finding("MLX's SDPA on CUDA picks its path by the call's row count: not row-invariant there; "
                   "the cuda implementation is the exact one", kind="mlx", gate=4, backend="cuda"),
           *(Finding("MLX's CUDA matmul is TF32-like, less precise than the record's float32 tolerance, and SDPA's "
                     "fallback is composed of it: the cuda implementation serves there",
                     kind="mlx", gate=gate, backend="cuda", symptom=" off by ", mlx="0.32.4") for gate in (2, 3)))


def shape(label: str, model: dict, context: int, dtype: str = "float32", rows: int | None = None,
          heavy: bool = False) -> Shape:
    """A block of a model's heads (heads, kv_heads, head_dim, block) over `context` keys; its rows the block's."""
    dims = {**model, "context": context, "dtype": dtype}
    return Shape(label, dims, model["block"] if rows is None else rows, heavy)


RECORD = KernelRecord(
    name="dspark block attention",
    family="dspark",
    description="out[r] = softmax(scale q[r] [ck[:n]; bk]^T) [cv[:n]; bv] for every row r of a block (non-causal), "
                f"GQA, fixed splits of {SPLIT} keys over the context then the block, folded in order; fp32 output",
    make=make,
    reference=reference,
    implementations={"mlx": composed(), "cuda": source("cuda"), "metal": source("metal")},
    shapes=(
        shape("tiny drafter over 300 keys", TINY, 300),
        shape("tiny drafter bf16 over 700 keys", TINY, 700, "bfloat16"),
        shape("LFM2.5-24B-A2B drafter bf16 over 300 keys", LFM2_24B, 300, "bfloat16"),
        shape("LFM2.5-24B-A2B drafter bf16 over 4096 keys", LFM2_24B, 4096, "bfloat16", heavy=True),
    ),
    edges=(
        shape("1 row", TINY, 300, rows=1),
        shape("no context yet", TINY, 0),
        shape("context and block across a split boundary (250 + 8)", TINY, 250),
        shape("context on a split's last key (256 + 8)", TINY, 256),
        shape("a block of 1 over 40 keys", {**TINY, "block": 1}, 40),
        shape("head_dim 64, one split and a key (248 + 9)", LFM2_24B, 248),
        shape("empty", TINY, 40, rows=0),
    ),
    tolerance=tolerance,
    row_inputs=("q",),
    findings=ON_CUDA,
    controls=(
        Control("causal inside the block", "mlx", 2, variant(composed(causal=True))),
        Control("block's own keys dropped", "mlx", 2, variant(composed(block_end=0))),
        Control("stale context keys attended", "mlx", 2, variant(stale_context_attended)),
        Control("block keys cut to the row count", "mlx", 4, variant(block_cut_to_the_row_count)),
        Control("last context key dropped", "cuda", 2, CUDA_DROPPED_LAST_CONTEXT_KEY),
        Control("split size by row count", "cuda", 4, CUDA_SPLIT_BY_ROW_COUNT),
        Control("block length from the row count", "cuda", 4, CUDA_BLOCK_FROM_ROW_COUNT),
        Control("fp16 value accumulator", "cuda", 2, CUDA_FP16_ACCUMULATOR),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
