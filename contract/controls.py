"""Ways to plant a defect: a variant implementation, a source edit, a launch or output transform."""

from __future__ import annotations

import dataclasses
from typing import Callable

from .record import Implementation, Launch, Source


def variant(fn: Callable) -> Callable[[Implementation], Implementation]:
    """Plant a whole defective implementation in place of the record's."""
    return lambda impl: fn


def swap(old: str, new: str, count: int = 1, where: str = "body") -> Callable[[Implementation], Implementation]:
    """Plant an edit of a source's text; `old` must occur exactly `count` times, or the control cannot be planted."""

    def plant(impl: Implementation) -> Implementation:
        if not isinstance(impl, Source):
            raise TypeError("swap() plants into a cuda or metal Source")
        text = getattr(impl, where)
        found = text.count(old)
        if found != count:
            raise ValueError(f"{old!r} occurs {found} times in the {where} of {impl.name}, expected {count}")
        return dataclasses.replace(impl, **{where: text.replace(old, new)})

    return plant


def relaunch(change: Callable[[Launch], Launch]) -> Callable[[Implementation], Implementation]:
    """Plant a change of a source's launch (a grid one group short, an over-sized group)."""

    def plant(impl: Implementation) -> Implementation:
        if not isinstance(impl, Source):
            raise TypeError("relaunch() plants into a cuda or metal Source")
        return dataclasses.replace(impl, launch=lambda case: change(impl.launch(case)))

    return plant


def oversize_threadgroup(threads: int = 2048) -> Callable[[Implementation], Implementation]:
    """Plant a group of `threads` threads along x, past every device kind's 1024."""
    return relaunch(lambda launch: dataclasses.replace(
        launch, threadgroup=(threads, 1, 1), grid=(max(launch.grid[0], threads), *launch.grid[1:])))


def transform_outputs(fn: Callable[[dict], dict]) -> Callable[[Implementation], Implementation]:
    """Plant a transform of an mlx implementation's outputs (e.g. rows shifted by one)."""

    def plant(impl: Implementation) -> Implementation:
        if isinstance(impl, Source):
            return dataclasses.replace(impl, finish=lambda outs, case: fn(impl.outputs(outs, case)))
        return lambda case: fn(impl(case))

    return plant


def shift_rows(outs: dict) -> dict:
    """Row i gets row i+1's result (the last keeps its own): an off-by-one row."""
    import mlx.core as mx

    def shift(a):
        return a if a.shape[0] < 2 else mx.concatenate([a[1:], a[-1:]])

    return {k: shift(v) for k, v in outs.items()}
