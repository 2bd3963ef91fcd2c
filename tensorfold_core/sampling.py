"""Keyed draws: each token a fixed function of (seed, absolute position, logits), so drafts never change replies."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
# below it a draw is greedy: logits divided by a temperature near 5e-324 overflow float64 to inf - inf = NaN
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How a stream draws: greedy at temperature 0 (or below GREEDY_BELOW), else filtered keyed Gumbel-max."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def seed_from_prompt(token_ids) -> int:
    """A request without a seed gets one derived from its prompt, so it repeats exactly."""
    data = np.asarray(token_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.sha256(b"tensorfold-seed" + data).digest()[:8], "little")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A counter-based mixer: uniform 64-bit output from any 64-bit input."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return x ^ (x >> np.uint64(31))


def keyed_gumbel(seed: int, position: int, token_ids: np.ndarray) -> np.ndarray:
    """Gumbel noise g(seed, position, token_id) in float64, independent of everything else."""
    with np.errstate(over="ignore"):
        key = _splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) ^ _splitmix64(np.uint64(position)))
        bits = _splitmix64(key ^ (token_ids.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03)))
    # 53 random bits -> uniform in (0, 1), never exactly 0 or 1
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    return -np.log(-np.log(uniform))


def filtered_logprobs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Temperature, top_k, top_p and min_p applied in float64; removed tokens get -inf."""
    scaled = logits.astype(np.float64) / params.temperature
    scaled = np.where(np.isnan(scaled), -np.inf, scaled)
    if params.top_k and 0 < params.top_k < scaled.shape[-1]:
        # ties at the cut keep the lower ids: a stable sort on -logit orders equal logits by id
        order = np.argsort(-scaled, kind="stable")
        keep = np.zeros(scaled.shape, dtype=bool)
        keep[order[: params.top_k]] = True
        scaled = np.where(keep, scaled, -np.inf)
    logprobs = scaled - np.logaddexp.reduce(scaled)
    if params.top_p < 1.0:
        order = np.argsort(-logprobs, kind="stable")
        probs = np.exp(logprobs[order])
        before = np.cumsum(probs) - probs
        cut = np.zeros(scaled.shape, dtype=bool)
        cut[order] = before >= params.top_p
        logprobs = np.where(cut, -np.inf, logprobs)
    if params.min_p > 0.0:
        floor = np.max(logprobs) + np.log(params.min_p)
        logprobs = np.where(logprobs < floor, -np.inf, logprobs)
    return logprobs


def greedy_token(logits: np.ndarray) -> int:
    """Argmax with ties to the lowest id; a NaN never wins."""
    return draw_greedy(logits[None])[0]


def draw(logits: np.ndarray, params: SamplingParams, seed: int, position: int) -> int:
    """The token at absolute `position`: a pure function of its arguments."""
    if params.greedy:
        return greedy_token(logits)
    logprobs = filtered_logprobs(logits, params)
    scores = logprobs + keyed_gumbel(seed, position, np.arange(logits.shape[-1]))
    return int(np.argmax(scores))


def draw_rows(rows: np.ndarray, params: SamplingParams, seed: int, first_position: int) -> list[int]:
    """Draws for consecutive rows of one window, the first at `first_position`."""
    if params.greedy:
        return draw_greedy(rows)
    return [draw(row, params, seed, first_position + i) for i, row in enumerate(rows)]


def draw_greedy(rows: np.ndarray) -> list[int]:
    """Each row's argmax, ties to the lowest id, a NaN never winning: NumPy's argmax picks the first NaN where a row
    holds one, so only such rows pay for a copy without them (one pass over the vocabulary for the rest)."""
    picks = np.argmax(rows, axis=-1)
    out = [int(t) for t in picks]
    for i in np.flatnonzero(np.isnan(rows[np.arange(len(out)), picks])):
        out[i] = int(np.argmax(np.where(np.isnan(rows[i]), -np.inf, rows[i])))
    return out
