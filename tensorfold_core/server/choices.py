"""A request's choices: n (or best_of) generations run side by side, merged into one reply or one stream."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from .generation import Generation, Step


def merged_usage(usages: list[dict]) -> dict:
    """The request's usage: the prompt counted once (its streams read it once), completions and rounds summed."""
    first = usages[0]
    completion = sum(u.get("completion_tokens", 0) for u in usages)
    rounds = {key: sum((u.get("tensorfold") or {}).get(key, 0) for u in usages)
              for key in ("rounds", "drafted", "accepted")}
    return {**first, "completion_tokens": completion, "total_tokens": first.get("prompt_tokens", 0) + completion,
            "tensorfold": rounds}


def cumulative_logprob(step: Step) -> float:
    return sum(entry.logprob for entry in step.logprobs)


class Choices:
    """Several generations of one request; `steps()` and `collect()` speak for all of them, `cancel()` ends all."""

    def __init__(self, generations: list[Generation], shown: int):
        self.generations = generations
        self.shown = shown  # best_of runs more than it shows: the `shown` best by cumulative logprob

    def start(self, prompt_param: str) -> None:
        try:
            for generation in self.generations:
                generation.start(prompt_param)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for generation in self.generations:
            generation.cancel()

    async def steps(self) -> AsyncIterator[Step]:
        """Every choice's steps as they land; only the very last step carries usage (the request's, merged)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(generation: Generation) -> None:
            try:
                async for step in generation.steps():
                    await queue.put(step)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put(exc)
            await queue.put(generation)  # this choice is done

        tasks = [asyncio.ensure_future(pump(g)) for g in self.generations]
        usages, left, held = [], len(tasks), None
        try:
            while left:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Generation):
                    left -= 1
                    continue
                if item.usage is not None:
                    usages.append(item.usage)
                    item.usage = None
                if held is not None:
                    yield held
                held = item
            held.usage = merged_usage(usages)
            yield held
        finally:
            for task in tasks:
                task.cancel()
            self.cancel()

    async def collect(self) -> tuple[list[Step], dict]:
        """Every choice to its end: the ones shown, indexed 0.., best first where best_of chose; and the usage."""
        try:
            done = list(await asyncio.gather(*(g.collect() for g in self.generations)))
        finally:
            self.cancel()
        usage = merged_usage([step.usage for step in done])
        if self.shown < len(done):
            done = sorted(done, key=lambda step: (-cumulative_logprob(step), step.index))[:self.shown]
            for index, step in enumerate(done):
                step.index = index
        return done, usage
