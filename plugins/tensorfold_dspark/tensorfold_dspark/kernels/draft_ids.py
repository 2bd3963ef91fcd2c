"""The verify's draft ids under contract: each stream's pending token, then its first picks, written into the ids."""

# A row of this record is a stream: its window's start in the verify's ids, its pending token, its picks [depth] and
# how many of them the verify takes. The output is what the verify then reads from each window's start, depth + 1
# rows: make lays a window short of depth before rows of the host's (other streams' windows), so those rows are the
# stream's own to check, and a write past its count shows there; full windows meet their neighbours.

from __future__ import annotations

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, oversize_threadgroup, swap, variant
from tensorfold_contract.helpers import WIDEST, groups, int_array

from . import block_attention, markov
from .draft_ids_sources import CUDA, METAL

THREADS = 256
TINY = dict(vocab=8192, depth=block_attention.TINY["block"])  # the shipped tiny-lfm2-moe pair
LFM2_24B = dict(vocab=markov.LFM2_24B["vocab"], depth=block_attention.LFM2_24B["block"])  # LiquidAI's drafter
SPARE = 2  # host rows a window may be followed by past its depth + 1, and before the first
UNBOUNDED = 2 ** 31 - 1  # a vocabulary bound no int32 pick passes


def make(dims, rows, rng):
    """Streams by r % 5: full; short, with a pick past the vocabulary; short, with a NaN flag; none; full, then full."""
    V, D = dims["vocab"], dims["depth"]
    picks = rng.integers(0, V, (rows, D))
    counts = np.zeros(rows, np.int64)
    starts = np.zeros(rows, np.int64)
    at = int(rng.integers(0, SPARE + 1))
    for r in range(rows):
        kind = r % 5
        short = int(rng.integers(1, D)) if D > 1 else D
        counts[r] = {0: D, 1: short, 2: short, 3: 0, 4: D}[kind]
        if kind in (1, 2):
            bad = (V, V + 1 + int(rng.integers(0, 2 ** 20)), UNBOUNDED) if kind == 1 else (-1, -2 ** 31)
            picks[r, rng.integers(0, counts[r])] = bad[int(rng.integers(0, len(bad)))]
        starts[r] = at
        at += D + 1 + (0 if kind == 4 else int(rng.integers(0, SPARE + 1)))
    if at > dims["verify"]:
        raise ValueError(f"{rows} streams of depth {D} need {at} verify rows, the shape holds {dims['verify']}")
    return {"ids": rng.integers(0, V, dims["verify"]).astype(np.uint32), "starts": starts.astype(np.int32),
            "pending": rng.integers(0, V, rows).astype(np.int32), "picks": picks.astype(np.int32),
            "counts": counts.astype(np.int32)}


def reference(case):
    V, D = case.dims["vocab"], case.dims["depth"]
    packed = case["ids"].astype(np.int64)
    for s in range(case.rows):
        start, n = int(case["starts"][s]), int(case["counts"][s])
        picks = case["picks"][s, :n].astype(np.int64)
        packed[start:start + n + 1] = [int(case["pending"][s]), *np.where((picks < 0) | (picks >= V), 0, picks)]
    return {"ids": packed[case["starts"].astype(np.int64)[:, None] + np.arange(D + 1)]}


def windows(packed, starts, depth: int) -> dict:
    """The record's output: the depth + 1 rows of the verify's ids from each stream's window start."""
    import mlx.core as mx

    return {"ids": packed[starts[:, None] + mx.arange(depth + 1)[None]]}


# --- mlx: composed ops ------------------------------------------------------------------------------------------------


def draft_ids(ids, starts, pending, picks, counts, vocab: int):
    """`ids` with each window (pending token, count picks, 0 off the vocabulary) at its start; nothing serves it yet."""
    # the drafter reads its drafts back to the host before the verify: this waits on one that keeps them on the device
    import mlx.core as mx

    streams, depth = picks.shape
    if streams == 0:
        return ids
    verify = ids.shape[0]
    slot = mx.arange(depth + 1)[None]
    tokens = mx.concatenate([pending[:, None], mx.where((picks < 0) | (picks >= vocab), 0, picks)], axis=1)
    # a slot past its window's count goes to a spare row past the end, dropped after: no window writes another's
    rows = mx.where(slot <= counts[:, None], starts[:, None] + slot, verify)
    out = mx.concatenate([ids, mx.zeros((1,), ids.dtype)])
    out[rows.reshape(-1)] = tokens.reshape(-1).astype(ids.dtype)
    return out[:verify]


def _call(case, starts=None, picks=None, counts=None, vocab=None):
    """draft_ids on the case, read at the case's own window starts (a planted defect changes one argument)."""
    own = case.array("starts")
    packed = draft_ids(case.array("ids"), own if starts is None else starts, case.array("pending"),
                       case.array("picks") if picks is None else picks,
                       case.array("counts") if counts is None else counts,
                       case.dims["vocab"] if vocab is None else vocab)
    return windows(packed, own, case.dims["depth"])


def mlx_draft_ids(case):
    return _call(case)


def start_off_by_one(case):
    """Planted: each window written one row past its start."""
    return _call(case, starts=case.array("starts") + 1)


def out_of_vocabulary_copied(case):
    """Planted: only a negative pick is cleaned; one past the vocabulary is copied as is."""
    return _call(case, vocab=UNBOUNDED)


def picks_of_the_next_stream(case):
    """Planted: each stream's window takes the next stream's picks (the last its own)."""
    import mlx.core as mx

    picks = case.array("picks")
    return _call(case, picks=mx.concatenate([picks[1:], picks[-1:]]) if case.rows > 1 else picks)


def counts_ignored(case):
    """Planted: every window takes all depth picks."""
    import mlx.core as mx

    return _call(case, counts=mx.full((case.rows,), case.dims["depth"], mx.int32))


# --- cuda, metal: draft_ids_sources -----------------------------------------------------------------------------------


def _inputs(case):
    d = case.dims
    return [case.array("ids"), case.array("starts"), case.array("pending"), case.array("picks"), case.array("counts"),
            int_array([case.rows, d["verify"], d["depth"], d["vocab"]])]


def _launch(case):
    import mlx.core as mx

    verify = case.dims["verify"]
    # an empty call launches nothing: no window to write, and its output (a view of no stream) is empty
    return Launch(grid=(groups(verify, THREADS) * THREADS if case.rows else 0, 1, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((verify,),), output_dtypes=(mx.uint32,))


def source(kind: str) -> Source:
    return Source("dspark_draft_ids", ("ids", "starts", "pending", "picks", "counts", "dims"), ("out",),
                  CUDA if kind == "cuda" else METAL, inputs=_inputs, launch=_launch,
                  finish=lambda outs, case: windows(outs[0], case.array("starts"), case.dims["depth"]))


# The sources' planted defects (the lines both sources share)
START_OFF_BY_ONE = swap("const int j = p - starts[s];", "const int j = p - starts[s] - 1;")
OUT_OF_VOCABULARY_COPIED = swap("(pick < 0 || pick >= vocab)", "pick < 0")
COUNTS_IGNORED = swap("j <= counts[s]", "j <= depth")


def shape(label: str, model: dict, rows: int = WIDEST) -> Shape:
    """`rows` streams of a model's vocabulary and block in a verify with room for WIDEST of them (or `rows`)."""
    verify = SPARE + (model["depth"] + 1 + SPARE) * max(rows, WIDEST)
    return Shape(label, {**model, "verify": verify}, rows)


RECORD = KernelRecord(
    name="dspark draft ids",
    family="dspark",
    description="the verify's ids with each stream's window written from the drafter's picks: its pending token at "
                "its start, then its first count picks, a pick past the vocabulary or negative (a NaN row) as 0",
    make=make,
    reference=reference,
    implementations={"mlx": mlx_draft_ids, "cuda": source("cuda"), "metal": source("metal")},
    shapes=(shape("tiny pair, 16 streams", TINY), shape("tiny pair, 5 streams", TINY, 5),
            shape("LFM2.5-24B-A2B drafter, 16 streams", LFM2_24B)),
    edges=(shape("1 stream", TINY, 1), shape("a block of one", {**TINY, "depth": 1}, 7),
           shape("32 streams", LFM2_24B, 32), shape("empty", TINY, 0)),
    row_inputs=("starts", "pending", "picks", "counts"),
    controls=(
        Control("off-by-one window start", "mlx", 2, variant(start_off_by_one)),
        Control("an out-of-vocabulary pick copied as is", "mlx", 2, variant(out_of_vocabulary_copied)),
        Control("picks of the next stream", "mlx", 2, variant(picks_of_the_next_stream)),
        Control("counts ignored", "mlx", 2, variant(counts_ignored)),
        Control("off-by-one window start", "cuda", 2, START_OFF_BY_ONE),
        Control("an out-of-vocabulary pick copied as is", "cuda", 2, OUT_OF_VOCABULARY_COPIED),
        Control("picks of the next stream", "cuda", 2,
                swap("picks[(size_t)s * depth", "picks[(size_t)min(s + 1, streams - 1) * depth")),
        Control("counts ignored", "cuda", 2, COUNTS_IGNORED),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("off-by-one window start", "metal", 2, START_OFF_BY_ONE),
        Control("an out-of-vocabulary pick copied as is", "metal", 2, OUT_OF_VOCABULARY_COPIED),
        Control("picks of the next stream", "metal", 2,
                swap("picks[(ulong)s * depth", "picks[(ulong)metal::min(s + 1, streams - 1) * depth")),
        Control("counts ignored", "metal", 2, COUNTS_IGNORED),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
