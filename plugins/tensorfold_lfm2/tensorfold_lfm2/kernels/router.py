"""The LFM2-MoE router under contract: sigmoid scores, top-k chosen with the expert bias, unbiased weights."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, Tolerance, oversize_threadgroup, swap, \
    variant

from .common import BF16_ULP, DTYPES, EPS32, MOE_32, TINY_MOE, WIDEST, groups, int_array, mx_dtype, rounded, spacing

THREADS = 32

HEADER = """
// (choice, id) pairs ordered by choice, then by the lower id: a total order, so the top k are one set in one order
// however they are searched, and a tie goes to the lowest expert id.
#define TF_BEFORE(c, i, bc, bi) ((c) > (bc) || ((c) == (bc) && (i) < (bi)))
"""

CUDA = """
// One thread per row. Pick j is the first, in (choice, id) order, of the experts ranked after pick j-1. Scores are
// rounded to the activation dtype, as the family's sigmoid leaves them; the weights are the unbiased scores.
const int rows = dims[0];
const int E = dims[1];
const int row = blockIdx.x * blockDim.x + threadIdx.x;
if (row >= rows) return;
const T* lr = logits + (size_t)row * E;
float picked[K];
float prev_c = 0.0f;
int prev_i = -1;
for (int j = 0; j < K; ++j) {
  float best_c = 0.0f, best_s = 0.0f;
  int best_i = -1;
  for (int e = 0; e < E; ++e) {
    const float s = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-static_cast<float>(lr[e])))));
    const float c = HAS_BIAS ? s + bias[e] : s;
    if (prev_i >= 0 && !TF_BEFORE(prev_c, prev_i, c, e)) continue;  // picked already
    if (best_i < 0 || TF_BEFORE(c, e, best_c, best_i)) { best_c = c; best_s = s; best_i = e; }
  }
  indices[(size_t)row * K + j] = best_i;
  picked[j] = best_s;
  prev_c = best_c;
  prev_i = best_i;
}
float total = 0.0f;
for (int j = 0; j < K; ++j) total += picked[j];
for (int j = 0; j < K; ++j) {
  const float w = NORM ? picked[j] / (total + 1e-6f) : picked[j];
  weights[(size_t)row * K + j] = static_cast<T>(w * scale[0]);
}
"""

METAL = """
// One thread per row; the same picks in the same order as the CUDA source.
const int rows = dims[0];
const int E = dims[1];
const int row = (int)thread_position_in_grid.x;
if (row >= rows) return;
float picked[K];
float prev_c = 0.0f;
int prev_i = -1;
for (int j = 0; j < K; ++j) {
  float best_c = 0.0f, best_s = 0.0f;
  int best_i = -1;
  for (int e = 0; e < E; ++e) {
    const float x = static_cast<float>(logits[row * E + e]);
    const float s = static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-x))));
    const float c = HAS_BIAS ? s + bias[e] : s;
    if (prev_i >= 0 && !TF_BEFORE(prev_c, prev_i, c, e)) continue;
    if (best_i < 0 || TF_BEFORE(c, e, best_c, best_i)) { best_c = c; best_s = s; best_i = e; }
  }
  indices[row * K + j] = best_i;
  picked[j] = best_s;
  prev_c = best_c;
  prev_i = best_i;
}
float total = 0.0f;
for (int j = 0; j < K; ++j) total += picked[j];
for (int j = 0; j < K; ++j) {
  const float w = NORM ? picked[j] / (total + 1e-6f) : picked[j];
  weights[row * K + j] = static_cast<T>(w * scale[0]);
}
"""


# --- inputs and the float64 reference ---------------------------------------------------------------------------------


def _scores(logits: np.ndarray, dtype: str) -> np.ndarray:
    """sigmoid in float64, rounded to the activation dtype (the family's scores are in that dtype)."""
    return rounded(1.0 / (1.0 + np.exp(-logits.astype(np.float64))), dtype).astype(np.float64)


def _choice(scores: np.ndarray, bias) -> np.ndarray:
    """What picks the experts: the scores plus the expert bias, added in float32 as the family adds them."""
    if bias is None:
        return scores
    return (scores.astype(np.float32) + np.asarray(bias, np.float32)).astype(np.float64)


def _order(choice: np.ndarray) -> np.ndarray:
    """Expert ids best first: by choice, then the lower id."""
    return np.lexsort((np.arange(choice.shape[-1]), -choice))


def _conflict(logits, bias, dims):
    """Two experts whose order could hang on the last ulp of the dtype's sigmoid (None: the picks are well posed).

    MLX does not round the sigmoid alike on every backend (on the CPU, 14% of bf16 scores sit an ulp from the
    nearest), so among the top k + 2 any two experts must either tie exactly (same logit and bias: planted) or lie
    more than 2 spacings of the dtype apart, where an ulp cannot swap or tie them.
    """
    E, dtype = dims["experts"], dims["dtype"]
    b = np.zeros(E) if bias is None else bias
    c = _choice(_scores(logits, dtype), bias)
    top = _order(c)[:dims["top_k"] + 2]
    margin = 2 * spacing(dtype) if dtype == "bfloat16" else 2.0 ** -16
    for n, i in enumerate(top):
        for j in top[n + 1:]:
            if not (logits[i] == logits[j] and b[i] == b[j]) and abs(c[i] - c[j]) <= margin:
                return int(i), int(j)
    return None


def _row(dims, r, rng, bias):
    """One row's logits: a tie planted at the pick boundary (r % 3 == 1) or at the top (r % 3 == 2), else none."""
    E, k, dtype = dims["experts"], dims["top_k"], dims["dtype"]
    plant = r % 3 if dims.get("ties", True) else 0
    draw = lambda n: rounded(1.5 * rng.standard_normal(n), dtype)
    for _ in range(1000):
        logits, pair, above = draw(E), (), 0
        if plant:
            # a pair sharing a bias (bias ties 2m and 2m+1), given one logit so that k-1 (or no) others outrank it
            if bias is None:
                pair = tuple(sorted(int(e) for e in rng.choice(E, 2, replace=False)))
            else:
                a = 2 * int(rng.integers(E // 2))
                pair = (a, a + 1)
            oc = np.sort(_choice(_scores(logits, dtype), bias)[np.delete(np.arange(E), pair)])[::-1]
            above = min(k - 1, E - 2) if plant == 1 else 0
            hi = oc[above - 1] if above > 0 else oc[0] + 0.3
            lo = oc[above] if above < len(oc) else oc[-1] - 0.3
            p = (lo + hi) / 2 - (0.0 if bias is None else float(bias[pair[0]]))
            if not 0.02 < p < 0.98:
                continue
            logits[list(pair)] = rounded(np.array([np.log(p / (1 - p))]), dtype)[0]
        for _ in range(100):  # redraw the unplanted one of each close pair near the top until none is left
            close = _conflict(logits, bias, dims)
            if close is None:
                break
            logits[close[0] if close[0] not in pair else close[1]] = draw(1)[0]
        c = _choice(_scores(logits, dtype), bias)
        if close is None and (not pair or int(np.sum(c > c[pair[0]])) == above):
            return logits
    raise RuntimeError(f"no well-posed router row for {dims} in 1000 draws")


def make(dims, rows, rng):
    E = dims["experts"]
    bias = None
    if dims["bias"]:
        bias = (0.1 * rng.standard_normal(E)).astype(np.float32)
        bias[1::2] = bias[0::2]  # experts 2m and 2m+1 share a bias, so exact ties can be planted between them
    logits = np.stack([_row(dims, r, rng, bias) for r in range(rows)]) if rows else np.zeros((0, E), np.float32)
    out = {"logits": logits, "scale": np.array([dims["scale"]], np.float32)}
    if bias is not None:
        out["bias"] = bias
    return out


def reference(case):
    d = case.dims
    k = d["top_k"]
    scores = _scores(case["logits"], d["dtype"])
    choice = _choice(scores, case.host.get("bias"))
    indices = np.stack([_order(row)[:k] for row in choice]) if case.rows else np.zeros((0, k), np.int64)
    w = np.take_along_axis(scores, indices, axis=-1)
    if d["norm"]:
        w = w / (w.sum(axis=-1, keepdims=True) + 1e-6)
    return {"indices": indices.astype(np.int64), "weights": w * d["scale"]}


def tolerance(dims):
    # the scores are off by up to an ulp of the dtype (MLX's sigmoid); bf16 adds the family's bf16 sum and divide
    rtol = 4 * BF16_ULP / 2 if dims["dtype"] == "bfloat16" else 64 * EPS32
    return {"indices": Tolerance(), "weights": Tolerance(rtol=rtol)}


# --- mlx: the family's routing, with a top-k that breaks ties to the lowest id ---------------------------------------


def top_k(choice, k: int):
    """The k best experts per row, best first, by choice and then the lower id: no sort, no tie left to chance."""
    import mlx.core as mx

    ids = mx.arange(choice.shape[-1])
    before = (choice[..., None, :] > choice[..., :, None]) | (
        (choice[..., None, :] == choice[..., :, None]) & (ids[None, :] < ids[:, None]))  # [.., e, f]: f before e
    rank = mx.sum(before, axis=-1)  # each expert's place, 0..E-1, one per expert
    return mx.argmax(rank[..., None, :] == mx.arange(k)[:, None], axis=-1)


def route(scores, expert_bias, k: int, norm_topk_prob: bool, routed_scaling_factor: float, dtype, pick=top_k):
    """SparseMoeBlock's routing from its scores: (experts [.., k], weights [.., k]), ties to the lowest id."""
    import mlx.core as mx

    # the expert bias only balances which experts are chosen; the weights stay the unbiased scores
    choice = scores.astype(mx.float32) + expert_bias if expert_bias is not None else scores
    experts = pick(choice, k)
    weights = mx.take_along_axis(scores, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-6)
    return experts, (weights * routed_scaling_factor).astype(dtype)


def _empty(case):
    import mlx.core as mx

    k = case.dims["top_k"]
    return {"indices": mx.zeros((0, k), mx.int32), "weights": mx.zeros((0, k), mx_dtype(case.dims["dtype"]))}


def _routed(case, **change):
    import mlx.core as mx

    d = {**case.dims, **change}
    if case.rows == 0:
        return _empty(case)
    dt = mx_dtype(d["dtype"])
    scores = mx.sigmoid(case.array("logits", dt))  # the gate's output is in the activation dtype, as is its sigmoid
    bias = case.array("bias") if d["bias"] else None
    experts, weights = route(scores, bias, d["top_k"], d["norm"], d["scale"], dt, d.get("pick", top_k))
    return {"indices": experts.astype(mx.int32), "weights": weights}


def mlx_router(case):
    return _routed(case)


def _highest_first(choice, k):
    return choice.shape[-1] - 1 - top_k(choice[..., ::-1], k)


def ties_to_highest(case):
    """Planted: a tie goes to the highest expert id."""
    return _routed(case, pick=_highest_first)


def normalisation_skipped(case):
    """Planted: the picked scores are not normalised (norm_topk_prob ignored)."""
    return _routed(case, norm=False)


def bias_in_weights(case):
    """Planted: the weights gather the biased choice instead of the unbiased scores."""
    import mlx.core as mx

    if case.rows == 0:
        return _empty(case)
    d = case.dims
    dt = mx_dtype(d["dtype"])
    choice = mx.sigmoid(case.array("logits", dt)).astype(mx.float32) + case.array("bias")
    experts, weights = route(choice, None, d["top_k"], d["norm"], d["scale"], dt)
    return {"indices": experts.astype(mx.int32), "weights": weights}


def bias_ignored(case):
    """Planted: the expert bias never reaches the choice."""
    return _routed(case, bias=False)


# --- cuda / metal ----------------------------------------------------------------------------------------------------


def _inputs(case):
    d = case.dims
    logits = case.array("logits", mx_dtype(d["dtype"]))
    bias = case.array("bias") if d["bias"] else case.array("scale")  # not read without a bias (HAS_BIAS is false)
    return [logits, bias, case.array("scale"), int_array([case.rows, d["experts"]])]


def _launch(case):
    import mlx.core as mx

    d = case.dims
    dt = mx_dtype(d["dtype"])
    return Launch(grid=(groups(case.rows, THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((case.rows, d["top_k"]), (case.rows, d["top_k"])), output_dtypes=(mx.int32, dt),
                  template=(("T", dt), ("K", d["top_k"]), ("HAS_BIAS", bool(d["bias"])), ("NORM", bool(d["norm"]))))


def source(kind: str) -> Source:
    return Source("lfm2_router", ("logits", "bias", "scale", "dims"), ("indices", "weights"),
                  CUDA if kind == "cuda" else METAL, inputs=_inputs, launch=_launch, header=HEADER)


def _shape(label, experts, top_k, dtype="bfloat16", rows=WIDEST, norm=True, scale=1.0, bias=True, ties=True):
    return Shape(label, {"experts": experts, "top_k": top_k, "dtype": dtype, "norm": norm, "scale": scale,
                         "bias": bias, "ties": ties}, rows)


SERVED = tuple(_shape(f"{name} {dtype}", moe["experts"], moe["top_k"], dtype, norm=moe["norm"], scale=moe["scale"])
               for name, moe in (("tiny-lfm2-moe", TINY_MOE), ("32 experts top-4", MOE_32)) for dtype in DTYPES)

RECORD = KernelRecord(
    name="lfm2_moe router top-k",
    family="lfm2",
    description="scores = sigmoid(logits) in the activation dtype; the top k of scores + expert bias (ties to the "
                "lowest id), best first; weights = their unbiased scores, normalised when norm_topk_prob, scaled",
    make=make,
    reference=reference,
    implementations={"mlx": mlx_router, "cuda": source("cuda"), "metal": source("metal")},
    shapes=SERVED,
    edges=(
        _shape("1 row", TINY_MOE["experts"], TINY_MOE["top_k"], rows=1),
        _shape("no expert bias bf16", 8, 2, bias=False),
        _shape("top-1", 8, 1, "float32", rows=6),
        _shape("norm off, scale 2.5", 32, 4, "float32", rows=9, norm=False, scale=2.5),
        _shape("64 experts top-8", 64, 8, rows=5),
        _shape("k = experts", 4, 4, "float32", rows=4),
        _shape("40 rows: many streams packed", 8, 2, "float32", rows=40),
        _shape("empty", TINY_MOE["experts"], TINY_MOE["top_k"], rows=0),
    ),
    tolerance=tolerance,
    row_inputs=("logits",),
    controls=(
        Control("ties to the highest id", "mlx", 2, variant(ties_to_highest)),
        Control("expert bias in the weights", "mlx", 2, variant(bias_in_weights)),
        Control("normalisation skipped", "mlx", 2, variant(normalisation_skipped)),
        Control("expert bias ignored", "mlx", 2, variant(bias_ignored)),
        Control("ties to the highest id", "cuda", 2, swap("(i) < (bi)", "(i) > (bi)", where="header")),
        Control("expert bias in the weights", "cuda", 2, swap("best_s = s;", "best_s = c;")),
        Control("normalisation skipped", "cuda", 2, swap("const float w = NORM ?", "const float w = false ?")),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
