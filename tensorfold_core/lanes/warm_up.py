"""Throwaway requests through a throwaway engine at load, where the backend builds its kernels at first use."""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import cast

import mlx.core as mx

from ..protocols import Drafter, HoldPricedDrafter, Model
from ..sampling import SamplingParams
from .engine import Engine
from .stream import Stream
from .types import ErrorEvent, GenerationRequest

# "1": warm up on any backend, "0": on none; unset: on a GPU, where a fresh server's first long prompt and first
# drafted reply otherwise pay the kernels' builds (docs/gpu.md)
WARM_UP_ENV = "TENSORFOLD_WARM_UP"
PERIOD = 24  # the long prompt repeats a stretch this long, so its copies draft and the verify's windows build too
REPLY_TOKENS = 16
STREAM_IDS = -1000  # counting down: ids no host hands out, nor a drafter's own warm-up (-1 down)
MOST_ROUNDS = 1000  # a warm-up that has not ended by then is cut: it only ever saves later requests time
SEEDED = SamplingParams(temperature=0.8, seed=0)  # the keyed draw's kernels build too
# a family's whole forward is traced the second time a shape is met (KeyCompiled's `after`): the second pass traces
PASSES = 2


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up ran: its seconds, rounds, and windows drafted by who drafted them (copy, the drafter's name)."""

    seconds: float
    rounds: int
    drafted: dict[str, int]

    def __str__(self) -> str:
        drafted = ", ".join(f"{n} by {source}" for source, n in sorted(self.drafted.items())) or "none"
        return f"{self.seconds:.1f} s, {self.rounds} rounds, windows drafted: {drafted}"


def warms_up() -> bool:
    """Whether a server warms up at load here: on a GPU, unless TENSORFOLD_WARM_UP says."""
    wanted = os.environ.get(WARM_UP_ENV, "")
    if wanted in ("0", "1"):
        return wanted == "1"
    return mx.default_device().type == mx.DeviceType.gpu


def warm_up_prompts(prefill_chunk: int, vocab_size: int, context: int) -> list[list[int]]:
    """A greedy prompt of a full chunk and a part of one, and a short seeded one that shares its rounds."""
    span = max(min(vocab_size - 1, 1000), 1)
    stretch = [1 + (17 * i) % span for i in range(PERIOD)]
    length = max(min(prefill_chunk + PERIOD, context - REPLY_TOKENS - 1), 1)
    long = (stretch * (length // PERIOD + 1))[:length]
    return [long, stretch[:max(min(PERIOD // 3, length), 1)]]


def warm_up(model: Model, *, prefill_chunk: int, context: int, shared_rounds: bool, drafter: Drafter | None,
            passes: int = PASSES) -> WarmUp:
    """Serve the warm-up prompts `passes` times, each on a throwaway engine (untimed, so no guard learns a cold round,
    and with nowhere to keep a state) and from fresh drafter slots, so every pass meets the same shapes; then re-time
    the drafter's holds its cold ones moved."""
    start = time.perf_counter()
    rounds, drafted = 0, Counter()
    for _ in range(passes):
        engine = Engine(model, prefill_chunk=prefill_chunk, shared_rounds=shared_rounds, drafter=drafter)
        serve_once(engine, warm_up_prompts(prefill_chunk, model.vocab_size, context))
        rounds += engine.rounds
        drafted.update({source: counts[0] for source, counts in engine.counters.by_source.items()})
    if drafter is not None and drafter.facts.hold_costs:
        cast(HoldPricedDrafter, drafter).time_holds()
    return WarmUp(time.perf_counter() - start, rounds, dict(drafted))


def serve_once(engine: Engine, prompts: list[list[int]]) -> None:
    """The prompts through the engine to their ends, greedy and seeded; the drafter's slots they used freed after,
    a failed round's too; raises where a request failed."""
    failures: list[BaseException] = []

    def on_event(event) -> None:
        if isinstance(event, ErrorEvent):
            failures.append(event.error)

    model, drafter = engine.model, engine.drafter
    try:
        for i, (prompt, sampling) in enumerate(zip(prompts, (SamplingParams(), SEEDED))):
            request = GenerationRequest(prompt_ids=prompt, max_tokens=REPLY_TOKENS, sampling=sampling)
            limit = len(prompt) + REPLY_TOKENS
            engine.add(Stream(id=STREAM_IDS - i, request=request, cache=model.new_cache(limit), on_event=on_event,
                              limit=limit))
        while not engine.idle() and engine.rounds < MOST_ROUNDS:
            if not engine.round():
                break
        for stream_id in list(engine.streams):
            engine.cancel(stream_id)
        engine.round()  # the cancelled leave
    finally:
        if drafter is not None:  # a round that raised left its streams' slots: no one else frees them
            for i in range(len(prompts)):
                drafter.release(STREAM_IDS - i)
            drafter.shed_kept()  # the released slots: bytes no admission counted, and a next pass starts afresh
    if failures:
        raise RuntimeError(f"the warm-up's request failed: {failures[0]}") from failures[0]
