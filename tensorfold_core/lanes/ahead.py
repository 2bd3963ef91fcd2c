"""Running ahead of the host's read: a plain greedy round queues its next step on the device's argmax while the host
reads its logits (Lookahead), and a verify's acceptance made on the device for the holds queued behind it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..protocols import can_keep_later

# TENSORFOLD_LOOKAHEAD=0 runs every round in step (to measure what the overlap gives)
LOOKAHEAD_ENV = "TENSORFOLD_LOOKAHEAD"
# "0": every round reads its logits rows to the host and draws there, greedy rows too (to measure); by default a round
# whose every drawing row is plain greedy reads only its ids, argmaxed on the device (a 128k-id vocabulary's rows
# are 512 KB each)
DEVICE_GREEDY_ENV = "TENSORFOLD_DEVICE_GREEDY"


def greedy_ids(logits: mx.array) -> mx.array:
    """Each row's greedy draw on the device, as `sampling.draw_greedy`'s on the host: the first largest logit (ties to
    the lowest id), a NaN never winning. It is the `greedy argmax` record's mlx implementation, which the contract
    proves against its float64 reference, ties and NaN rows included."""
    return mx.argmax(mx.where(mx.isnan(logits), -mx.inf, logits), axis=-1)


def device_acceptance(drafts: mx.array, draws: mx.array) -> tuple[mx.array, mx.array]:
    """A window's verify on the device, as `accepted_prefix` on the host: the drafts equal to the draws from the first
    (int32), and the draw after them, the next pending token (uint32)."""
    depth = drafts.shape[0]
    if depth == 0:
        return mx.array(0, mx.int32), draws[0].astype(mx.uint32)
    same = (drafts.astype(mx.uint32) == draws[:depth].astype(mx.uint32)).astype(mx.int32)
    accepted = mx.sum(mx.cumprod(same)).astype(mx.int32)
    return accepted, mx.take(draws, accepted).astype(mx.uint32)


@dataclass
class Launched:
    """A next step queued on the device: its caches (each with the step's window open) and its logits."""

    caches: list
    tokens: mx.array  # the ids it runs: the device's argmax of the launching round's rows
    logits: mx.array
    ids: list[int] | None = None  # those ids on the host, once the launching round's own draws equalled them


class Lookahead:
    """Overlaps the host's half of a decode round with the device's: while the host reads round n's logits, draws,
    emits and plans, the device already runs round n + 1 on round n's argmax. The step is used only where round
    n + 1's plan is exactly that window for the same streams (one row each, no drafts, the host's greedy draws equal
    to the device's argmax); anything else closes its windows unkept, as a rejected draft's rows are, so a reply's
    ids are the ones a round in step gives."""

    def __init__(self, model, enabled: bool | None = None):
        self.model = model
        on = os.environ.get(LOOKAHEAD_ENV, "1") != "0" if enabled is None else enabled
        # a forward that reads its own arrays on the host (a served MoE's picks) waits there for the queued step, so
        # nothing would overlap; not yet run ahead on a GPU with one (docs/performance.md)
        self.on = on and can_keep_later(model) and not getattr(model, "reads_on_host", False)
        self.launched: Launched | None = None
        self.used = 0  # steps taken from the device as queued (tests and figures)
        self.closed = 0  # steps queued and then closed unkept (the next round was another, or a stream left)
        self.held = 0  # rounds that could have run ahead but did not, since a stream in them may draft next

    def eligible(self, turns: Sequence) -> bool:
        """Every window is one pending token that draws greedily, with no drafts, and the stream goes on after it."""
        return self.on and all(t.draws and not t.drafts and len(t.window) == 1 and t.stream.stage.plain
                               and t.stream.request.sampling.greedy and _goes_on(t.stream) for t in turns)

    def take(self, turns: Sequence) -> mx.array | None:
        """The queued logits where this round's windows are the queued step's; otherwise None, the step closed."""
        launched, self.launched = self.launched, None
        if launched is None:
            return None
        same = launched.ids is not None and len(turns) == len(launched.caches) and all(
            t.stream.cache is cache and t.window == [token] and t.draws and not t.drafts
            for t, cache, token in zip(turns, launched.caches, launched.ids))
        if same:
            self.used += 1
            return launched.logits
        self._close(launched)
        return None

    def launch(self, turns: Sequence, logits: mx.array, tokens: mx.array | None = None) -> mx.array:
        """Queue this round and its greedy ids (`tokens`, or made here), keep each window's one row, and queue the
        next step on those ids; returns them for `confirm` (the host's draws must equal them)."""
        tokens = greedy_ids(logits) if tokens is None else tokens
        caches = [t.stream.cache for t in turns]
        kept = [a for cache in caches for a in self.model.keep_later(cache, 1)]
        mx.async_eval(logits, tokens, kept)
        try:
            ahead = self.model.forward_ids(caches, tokens, [1] * len(caches), [1] * len(caches))
        except ValueError:  # a step the model refuses (a cache at its capacity): the next round runs in step
            return tokens
        mx.async_eval(ahead)
        self.launched = Launched(caches, tokens, ahead)
        return tokens

    def confirm(self, draws: list[int], tokens: mx.array, drawn_from_tokens: bool = False) -> None:
        """The host's draws for the launching round: the queued step stands only where they equal its ids (at once
        where the draws were read from those very ids)."""
        if self.launched is None or self.launched.tokens is not tokens:
            return
        ids = list(draws) if drawn_from_tokens else [int(i) for i in np.array(tokens)]
        if ids == draws:
            self.launched.ids = ids
        else:  # a tie or a NaN the host breaks otherwise: that step ran on another id
            self.drop()

    def drop(self) -> None:
        """Close a queued step's windows unkept (a stream leaves, a snapshot is taken, a round fails)."""
        launched, self.launched = self.launched, None
        if launched is not None:
            self._close(launched)

    def _close(self, launched: Launched) -> None:
        self.closed += 1
        for cache in launched.caches:
            if cache.window is not None:
                try:
                    self.model.keep(cache, 0)
                except Exception:  # a failed step: its streams are ended by the round that reads it
                    cache.window = None


def _goes_on(stream) -> bool:
    """Whether the stream has room past this round's token (a step after its last token would only be closed)."""
    return min(stream.request.max_tokens - stream.generated, stream.limit - len(stream.tokens)) > 1
