"""The round loop: every stream's window in one forward, keyed draws at each row, accept, commit, keep, emit."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from typing import cast

from ..protocols import (DEPTH_RULE, MAX_DRAFT_DEPTH, AheadAsk, ChanceDrafter, DraftAsk, Drafter, HeldDrafts,
                         HoldAheadDrafter, HoldPricedDrafter, Model, TappedModel, can_keep_later, window_features)
from .ahead import DEVICE_GREEDY_ENV, Lookahead, device_acceptance, greedy_ids
from .copy import RECALL, CopyProposer
from .grants import Held
from .guards import PROBE_CATCH_UP, Ask, DraftPlanner, Verified
from .row_costs import prime_shared_lines, times_rows
from .rows import RowStage
from .stream import Stream
from .types import ErrorEvent, SpecCounters

# a stream that may draft runs ahead once this many of its rounds in a row held no drafts (its guard stands it aside,
# its drafter or copies find nothing): its next round is most likely plain too, and a queued step that a round with
# drafts does not take costs one forward, closed unkept
AHEAD_AFTER_UNDRAFTED = 3
# in a shared round a stream that may draft holds every stream's step back, so there it takes one round without
# drafts: on the H200 at 8 streams the rule of 3 ran 86 of 131 rounds ahead against plain's 119 of 135, for 9 drafted
# windows of 967 (docs/performance.md, fifth visit)
AHEAD_AFTER_UNDRAFTED_SHARED = 1
# "1": a greedy round's drafting streams queue their next holds on the verify's device draws before the host reads
# them, where the drafter can (`DrafterFacts.hold_ahead`); off until timed on a GPU (docs/speculation.md)
HOLD_AHEAD_ENV = "TENSORFOLD_HOLD_AHEAD"


@dataclass
class Turn:
    """One stream's part in a round: the rows it feeds, its drafts, and whether its rows draw tokens."""

    stream: Stream
    window: list[int]
    draws: bool
    drafts: list[int] = field(default_factory=list)
    source: str = ""  # which proposer gave the drafts


def accepted_prefix(drafts: list[int], draws: list[int]) -> int:
    """How many drafts equal the target's own draws, from the first."""
    n = 0
    while n < len(drafts) and drafts[n] == draws[n]:
        n += 1
    return n


class Engine:
    """Runs rounds over admitted streams; single-threaded, so it can run in a thread or inline."""

    def __init__(self, model: Model, *, prefill_chunk: int = 256, shared_rounds: bool = True,
                 drafter: Drafter | None = None, max_depth: int = MAX_DRAFT_DEPTH, timed: bool = False,
                 fixed_depth: int | None = None, copy_drafts: bool = True, on_leave=None, recall=None,
                 lookahead: bool | None = None, hold_ahead: bool | None = None):
        self.model = model
        # a greedy round of streams that cannot draft queues its next step before the host reads it (None:
        # TENSORFOLD_LOOKAHEAD, default on)
        self.ahead = Lookahead(model, lookahead)
        self._keeps_later = can_keep_later(model)  # a round's commits evaluated together (`_keep`)
        # a round whose every drawing row is plain greedy reads its ids, not its logits rows (TENSORFOLD_DEVICE_GREEDY)
        self.device_greedy = os.environ.get(DEVICE_GREEDY_ENV, "1") != "0"
        # a drafting stream's next hold queued on its verify's device draws (None: TENSORFOLD_HOLD_AHEAD, default off)
        wanted = os.environ.get(HOLD_AHEAD_ENV, "0") == "1" if hold_ahead is None else hold_ahead
        self.holds_ahead = wanted and drafter is not None and drafter.facts.hold_ahead
        self.id_rounds = 0  # forwards whose draws were read as the device's greedy ids (tests and figures)
        self.prefill_chunk = prefill_chunk
        # without row invariance a stream's rows would depend on its neighbours, so each runs alone, undrafted
        self.shared_rounds = shared_rounds
        # `recall`: the kept prompt states' tokens, for copies from earlier requests (None: own contexts only)
        self.copy = CopyProposer(recall)
        self.drafter = drafter
        self.max_depth = max_depth
        # untimed (tests, check mode) the depths follow acceptance alone; a server prices by measured costs
        self.planner = DraftPlanner(timed=timed)
        self.fixed_depth = fixed_depth  # check mode: every window carries this many drafter drafts, unpriced
        self.copy_drafts = copy_drafts
        self.on_leave = on_leave  # (stream, kept) when a stream leaves: its memory and state go back to the host
        self._asked: list[Turn] = []
        self.streams: dict[int, Stream] = {}
        self.rounds = 0
        self.last_windows: list[int] = []  # each window's rows in the last round (round() sets it)
        self.counters = SpecCounters()
        self.ahead_after_undrafted: int | None = AHEAD_AFTER_UNDRAFTED  # None: only streams that cannot draft
        self.ahead_after_undrafted_shared: int | None = AHEAD_AFTER_UNDRAFTED_SHARED  # the same, in shared rounds
        self._undrafted: dict[int, int] = {}  # stream id: its rounds in a row that held no drafts

    def time_rows(self, parallel: int) -> dict[int, dict[int, float]]:
        """Time the target's forwards for shared rounds of up to `parallel` streams (a timed engine that may draft:
        a server), so their verify rows are priced by this machine's costs from the first round; {streams: {rows:
        ms}}, empty where nothing would read them, and on the CPU unless TENSORFOLD_TIME_ROWS=1 asks (row_costs)."""
        can_draft = self.drafter is not None or self.copy_drafts
        if not (self.planner.timed and self.shared_rounds and can_draft and self.fixed_depth is None and times_rows()):
            return {}
        return prime_shared_lines(self.planner, self.model, parallel)

    def add(self, stream: Stream) -> None:
        request = stream.request
        try:
            stream.stage = RowStage(request.prompt_ids, self.model.vocab_size, request.penalties, request.logprobs,
                                    request.grammar)
        except Exception as exc:  # a grammar the matcher refuses ends its own stream only
            stream.emit(ErrorEvent(error=exc))
            if self.on_leave is not None:
                self.on_leave(stream, False)
            return
        self.streams[stream.id] = stream
        self._bound_taps(stream)

    def _bound_taps(self, stream: Stream) -> None:
        """A tapped model keeps only rows the drafter may absorb: none of a stream that never drafts, and of a
        drafting one's prompt its last `catch_up` rows on where the drafter bounds a hold's catch-up (a hold cuts
        the earlier ones away; a prompt chunk then skips its last layer's rows that no one reads)."""
        if self.drafter is None or getattr(self.model, "taps", 0) <= 0:
            return
        catch_up = self.drafter.facts.catch_up
        if not (stream.request.draft and self.shared_rounds):
            first = stream.limit
        else:
            first = max(0, stream.prompt_len - catch_up) if catch_up else 0
        cast(TappedModel, self.model).tap_from(stream.cache, first)

    def cancel(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.cancelled = True

    def idle(self) -> bool:
        return not self.streams

    def depth_for(self, stream: Stream) -> int:
        """Most drafts this stream's window may carry this round."""
        if not (stream.request.draft and self.shared_rounds) or stream.prefilling:
            return 0
        room = min(stream.request.max_tokens - stream.generated, stream.limit - len(stream.tokens)) - 1
        return max(0, min(self.max_depth, room))

    def _may_draft(self, stream: Stream) -> bool:
        """Whether the stream's next window may carry drafts (a copy, a grammar's forced run, the drafter's)."""
        return self.depth_for(stream) > 0 and (self.drafter is not None or self.copy_drafts
                                               or stream.stage.constraint is not None)

    def _drafts_next(self, stream: Stream, shared: bool = False) -> bool:
        """Whether the stream's next window is likely to carry drafts: it may draft, and its last rounds did."""
        if not self._may_draft(stream):
            return False
        after = self.ahead_after_undrafted_shared if shared else self.ahead_after_undrafted
        return after is None or self._undrafted.get(stream.id, 0) < after

    def plan(self) -> list[Turn]:
        """Every decoding stream's pending token and drafts, plus prompt chunks up to one chunk's rows."""
        turns, prefill_rows = [], 0
        for stream in self.streams.values():
            if not self._prompt_read(stream):
                continue
            if stream.prefilling:
                if prefill_rows:  # one prompt chunk a round keeps decode rounds short
                    continue
                window = stream.window(self.prefill_chunk)
                prefill_rows += len(window)
            else:
                window = stream.window(self.prefill_chunk)
            draws = stream.cache.offset + len(window) == len(stream.tokens)
            turns.append(Turn(stream, window, draws))
        self._propose(turns)
        return turns

    def _prompt_read(self, stream: Stream) -> bool:
        """Whether the stream may take a turn: one of a prefill group waits until the group's first stream has read
        the shared prompt, then starts from a copy of that state (a resumed state equals a fresh one where rows are
        invariant, so each reply is the one it would be alone)."""
        group = stream.request.prefill_group
        if group is None or not self.shared_rounds or stream.cache.offset > 0:
            return True
        first = min((s for s in self.streams.values() if s.request.prefill_group == group
                     and s.request.prompt_ids == stream.request.prompt_ids), key=lambda s: s.id)
        if first is stream:
            return True
        if first.prefilling or first.generated == 0:
            return False
        self.ahead.drop()  # a snapshot takes a cache with no window open
        state = self.model.snapshot(first.cache)
        usable = state.resume_point(stream.prompt_len - 1)
        if usable > 0:
            stream.cache = self.model.restore(state, stream.cache.capacity, usable, marks=self.prefill_chunk)
            stream.cached_tokens = usable
            self._bound_taps(stream)
        return True

    def _propose(self, turns: list[Turn]) -> None:
        """Copies first (free), the drafter for the rest; the planner prices every drawing window's depth
        (prompt chunks in the round count as its extra rows)."""
        self._asked = [t for t in turns if t.draws] if self.shared_rounds else []
        if self.drafter is None and not self.copy_drafts and all(t.stream.stage.constraint is None for t in turns):
            self._asked = []  # nothing can draft here: no copies, no drafter, no grammar's forced run to price
        if not self._asked:
            return
        rooms = [self.depth_for(t.stream) for t in self._asked]
        facts = self.drafter.facts if self.drafter is not None else DEPTH_RULE
        if self._runs_plain(facts):  # the planner drafts nothing this round: no copy is looked up to be discarded
            copies = [[] for _ in self._asked]
        else:
            copies = self.copy.propose([DraftAsk(t.stream.id, t.stream.tokens, room if self.copy_drafts else 0)
                                        for t, room in zip(self._asked, rooms)])
        asks = [Ask(t.stream.id, len(copy) or (room if self.drafter is not None else 0), len(t.stream.tokens),
                    t.stream.request.sampling.greedy, copy=bool(copy), source=self.copy.source(t.stream.id))
                for t, room, copy in zip(self._asked, rooms, copies)]
        extra_rows = sum(len(t.window) for t in turns if t.stream.prefilling)
        if self.fixed_depth is None:
            hold_ms = cast(HoldPricedDrafter, self.drafter).hold_ms if facts.hold_costs else None
            depths = self.planner.plan(asks, extra_rows=extra_rows, facts=facts, hold_ms=hold_ms)
        else:
            depths = [min(self.fixed_depth, ask.max_depth) for ask in asks]
        if not any(depths):
            self._skip_taps(facts)
        drafting = []
        for turn, ask, copy, depth in zip(self._asked, asks, copies, depths):
            if depth > 0 and ask.copy:  # copies first: a stream with one ahead asks no hold this round
                turn.drafts, turn.source = copy[:depth], "recall" if ask.source == RECALL else "copy"
            elif depth > 0:
                drafting.append((turn, depth))
        if drafting:
            # a probe's drafts only test whether drafting pays again: its catch-up is bounded, so its cost is too
            asks = [DraftAsk(t.stream.id, t.stream.tokens, d, PROBE_CATCH_UP if self.planner.probing(t.stream.id)
                             else facts.catch_up or None, limit=t.stream.limit, cache=t.stream.cache)
                    for t, d in drafting]
            self.drafter.catch_up(asks)
            self.planner.caught_up()
            proposals = self.drafter.propose(asks)
            for (turn, depth), drafts in zip(drafting, proposals):
                turn.drafts = drafts[:depth] if isinstance(drafts, HeldDrafts) else list(drafts)[:depth]
                turn.source = self.drafter.name
        self.planner.proposed()
        for turn, room in zip(self._asked, rooms):
            if isinstance(turn.drafts, HeldDrafts) and turn.stream.stage.constraint is not None:
                turn.drafts = turn.drafts.read()  # a grammar cuts drafts on the host
            legal = turn.stream.stage.legal(turn.drafts)
            self.counters.cut_by_grammar += len(turn.drafts) - len(legal)
            forced = turn.stream.stage.forced(room)
            # JSON's punctuation is forced by its grammar: those drafts cost no chain and nearly always land
            turn.drafts, turn.source = (forced, "grammar") if len(forced) > len(legal) else (legal, turn.source)
        if facts.chances and self.fixed_depth is None:
            self._grant(cast(ChanceDrafter, self.drafter))
        for turn, room in zip(self._asked, rooms):
            if room > 0:  # a window that could draft: did the planner and its guards let it?
                self.counters.verdicts["drafted" if turn.drafts else "plain"] += 1
            # a held window's draft rows are read on the device (`_forward`): their ids here are placeholders
            turn.window = turn.window + ([0] * len(turn.drafts) if isinstance(turn.drafts, HeldDrafts)
                                         else turn.drafts)

    def _runs_plain(self, facts) -> bool:
        """Whether the shared guard runs this round's band plain, where the planner drafts nothing (a lone stream
        the lone guard runs plain still looks up copies: they are worth more than running its stretch ahead)."""
        if self.fixed_depth is not None or len(self._asked) == 1:
            return False
        asks = [Ask(t.stream.id, 0, len(t.stream.tokens), t.stream.request.sampling.greedy) for t in self._asked]
        return not self.planner.guards_draft(asks, facts)

    def _skip_taps(self, facts) -> None:
        """A band running plain taps only the rows its next drafted round may catch up: a plain round commits one row
        a stream, so rows before the last `catch_up` of the run are cut by that round's bounded catch-up anyway."""
        streams = len(self._asked)
        left = self.planner.shared.plain_rounds_left(streams) if self.planner.timed and streams >= 2 else 0
        if self.drafter is None or not facts.catch_up or left <= facts.catch_up or getattr(self.model, "taps", 0) <= 0:
            return
        for turn in self._asked:
            cast(TappedModel, self.model).tap_from(turn.stream.cache, len(turn.stream.tokens) + left - facts.catch_up)

    def _grant(self, drafter: ChanceDrafter) -> None:
        """The scheduled verify: each window keeps the drafts of its hold that the planner grants by their chances."""
        held = [Held(len(t.drafts), drafter.chances(t.stream.id)) if t.source == drafter.name and t.drafts else None
                for t in self._asked]
        granted = self.planner.grant(held, [len(t.drafts) for t in self._asked])
        for turn, h, g in zip(self._asked, held, granted):
            if h is not None:
                turn.drafts = turn.drafts[:g]

    def round(self) -> bool:
        """One round; returns False when there was nothing to do."""
        for stream in [s for s in self.streams.values() if s.cancelled]:
            self._leave(stream, "cancelled")
        turns = self.plan()
        self.last_windows = [len(t.window) for t in turns]  # what the round ran, for tests and figures
        if not turns:
            return False
        groups = [turns] if self.shared_rounds else [[turn] for turn in turns]
        verified = {}
        for group in groups:
            verified.update(self._run(group, ahead=len(groups) == 1))
        if self._asked and self.fixed_depth is None:
            self.planner.observe([verified.get(id(t), Verified(len(t.drafts), 0, 0)) for t in self._asked])
        self.rounds += 1
        return True

    def _run(self, group: list[Turn], ahead: bool = False) -> dict:
        """One forward for the group's windows (queued by the last round where it ran ahead); returns what each
        drawing window verified."""
        verified, tokens = {}, None
        try:
            logits = self.ahead.take(group)
            if logits is None:
                logits = self._forward(group)
            ids = greedy_ids(logits) if self._reads_ids(group) else None
            self.id_rounds += ids is not None
            # streams that will likely draft next round do not run ahead: a step their drafts replace is wasted
            if ahead and self.ahead.eligible(group):
                if not any(self._drafts_next(t.stream, len(group) > 1) for t in group):
                    tokens = self.ahead.launch(group, logits, ids)  # each window's row kept: the next step is queued
                else:
                    self.ahead.held += 1
            queued, queued_on = self._queue_holds(group, logits, ids) if tokens is None else ({}, None)
            rows = np.array(logits if ids is None else ids, copy=False)
        except Exception as exc:  # a failed forward ends its own streams and no others
            self.ahead.drop()
            for turn in group:
                turn.stream.emit(ErrorEvent(error=exc))
                self._forget(turn.stream, kept=False)
            return verified
        row, firsts, kept = 0, [], []
        for turn in group:
            stream = turn.stream
            if not turn.draws:
                kept += self._keep(stream.cache, len(turn.window))
                continue
            n = 1 + len(turn.drafts)
            if isinstance(turn.drafts, HeldDrafts):  # read with the logits: evaluated by now, so no wait
                turn.drafts = turn.drafts.read()
            if ids is None:
                draws, logprobs = stream.stage.verify(rows[row:row + n], turn.drafts, stream.request.sampling,
                                                      stream.seed, len(stream.tokens))
            else:  # the device's greedy draws, as the host's plain stage would draw them from the rows
                draws, logprobs = [int(i) for i in rows[row:row + n]], None
            row += n
            firsts.append(draws[0])
            accepted = accepted_prefix(turn.drafts, draws)
            if stream.id in queued:  # the hold queued on the device's acceptance learns the host's
                if not isinstance(queued_on, list):  # every stream's, read once
                    queued_on = np.array(queued_on).tolist()
                cast(HoldAheadDrafter, self.drafter).settle_ahead(stream.id, accepted, draws[accepted],
                                                                   tuple(queued_on[queued[stream.id]]))
            # the pending token and the accepted drafts stay in the cache; the bonus draw is the new pending token
            if tokens is None:  # a round that ran ahead kept its one row already
                kept += self._keep(stream.cache, len(turn.window) - len(turn.drafts) + accepted)
            self._count(turn, accepted)
            before = len(stream.tokens)
            shown = stream.commit(draws[:accepted + 1])
            stream.stage.commit(stream.tokens[before:])
            stream.emit_tokens(shown, logprobs)
            verified[id(turn)] = Verified(len(turn.drafts), accepted, len(stream.tokens) - before)
            if stream.finish_reason:
                self._leave(stream)
        if kept:  # every stream's commit in one evaluation, which the host does not wait for
            mx.async_eval(kept)
        if tokens is not None:
            self.ahead.confirm(firsts, tokens, drawn_from_tokens=tokens is ids)
        return verified

    def _queue_holds(self, group: list[Turn], logits: mx.array, ids: mx.array | None) -> tuple[dict, mx.array | None]:
        """Each plain greedy drafting stream's next hold, queued on the verify's device draws (its argmax, which the
        host's greedy draw equals) before the host reads them; a seeded stream holds in step. Per stream queued, its
        row in the second array returned: the device's acceptance and bonus draw it was queued on."""
        if not self.holds_ahead:
            return {}, None
        eligible, row = [], 0
        for turn in group:
            if not turn.draws:
                continue
            stream, n = turn.stream, 1 + len(turn.drafts)
            room = min(stream.request.max_tokens - stream.generated, stream.limit - len(stream.tokens))
            drafting = (turn.source == self.drafter.name and stream.stage.plain and stream.request.sampling.greedy)
            rows = window_features(self.model, stream.cache) if drafting else None
            if rows is not None and room > n:  # a stream that may end in this round asks no hold
                eligible.append((turn, row, n, rows))
            row += n
        if not eligible:
            return {}, None
        greedy = ids if ids is not None else greedy_ids(logits)  # the round reads its rows where a stream samples
        asks = []
        for turn, row, n, rows in eligible:
            drafts = turn.drafts.ids if isinstance(turn.drafts, HeldDrafts) else mx.array(turn.drafts, mx.uint32)
            accepted, pending = device_acceptance(drafts, greedy[row:row + n])
            stream = turn.stream
            asks.append(AheadAsk(stream.id, stream.cache.offset, rows, accepted, pending, self.depth_for(stream)))
        # the verify and the device's acceptances in an eval of their own, so the host's read waits for them, not for
        # the holds queued behind; the acceptances are read once for every stream, and settle checks them
        device = mx.stack([mx.stack([ask.accepted, ask.pending.astype(mx.int32)]) for ask in asks])
        mx.async_eval(logits if ids is None else ids, device)
        queued = set(cast(HoldAheadDrafter, self.drafter).hold_ahead(asks))
        return {ask.stream_id: j for j, ask in enumerate(asks) if ask.stream_id in queued}, device

    def _keep(self, cache, rows: int) -> list:
        """Commit `rows` of the cache's window: the arrays that hold it where the model's commits can wait (a
        keep of its own is a host wait on the device a stream), else kept at once."""
        if self._keeps_later:
            return self.model.keep_later(cache, rows)
        self.model.keep(cache, rows)
        return []

    def _reads_ids(self, group: list[Turn]) -> bool:
        """Whether the round's draws are all plain greedy ones, which the device's argmax gives without the rows."""
        drawing = [t.stream for t in group if t.draws]
        return self.device_greedy and bool(drawing) and all(s.stage.plain and s.request.sampling.greedy
                                                            for s in drawing)

    def _forward(self, group: list[Turn]) -> mx.array:
        """The group's forward; held drafts join their windows' host ids on the device, so the hold that made them
        is not waited on first."""
        caches, rows = [t.stream.cache for t in group], [1 + len(t.drafts) if t.draws else 0 for t in group]
        if not any(isinstance(t.drafts, HeldDrafts) for t in group):
            return self.model.forward(caches, [t.window for t in group], rows)
        parts = []
        for t in group:
            held = t.drafts if isinstance(t.drafts, HeldDrafts) else None
            host = t.window[:len(t.window) - len(held)] if held is not None else t.window
            parts.append(mx.array(host, dtype=mx.uint32))
            if held is not None:
                parts.append(held.ids.astype(mx.uint32))
        return self.model.forward_ids(caches, mx.concatenate(parts), [len(t.window) for t in group], rows)

    def _count(self, turn: Turn, accepted: int) -> None:
        sid = turn.stream.id
        self._undrafted[sid] = 0 if turn.drafts else self._undrafted.get(sid, 0) + 1
        stats = turn.stream.stats
        stats.rounds += 1
        stats.drafted += len(turn.drafts)
        stats.accepted += accepted
        self.counters.window(len(turn.drafts), accepted, turn.source)
        if turn.source in ("copy", "recall"):
            self.copy.observe(turn.stream.id, len(turn.drafts), accepted)

    def _forget(self, stream: Stream, kept: bool = True) -> None:
        self.ahead.drop()  # a queued step for a leaving stream is closed before its state goes back
        self.streams.pop(stream.id, None)
        self._undrafted.pop(stream.id, None)
        self.copy.release(stream.id)
        self.planner.leave(stream.id)
        if self.drafter is not None:
            self.drafter.release(stream.id)
        if self.on_leave is not None:  # last: the drafter's slot is kept by now, so the ledger can count it
            self.on_leave(stream, kept)

    def _leave(self, stream: Stream, reason: str | None = None) -> None:
        stream.finish(reason)
        self._forget(stream)

    def run_until_idle(self) -> None:
        while self.round():
            pass
