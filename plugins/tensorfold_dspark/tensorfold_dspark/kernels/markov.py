"""The DSpark drafter's Markov pick under contract: each draft row's argmax after W2 W1[previous] on 8-bit codes."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import Control, Finding, KernelRecord, Launch, Shape, Source, oversize_threadgroup, swap, \
    variant
from tensorfold_contract.helpers import WIDEST, int_array, mx_dtype, rounded

from .markov_sources import CUDA, HEADER, METAL

BITS = 8
THREADS = 1024  # one block a row: its threads stream the whole vocab, so a row gets all of one SM
TINY = dict(vocab=384, rank=64)  # the tests' tiny drafter
LFM2_24B = dict(vocab=128000, rank=256)  # LiquidAI's LFM2.5-24B-A2B drafter
TIE = (2, 3)  # ids whose W2 rows are one row, so a tie between them can be planted


def _packed(w: np.ndarray, group: int, dtype: str) -> dict[str, np.ndarray]:
    """8-bit MLX affine codes of a float matrix: codes packed four to a uint32, scales and biases in `dtype`."""
    g = w.reshape(w.shape[0], -1, group)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    scales = rounded(np.maximum(hi - lo, 1e-6) / (2 ** BITS - 1), dtype).astype(np.float32)
    biases = rounded(lo, dtype).astype(np.float32)
    codes = np.clip(np.rint((g - biases[..., None]) / scales[..., None]), 0, 2 ** BITS - 1).astype(np.uint8)
    return {"codes": np.ascontiguousarray(codes.reshape(w.shape)).view(np.uint32), "scales": scales, "biases": biases}


def _unpacked(host: dict, dims, name: str) -> np.ndarray:
    """The float64 matrix a packed input stands for: codes * scale + bias, rounded to the dtype."""
    codes = host[f"{name}_codes"].view(np.uint8).astype(np.float64)
    rows, width = codes.shape
    g = codes.reshape(rows, -1, dims["group"])
    w = g * host[f"{name}_scales"][..., None].astype(np.float64) + host[f"{name}_biases"][..., None]
    return rounded(w.reshape(rows, width), dims["dtype"]).astype(np.float64)


def _markov(host: dict, dims) -> np.ndarray:
    """W2 W1[previous] per row in float64, rounded to the dtype (the quantized product's output)."""
    w1, w2 = _unpacked(host, dims, "w1"), _unpacked(host, dims, "w2")
    return rounded(w1[host["previous"]] @ w2.T, dims["dtype"]).astype(np.float64)


def make(dims, rows, rng):
    """Inputs whose picks are well posed: a tie planted (ids 2 and 3) every fourth row; elsewhere a best score clear
    of every other by far more than the products' rounding, and every fourth row a NaN logit beside it."""
    V, R, dtype = dims["vocab"], dims["rank"], dims["dtype"]
    w1, w2 = rng.standard_normal((V, R)) * 0.5, rng.standard_normal((V, R)) * 0.5
    w2[TIE[1]] = w2[TIE[0]]
    host = {f"w1_{k}": v for k, v in _packed(w1, dims["group"], dtype).items()}
    host.update({f"w2_{k}": v for k, v in _packed(w2, dims["group"], dtype).items()})
    host["previous"] = rng.integers(0, V, rows).astype(np.uint32)
    host["logits"] = (rng.standard_normal((rows, V)) * 4).astype(np.float32)
    markov = _markov(host, dims)
    gap = 1e-3 + 256 * np.abs(markov).max(initial=0) * (2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -23)
    for r in range(rows):
        x = host["logits"][r].astype(np.float64)
        scores = x + markov[r]
        if r % 4 == 1:  # both tied ids one clear step above every other score
            x[list(TIE)] = np.max(np.delete(scores, TIE)) + 1.0 - markov[r, TIE[0]]
        else:
            top, others = int(np.argmax(scores)), np.arange(V) != int(np.argmax(scores))
            x[others] = np.minimum(x[others], scores[top] - markov[r, others] - gap)
            if r % 4 == 2 and V > 1:
                x[(top + 1 + rng.integers(0, V - 1)) % V] = np.nan
        host["logits"][r] = x.astype(np.float32)
    return host


def reference(case):
    if case.rows == 0:
        return {"ids": np.zeros((0,), np.int64), "flags": np.zeros((0,), np.int64)}
    scores = case["logits"].astype(np.float64) + _markov(case.host, case.dims)
    nan = np.isnan(scores)
    return {"ids": np.argmax(np.where(nan, -np.inf, scores), axis=-1).astype(np.int64),
            "flags": nan.any(axis=-1).astype(np.int64)}


# --- mlx: the drafter's own pick (model.markov_pick) on a Markov head holding the case's codes -------------------------


def _head(case):
    import mlx.core as mx
    import mlx.nn as nn

    from ..model import MarkovHead

    d, dt = case.dims, mx_dtype(case.dims["dtype"])
    head = MarkovHead(d["vocab"], d["rank"])
    head.markov_w1 = nn.QuantizedEmbedding(d["vocab"], d["rank"], d["group"], BITS)
    head.markov_w2 = nn.QuantizedLinear(d["rank"], d["vocab"], False, d["group"], BITS)
    for module, name in ((head.markov_w1, "w1"), (head.markov_w2, "w2")):
        module.weight = case.array(f"{name}_codes")
        module.scales, module.biases = case.array(f"{name}_scales", dt), case.array(f"{name}_biases", dt)
    return head


def _picked(case, previous=None, markov=True, pick=None):
    import mlx.core as mx

    from ..model import markov_pick

    if case.rows == 0:
        return {"ids": mx.zeros((0,), mx.int32), "flags": mx.zeros((0,), mx.int32)}
    head = _head(case) if markov else (lambda p: mx.zeros((p.shape[0], case.dims["vocab"]), mx.float32))
    previous = case.array("previous") if previous is None else previous
    ids, flags = (pick or markov_pick)(case.array("logits"), head, previous)
    return {"ids": ids.astype(mx.int32), "flags": flags.astype(mx.int32)}


def mlx_pick(case):
    return _picked(case)


def ties_to_highest(case):
    """Planted: a tie goes to the highest id."""
    import mlx.core as mx

    def pick(logits, head, previous):
        scores = logits + head(previous)
        nan = mx.isnan(scores)
        flipped = mx.where(nan, -mx.inf, scores)[:, ::-1]
        return scores.shape[-1] - 1 - mx.argmax(flipped, axis=-1), mx.any(nan, axis=-1)

    return _picked(case, pick=pick)


def nan_wins(case):
    """Planted: a NaN score is not set aside."""
    import mlx.core as mx

    def pick(logits, head, previous):
        scores = logits + head(previous)
        return mx.argmax(scores, axis=-1), mx.any(mx.isnan(scores), axis=-1)

    return _picked(case, pick=pick)


def previous_of_the_next_row(case):
    """Planted: each row reads W1 of the next row's previous token."""
    import mlx.core as mx

    previous = case.array("previous")
    return _picked(case, previous=mx.concatenate([previous[1:], previous[-1:]]) if case.rows > 1 else previous)


def markov_dropped(case):
    """Planted: the Markov term never reaches the scores."""
    return _picked(case, markov=False)


# --- cuda / metal: one block a row (markov_sources.py) -----------------------------------------------------------------


def _team(rank: int) -> int:
    """Lanes sharing one vocab entry's dot product: one 16-code chunk each, up to 16."""
    # a function of the rank alone, so each sum's order is too
    return min(16, 1 << max(0, rank // 16 - 1).bit_length())


def _inputs(case):
    dt = mx_dtype(case.dims["dtype"])
    packed = [case.array(f"{name}_codes") if part == "codes" else case.array(f"{name}_{part}", dt)
              for name in ("w1", "w2") for part in ("codes", "scales", "biases")]
    return [case.array("logits"), case.array("previous"), *packed, int_array([case.rows, case.dims["vocab"]])]


def _launch(case):
    import mlx.core as mx

    rank, group = case.dims["rank"], case.dims["group"]
    if rank % 16 or group % 16 or rank % group:
        raise ValueError(f"rank {rank}, group {group}: the kernels read 16-code chunks that lie within one group")
    return Launch(grid=(case.rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((case.rows,), (case.rows,)), output_dtypes=(mx.int32, mx.int32),
                  template=(("RANK", rank), ("GROUP", group), ("TEAM", _team(rank)),
                            ("T", mx_dtype(case.dims["dtype"]))),
                  static_shared=3 * 32 * 4)  # each warp's best score, id and NaN flag


def source(kind: str) -> Source:
    names = ("logits", "previous", "w1_codes", "w1_scales", "w1_biases", "w2_codes", "w2_scales", "w2_biases",
             "dims")
    return Source("dspark_markov_pick", names, ("ids", "flags"), CUDA if kind == "cuda" else METAL,
                  inputs=_inputs, launch=_launch, header=HEADER)


# A tie flipped to the highest id once the call holds more than one row: a fold whose order follows the row count
# shows only where two scores tie exactly (make's gaps keep every other pick clear of any fp32 order)
TIES_BY_ROW_COUNT = swap("(i) < (bi)", "(rows > 1 ? (i) > (bi) : (i) < (bi))", where="header")


def _shape(label, vocab, rank, dtype="float32", rows=WIDEST, group=64, heavy=False):
    return Shape(label, {"vocab": vocab, "rank": rank, "dtype": dtype, "group": group}, rows, heavy=heavy)


# Seen on the H200 (contract/receipts/h200-2026-12-01-lfm2): picks off the float64 one on near ties (gate 2) and
# rows that depend on the call's row count (gate 4). A draft that differs costs acceptance, never a reply's ids:
# the target verifies every draft. The cuda implementation sums each row in one fixed order, whatever the row count.
ON_CUDA = tuple(Finding("MLX's CUDA matmul is TF32-like and not row-invariant, and the mlx implementation is composed "
                        "of it: on CUDA a draft may differ from the float64 pick (the target still verifies it)",
                        kind="mlx", gate=gate, backend="cuda", mlx="0.32.4") for gate in (2, 4))

RECORD = KernelRecord(
    name="dspark markov pick",
    family="dspark",
    description="a draft row's token: the first largest of logits + W2 W1[previous token] over 8-bit affine codes "
                "(ties to the lowest id, NaN never wins and flags the row)",
    make=make,
    reference=reference,
    implementations={"mlx": mlx_pick, "cuda": source("cuda"), "metal": source("metal")},
    shapes=(_shape("tiny drafter", **TINY), _shape("tiny drafter bf16", **TINY, dtype="bfloat16"),
            _shape("LFM2.5-24B-A2B drafter bf16", **LFM2_24B, dtype="bfloat16", heavy=True)),
    edges=(_shape("1 row", **TINY, rows=1), _shape("rank 96, group 32", 1000, 96, group=32, rows=7),
           _shape("empty", **TINY, rows=0)),
    row_inputs=("logits", "previous"),
    findings=ON_CUDA,
    controls=(
        Control("ties to the highest id", "mlx", 2, variant(ties_to_highest)),
        Control("NaN wins", "mlx", 2, variant(nan_wins)),
        Control("W1 of the next row's token", "mlx", 2, variant(previous_of_the_next_row)),
        Control("Markov term dropped", "mlx", 2, variant(markov_dropped)),
        Control("ties to the highest id", "cuda", 2, swap("(i) < (bi)", "(i) > (bi)", where="header")),
        Control("NaN rows not flagged", "cuda", 2, swap("hasnan = 1;", "hasnan = 0;")),
        Control("W1 of the next row's token", "cuda", 2, swap("previous[row]", "previous[min(row + 1, rows - 1)]")),
        Control("row-count-dependent tie order in the fold", "cuda", 4, TIES_BY_ROW_COUNT),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
