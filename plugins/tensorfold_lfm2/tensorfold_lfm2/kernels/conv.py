"""The LFM2 short conv under contract: a depthwise causal conv over a stream's window, with every row's state."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, Tolerance, oversize_threadgroup, swap, \
    variant

from .common import BF16_ULP, DTYPES, EPS32, LFM2_1B, TINY_LFM2, WIDEST, groups, int_array, mx_dtype, rounded

THREADS = 256

CUDA = """
// One thread per (row, channel). The row's L taps in a fixed order (tap 0, the oldest input, first) as fp32 FMAs,
// then the bias; then the L-1 inputs keep() leaves after this row. Nothing a thread does depends on the row count.
const int rows = dims[0];
const int C = dims[1];
const int i = blockIdx.x * blockDim.x + threadIdx.x;
if (i >= rows * C) return;
const int r = i / C;
const int c = i - r * C;
float acc = 0.0f;
for (int j = 0; j < L; ++j) {
  const int t = r + j;  // position in [tail; window rows]
  const float v = t < L - 1 ? static_cast<float>(tail[(size_t)t * C + c])
                            : static_cast<float>(bx[(size_t)(t - (L - 1)) * C + c]);
  acc = fmaf(static_cast<float>(w[(size_t)c * L + j]), v, acc);
}
if (HAS_BIAS) acc += static_cast<float>(bias[c]);
y[i] = static_cast<T>(acc);
for (int q = 0; q < L - 1; ++q) {
  const int t = r + 1 + q;
  states[((size_t)r * (L - 1) + q) * C + c] = t < L - 1 ? tail[(size_t)t * C + c] : bx[(size_t)(t - (L - 1)) * C + c];
}
"""

METAL = """
// One thread per (row, channel); the same fixed tap order as the CUDA source.
const int rows = dims[0];
const int C = dims[1];
const int i = (int)thread_position_in_grid.x;
if (i >= rows * C) return;
const int r = i / C;
const int c = i - r * C;
float acc = 0.0f;
for (int j = 0; j < L; ++j) {
  const int t = r + j;
  const float v = t < L - 1 ? static_cast<float>(tail[t * C + c]) : static_cast<float>(bx[(t - (L - 1)) * C + c]);
  acc = metal::fma(static_cast<float>(w[c * L + j]), v, acc);
}
if (HAS_BIAS) acc += static_cast<float>(bias[c]);
y[i] = static_cast<T>(acc);
for (int q = 0; q < L - 1; ++q) {
  const int t = r + 1 + q;
  states[(r * (L - 1) + q) * C + c] = t < L - 1 ? tail[t * C + c] : bx[(t - (L - 1)) * C + c];
}
"""


def make(dims, rows, rng):
    """The tail before the window, its gated rows B·x, the weights; `tails` holds for each row the tail before it.

    A call reads only its first row's tail; the rest are the states keep() leaves after the rows before, so a
    one-row call of row r (gate 4 slices rows) starts where row r of the window starts: speculation's own claim,
    a k-row window gives each row what k one-row forwards give.
    """
    C, L, dtype = dims["channels"], dims["L"], dims["dtype"]
    first = rounded(rng.standard_normal((L - 1, C)), dtype)
    bx = rounded(rng.standard_normal((rows, C)), dtype)
    seq = np.concatenate([first, bx])
    tails = np.stack([seq[r:r + L - 1] for r in range(rows)]) if rows else np.zeros((0, L - 1, C), np.float32)
    out = {"tails": tails, "bx": bx, "w": rounded(0.5 * rng.standard_normal((C, L)), dtype)}
    if dims["bias"]:
        out["bias"] = rounded(0.1 * rng.standard_normal(C), dtype)
    return out


def reference(case):
    L, k = case.dims["L"], case.rows
    if k == 0:
        C = case.dims["channels"]
        return {"y": np.zeros((0, C)), "states": np.zeros((0, L - 1, C))}
    seq = np.concatenate([case["tails"][0], case["bx"]]).astype(np.float64)
    w = case["w"].astype(np.float64)
    y = sum(w[:, j] * seq[j:j + k] for j in range(L))
    if case.dims["bias"]:
        y = y + case["bias"].astype(np.float64)
    return {"y": y, "states": np.stack([seq[r + 1:r + L] for r in range(k)])}


def tolerance(dims):
    # fp32: L products and a bias; bf16 (what MLX's own conv does): each tap's partial sum rounded to bf16
    if dims["dtype"] == "bfloat16":
        y = Tolerance(rtol=(dims["L"] + 2) * BF16_ULP / 2)
    else:
        y = Tolerance(rtol=64 * EPS32)
    return {"y": y, "states": Tolerance()}  # states are copies: exact


# --- mlx: the family's own code (its Model's sanitize and conv module, its cache's conv_input and commit) ----------


@lru_cache(maxsize=None)
def _model(C: int, L: int, bias: bool, dtype: str):
    """A one-layer LFM2 (one conv layer) of these dims, built by the family; only its conv weights are ever set."""
    from ..lfm2 import Model, ModelArgs

    args = ModelArgs(model_type="lfm2", vocab_size=1, hidden_size=C, num_hidden_layers=1, num_attention_heads=1,
                     intermediate_size=384, conv_L_cache=L, conv_bias=bias, layer_types=["conv"],
                     tie_word_embeddings=True)
    model = Model(args)
    model.dtype = mx_dtype(dtype)
    return model


def _family(case):
    """(model, conv module, a cache holding the call's tail, the window's gated rows) as ShortConv sees them."""
    d = case.dims
    dt = mx_dtype(d["dtype"])
    model = _model(d["channels"], d["L"], d["bias"], d["dtype"])
    # transformers' layout [C, 1, L] through the family's sanitize, as a checkpoint's conv weight is loaded
    weights = {"model.layers.0.conv.conv.weight": case.array("w", dt)[:, None, :]}
    if d["bias"]:
        weights["model.layers.0.conv.conv.bias"] = case.array("bias", dt)
    conv = model.model.layers[0].conv.conv
    for name, value in model.sanitize(weights).items():
        setattr(conv, name.rsplit(".", 1)[1], value)
    tails = case.array("tails", dt)  # every row's tail (a case), or the stream's one tail (a served call)
    return model, conv, tails[None] if tails.ndim == 2 else tails[:1], case.array("bx", dt)[None]


def _cache(model, tail, gated):
    cache = model.new_cache(gated.shape[1])
    cache.conv[0] = tail
    return cache, cache.conv_input(0, gated)


def _empty(case):
    import mlx.core as mx

    d = case.dims
    dt = mx_dtype(d["dtype"])
    return {"y": mx.zeros((0, d["channels"]), dt), "states": mx.zeros((0, d["L"] - 1, d["channels"]), dt)}


def _kept_states(model, tail, gated, shift: int = 0):
    """The state keep(r + 1) commits, for each row r: the family's commit on a fresh cache per row."""
    import mlx.core as mx

    states = []
    for r in range(gated.shape[1]):
        cache, _ = _cache(model, tail, gated)
        cache.commit(r + 1 - shift)
        states.append(cache.conv[0][0])
    return mx.stack(states)


def mlx_conv(case):
    """What ShortConv computes: conv(cache.conv_input(slot, gated)) over the window, and keep()'s state per row."""
    if case.rows == 0:
        return _empty(case)
    model, conv, tail, gated = _family(case)
    _, inputs = _cache(model, tail, gated)
    return {"y": conv(inputs)[0], "states": _kept_states(model, tail, gated)}


def _taps(case, order, acc_dtype=None, last=None):
    """Planted variants' composed conv: taps summed in `order` (in acc_dtype), the bias, keep()'s states."""
    import mlx.core as mx

    d = case.dims
    dt = mx_dtype(d["dtype"])
    model, _, tail, gated = _family(case)
    _, inputs = _cache(model, tail, gated)
    seq = inputs[0].astype(acc_dtype or mx.float32)
    w = case.array("w", dt).astype(acc_dtype or mx.float32)
    k = case.rows
    acc = None
    for j in order:
        term = w[:, j] * seq[j:j + k]
        acc = term if acc is None else acc + term
    if d["bias"]:
        acc = acc + case.array("bias", dt).astype(acc.dtype)
    return {"y": acc.astype(dt), "states": _kept_states(model, tail, gated)}


def dropped_last_tap(case):
    """Planted: the newest input (tap L-1, the row's own B·x) is never read."""
    return _taps(case, range(case.dims["L"] - 1))


def fp16_accumulator(case):
    """Planted: the taps summed in fp16."""
    import mlx.core as mx

    return _taps(case, range(case.dims["L"]), mx.float16)


def order_when_many(case):
    """Planted: the taps summed newest first when the window has more than one row (oldest first otherwise)."""
    L = case.dims["L"]
    return _taps(case, range(L - 1, -1, -1) if case.rows > 1 else range(L))


def state_shifted(case):
    """Planted: keep(r + 1) commits the state one row early (the tail as it was before row r)."""
    if case.rows == 0:
        return _empty(case)
    model, conv, tail, gated = _family(case)
    _, inputs = _cache(model, tail, gated)
    return {"y": conv(inputs)[0], "states": _kept_states(model, tail, gated, shift=1)}


# --- cuda / metal ----------------------------------------------------------------------------------------------------


def _inputs(case):
    import mlx.core as mx

    d = case.dims
    dt = mx_dtype(d["dtype"])
    w = case.array("w", dt)
    bias = case.array("bias", dt) if d["bias"] else w  # not read without a bias (HAS_BIAS is false)
    tails = case.array("tails", dt)  # every row's tail (a case), or the stream's one tail (a served call)
    return [tails if tails.ndim == 2 else mx.contiguous(tails[0]), case.array("bx", dt), w, bias,
            int_array([case.rows, d["channels"]])]


def _launch(case):
    d = case.dims
    dt = mx_dtype(d["dtype"])
    return Launch(grid=(groups(case.rows * d["channels"], THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((case.rows, d["channels"]), (case.rows, d["L"] - 1, d["channels"])),
                  output_dtypes=(dt, dt), template=(("T", dt), ("L", d["L"]), ("HAS_BIAS", bool(d["bias"]))))


def source(kind: str) -> Source:
    return Source("lfm2_conv", ("tail", "bx", "w", "bias", "dims"), ("y", "states"), CUDA if kind == "cuda" else METAL,
                  inputs=_inputs, launch=_launch)


def _shape(label, C, L=3, dtype="bfloat16", rows=WIDEST, bias=False):
    return Shape(label, {"channels": C, "L": L, "dtype": dtype, "bias": bias}, rows)


SERVED = tuple(_shape(f"{name} {dtype}", dims["hidden"], dims["conv_L"], dtype)
               for name, dims in (("tiny-lfm2", TINY_LFM2), ("LFM2-1.2B", LFM2_1B)) for dtype in DTYPES)

# planted in the cuda text, which the streams conv shares line for line (conv_streams.py)
CUDA_DROPPED_LAST_TAP = swap("for (int j = 0; j < L; ++j)", "for (int j = 0; j < L - 1; ++j)")
CUDA_TAP_ORDER_WHEN_MANY = swap("for (int j = 0; j < L; ++j) {",
                                "for (int jj = 0; jj < L; ++jj) {\n  const int j = rows > 1 ? L - 1 - jj : jj;")

RECORD = KernelRecord(
    name="lfm2 stream conv",
    family="lfm2",
    description="depthwise causal conv over a window, y[r] = sum_j w[:, j] * [tail; bx][r + j] (+ bias), with the "
                "state keep(r + 1) commits for every row r",
    make=make,
    reference=reference,
    implementations={"mlx": mlx_conv, "cuda": source("cuda"), "metal": source("metal")},
    shapes=SERVED,
    edges=(
        _shape("1 row", TINY_LFM2["hidden"], rows=1),
        _shape("widest window fp32", LFM2_1B["hidden"], dtype="float32", rows=WIDEST),
        _shape("C=100, off the group", 100, dtype="float32", rows=5),
        _shape("L=2, bias", 64, L=2, dtype="float32", rows=7, bias=True),
        _shape("L=4, bias bf16", 96, L=4, rows=9, bias=True),
        _shape("empty", TINY_LFM2["hidden"], rows=0),
    ),
    tolerance=tolerance,
    row_inputs=("tails", "bx"),
    controls=(
        Control("state one row early", "mlx", 2, variant(state_shifted)),
        Control("dropped last tap", "mlx", 2, variant(dropped_last_tap)),
        Control("fp16 accumulator", "mlx", 2, variant(fp16_accumulator)),
        Control("row-count-dependent tap order", "mlx", 4, variant(order_when_many)),
        Control("state one row early", "cuda", 2, swap("const int t = r + 1 + q;", "const int t = r + q;")),
        Control("dropped last tap", "cuda", 2, CUDA_DROPPED_LAST_TAP),
        Control("row-count-dependent tap order", "cuda", 4, CUDA_TAP_ORDER_WHEN_MANY),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
