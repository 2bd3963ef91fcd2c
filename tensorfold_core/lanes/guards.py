"""Guards that keep drafting honest, and the planner that prices each round under them for the engine."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

from .. import traces
from ..protocols import DEPTH_RULE, DrafterFacts
from .aside import StandAside
from .grants import GrantLane, Held, fit_one_pass, grants
from .holds import HoldOffer, keep_holds
from .pricing import PRIOR_ACCEPTANCE, Acceptance, Costs, lone_depth, shared_depths

MARGIN = 1.05  # drafted rounds must beat plain ones by this factor to be kept
SHARED_MEASURE_PLAIN = 16  # measured rounds that give a band of stream counts its plain rate
SHARED_MEASURE_DRAFTED = 4  # measured rounds that give a band of stream counts its drafted rate
SHARED_RUN = 512  # rounds the faster mode runs before the other one is measured again
SHARED_RUN_GROWTH = 64  # a mode that keeps winning runs up to this many times SHARED_RUN
# measured rounds after which a drafted run whose rate has fallen below plain's stops, and both are measured again:
# a 4-round measure can pick drafting by chance, and a run of 512 rounds would pay for it (the law: drafts only help)
SHARED_RUN_CHECK = 16
LONE_STRETCH = 16  # measured rounds in a lone stream's drafted stretch (and in a plain one taken to compare)
LONE_FIRST_WAIT = 16  # plain rounds after a lost stretch before drafting is measured again
LONE_MAX_WAIT = 512  # the most that wait doubles to while plain keeps winning
LONE_LOSSES_PRICED = 2  # lost stretches in a row after which the wait also bounds what a probe costs
# drafted rounds a winning band runs before its plain rate is measured again (doubling up to 64 times): a rate read
# once, in a cold start's slow rounds, would otherwise judge every later stretch of the band's drafting
LONE_PLAIN_REFRESH = 1024
# rounds a lone plain stretch leaves unmeasured: its first round carries the last drafts, and until the engine runs
# the stream ahead (engine.AHEAD_AFTER_UNDRAFTED undrafted rounds) its rounds are slower than plain's steady ones;
# 1 measures them (the default until a GPU run says which judges better: tools/device/profile_decode.py's bands)
LONE_PLAIN_SETTLE_ENV = "TENSORFOLD_LONE_PLAIN_SETTLE"
PROBE_SHARE = 0.03  # the most a probe may cost, as a share of the plain time before it
PROBE_CATCH_UP = 32  # context rows a probe's drafter may catch up: what a probe costs must not grow with its gap
PRIOR_HALF_LIFE = 64.0  # drafter windows, over all streams, after which one weighs half in a new stream's prior
STRETCH_HALF_LIFE = 64.0  # rounds after which a round weighs half in a stretch's rate


class _Stretch:
    """Committed tokens and wall ms over a stretch of rounds, decayed so a long stretch tells its recent rate."""

    __slots__ = ("tokens", "ms", "weight", "measured", "rounds")
    _decay = 0.5 ** (1.0 / STRETCH_HALF_LIFE)

    def __init__(self):
        self.tokens = self.ms = self.weight = 0.0
        self.measured = 0  # rounds measured
        self.rounds = 0  # rounds run, the unmeasured first one included

    def add(self, tokens: int, ms: float) -> None:
        self.tokens = self.tokens * self._decay + tokens
        self.ms = self.ms * self._decay + ms
        self.weight = self.weight * self._decay + 1.0
        self.measured += 1

    @property
    def rate(self) -> float:
        """Committed tokens per wall ms."""
        return self.tokens / self.ms if self.ms > 0 else math.inf

    @property
    def round_ms(self) -> float:
        """Wall ms of a measured round."""
        return self.ms / self.weight if self.weight else 0.0


class _CountBand:
    """A band of stream counts' guard state: the mode, whether it is measured or run, and each mode's last rate."""

    def __init__(self, run: int):
        self.drafted = False  # it starts plain
        self.running = False  # False: measuring `drafted`; True: running the winner
        self.stretch = _Stretch()
        self.rates: dict[bool, float | None] = {False: None, True: None}
        self.winner: bool | None = None
        self.run = run


class SharedGuard:
    """Per band of stream counts: committed tokens per wall ms of plain and drafted stretches; runs the faster mode."""

    def __init__(self, measure_plain: int = SHARED_MEASURE_PLAIN, measure_drafted: int = SHARED_MEASURE_DRAFTED,
                 run: int = SHARED_RUN, growth: int = SHARED_RUN_GROWTH, margin: float = MARGIN):
        self.measure = {False: measure_plain, True: measure_drafted}
        self.first_run, self.max_run, self.margin = run, run * growth, margin
        self._bands: dict[int, _CountBand] = {}
        self._last: tuple[int, bool] | None = None  # the last shared round's streams and mode

    @staticmethod
    def band(streams: int) -> int:
        """The key a stream count's verdict is kept under: 1, 2, 3-4, 5-8, 9-16, ... share one each."""
        # an exact count starves: as streams finish the count walks down, and each new key would start plain
        return max(streams - 1, 0).bit_length()

    def _band(self, streams: int) -> _CountBand:
        key = self.band(streams)
        entry = self._bands.get(key)
        if entry is None:
            entry = self._bands[key] = _CountBand(self.first_run)
        return entry

    def drafted(self, streams: int) -> bool:
        """Whether a round of this many streams drafts (False: a plain round, drafts off)."""
        return self._band(streams).drafted

    def run_length(self, streams: int) -> int:
        """Rounds the current winner in this count's band runs before the other mode is measured again."""
        return self._band(streams).run

    def plain_rounds_left(self, streams: int) -> int:
        """Rounds left in this count's band's plain run before drafting is measured again (0: not running plain)."""
        entry = self._band(streams)
        return max(0, entry.run - entry.stretch.rounds) if entry.running and not entry.drafted else 0

    def interrupt(self) -> None:
        """A round this guard did not see ran (a lone one): the next round here is a first round."""
        self._last = None

    def observe(self, streams: int, drafted: bool, tokens: int, ms: float, catch_up: float = 0.0) -> None:
        """A round of `streams` streams in mode `drafted` committed `tokens` in `ms`, `catch_up` of them catching up."""
        entry = self._band(streams)
        if drafted != entry.drafted:  # not the mode this guard asked for: it measures nothing
            self._last = None
            return
        # a mode's first round still carries the last round's drafts or their absence, and a joining stream's first
        # drafts its drafter's catch-up; a stream leaving changes neither, so the round after it is measured
        first = self._last is None or self._last[1] != drafted or streams > self._last[0]
        self._last = (streams, drafted)
        entry.stretch.rounds += 1
        if not first:
            # drafts after plain rounds first catch up what those rounds committed: a switch's cost, once, that a
            # 4-round stretch would read as drafting's; a run's long stretch pays its catch-up like any other time
            entry.stretch.add(tokens, ms if entry.running else ms - catch_up)
        done = (entry.stretch.rounds >= entry.run or self._losing(entry) if entry.running
                else entry.stretch.measured >= self.measure[entry.drafted])
        if done:
            self._next(entry)

    @staticmethod
    def _losing(entry: _CountBand) -> bool:
        """A drafted run whose own rate, over enough rounds, is below the plain rate it was chosen against."""
        plain = entry.rates[False]
        return (entry.drafted and plain is not None and entry.stretch.measured >= SHARED_RUN_CHECK
                and entry.stretch.rate < plain)

    def _next(self, entry: _CountBand) -> None:
        if entry.stretch.measured:
            entry.rates[entry.drafted] = entry.stretch.rate
        other = not entry.drafted
        if entry.running or entry.rates[other] is None:  # measure the other mode (again)
            self._set(entry, other, running=False)
            return
        winner = entry.rates[True] > entry.rates[False] * self.margin
        entry.run = min(entry.run * 2, self.max_run) if winner == entry.winner else self.first_run
        entry.winner = winner
        self._set(entry, winner, running=True)

    @staticmethod
    def _set(entry: _CountBand, drafted: bool, running: bool) -> None:
        entry.drafted, entry.running, entry.stretch = drafted, running, _Stretch()


@dataclass
class _Band:
    """What a band keeps from stream to stream: its mode and stretch, its plain rate, its run of lost stretches."""

    plain: float | None = None  # committed tokens per ms of its last plain stretch
    plain_round_ms: float = 0.0
    losses: int = 0  # drafted stretches lost in a row; above 0 it is the band's losing verdict
    wait: int = LONE_FIRST_WAIT
    since_plain: int = 0  # drafted rounds judged against that plain rate
    refresh: int = LONE_PLAIN_REFRESH
    # the band's stretch in its mode, carried from stream to stream: short replies cross a band in a few rounds, and
    # a stretch that began again with each of them was never judged (docs/speculation.md)
    drafted: bool = True
    stretch: _Stretch = field(default_factory=_Stretch)
    pending: _Stretch | None = None  # a drafted stretch waiting for a plain rate to be judged by


class LoneGuard:
    """A lone stream's drafter rounds, per sampling mode and context band: drafting goes on while it beats plain."""

    def __init__(self, stretch: int = LONE_STRETCH, first_wait: int = LONE_FIRST_WAIT,
                 max_wait: int = LONE_MAX_WAIT, margin: float = MARGIN, probe_share: float = PROBE_SHARE):
        self.stretch_rounds, self.first_wait, self.max_wait = stretch, first_wait, max_wait
        self.margin, self.probe_share = margin, probe_share
        self._bands: dict[Hashable, _Band] = {}
        self._who: tuple[Hashable, Hashable] | None = None  # the (stream, band) the last round was for
        self._entry = _Band()  # that band's
        self.plain_settle = max(int(os.environ.get(LONE_PLAIN_SETTLE_ENV, "1")), 1)
        self._skip = 1  # rounds still to leave unmeasured

    @staticmethod
    def band(greedy: bool, context: int) -> tuple[bool, int]:
        """The key a lone stream's verdicts are kept under: sampling mode and the power of 2 of its context."""
        return greedy, max(context, 1).bit_length()

    def _band(self, band: Hashable) -> _Band:
        entry = self._bands.get(band)
        if entry is None:
            entry = self._bands[band] = _Band(wait=self.first_wait)
        return entry

    def losing(self, band: Hashable) -> bool:
        """Whether the band's last verdict was a loss (its next stream starts plain)."""
        return self._band(band).losses > 0

    def wait(self, band: Hashable) -> int:
        """Plain rounds the band runs after a loss before drafting is measured again."""
        return self._band(band).wait

    def drafted(self, stream: Hashable, band: Hashable) -> bool:
        """Whether this lone stream's next round holds drafter drafts."""
        self._follow(stream, band)
        return self._entry.drafted

    def interrupt(self) -> None:
        """A round this guard did not see ran (shared, prompt, traced, no drafts): the next one here is a first."""
        self._skip = max(self._skip, 1)

    def observe(self, stream: Hashable, band: Hashable, drafted: bool, tokens: int, ms: float) -> None:
        """A lone round of this stream in mode `drafted` committed `tokens` in `ms` of wall time."""
        self._follow(stream, band)
        entry = self._entry
        if drafted != entry.drafted:  # not the mode this guard asked for: it measures nothing
            self._skip = max(self._skip, 1)
            return
        stretch = entry.stretch
        stretch.rounds += 1
        if self._skip:  # a mode's first round still carries the last round's drafts or their absence
            self._skip -= 1
        else:
            stretch.add(tokens, ms)
        if entry.drafted:
            if stretch.measured >= self.stretch_rounds:
                if entry.plain is None:  # no plain rate yet for this band: take one stretch of it once
                    entry.pending = stretch
                    self._set(entry, False)
                else:
                    self._judge(entry, stretch)
        elif (stretch.measured >= self.stretch_rounds if entry.pending is not None else stretch.rounds >= entry.wait):
            if stretch.measured:
                entry.plain, entry.plain_round_ms, entry.since_plain = stretch.rate, stretch.round_ms, 0
            pending, entry.pending = entry.pending, None
            if pending is not None:
                self._judge(entry, pending)
            else:  # the wait is over: measure drafting again
                self._set(entry, True)

    def _follow(self, stream: Hashable, band: Hashable) -> None:
        if self._who != (stream, band):  # another stream or band: its first round here is unmeasured
            self._who, self._entry = (stream, band), self._band(band)
            self._settle()

    def _set(self, entry: _Band, drafted: bool) -> None:
        if drafted != entry.drafted:
            entry.drafted = drafted
            self._settle()
        entry.stretch = _Stretch()

    def _settle(self) -> None:
        self._skip = self.plain_settle if not self._entry.drafted else 1

    def _judge(self, entry: _Band, stretch: _Stretch) -> None:
        """A drafted stretch against the band's plain rate, on the stretch's own rate."""
        if stretch.rate > entry.plain * self.margin:
            entry.losses, entry.wait = 0, self.first_wait
            entry.since_plain += stretch.rounds
            if entry.since_plain >= entry.refresh:  # plain for a wait's rounds, its rate read again, then drafting
                entry.refresh = min(entry.refresh * 2, LONE_PLAIN_REFRESH * 64)
                self._set(entry, False)
                return
            self._set(entry, True)
            return
        entry.losses += 1
        entry.wait = self.first_wait if entry.losses == 1 else min(entry.wait * 2, self.max_wait)
        if entry.losses >= LONE_LOSSES_PRICED:
            entry.wait = max(entry.wait, self._priced_wait(entry, stretch))
        self._set(entry, False)

    def _priced_wait(self, entry: _Band, stretch: _Stretch) -> int:
        """Plain rounds that make a probe like this one cost at most `probe_share` of the plain time."""
        if not stretch.weight or not entry.plain or entry.plain_round_ms <= 0:
            return 0
        # what the probe's rounds took beyond plain rounds committing the same tokens
        lost = stretch.rounds * (stretch.round_ms - stretch.tokens / stretch.weight / entry.plain)
        return max(math.ceil(lost / (self.probe_share * entry.plain_round_ms)), 0)


@dataclass(frozen=True)
class Ask:
    """One decoding stream's part in the next round, as the planner needs it."""

    stream_id: int
    max_depth: int  # most drafts its window may carry this round (0: none)
    context: int  # tokens in its context: the lone guard's band
    greedy: bool = True  # greedy and sampled streams land drafts differently, so their verdicts are kept apart
    copy: bool = False  # copy drafts cost no drafter steps and keep an acceptance of their own
    source: str = "context"  # a copy's source: the stream's own context, or "recall" (kept prompt states)

    @property
    def kind(self) -> str:
        """The draft kind a stream keeps one acceptance for: its drafter's (""), or a copy's source."""
        return self.source if self.copy else ""


@dataclass(frozen=True)
class Verified:
    """What one stream's window did in the round."""

    offered: int  # drafts its window carried
    accepted: int  # of those, the prefix the target's draws kept
    committed: int  # tokens committed (accepted + 1, fewer at a stop)


@dataclass
class _Lane:
    """A stream's acceptance and stand-aside for one kind of draft (copy or drafter)."""

    acceptance: Acceptance
    aside: StandAside = field(default_factory=StandAside)


@dataclass
class _Round:
    """What `plan` decided, kept for `observe`; times in ms."""

    asks: Sequence[Ask]
    depths: list[int]
    consulted: list[bool]  # which streams' stand-aside was asked, so only those count the round
    drafted: bool
    measured: bool
    start: float | None
    extra_rows: int = 0
    first: list[bool] = field(default_factory=list)  # streams at their drafted stretch's first hold (grants on)
    planned: float | None = None
    caught_up: float | None = None
    proposed: float | None = None
    traces: int = 0  # the process's trace count at `plan`


def told_kind(done: _Round, verified: Sequence[Verified], traced: bool) -> str:
    """What a timed round tells the guards: a "shared" or "lone" rate, or why none ("prompt", "traced", "no drafts",
    "lone copy")."""
    if not done.measured:  # a prompt chunk's round, or none decoding
        return "prompt"
    if traced:
        return "traced"
    if len(done.asks) == 1 and done.asks[0].copy:  # copy drafts cost no steps: the rule prices them
        return "lone copy"
    # a drafted round whose windows held no drafts is a plain one in disguise: it tells neither rate
    if done.drafted and not any(v.offered for v in verified):
        return "no drafts"
    return "shared" if len(done.asks) >= 2 else "lone"


class DraftPlanner:
    """The engine's one handle on drafting: plan, proposed, observe each round; leave when a stream ends."""

    def __init__(self, *, timed: bool = True, clock: Callable[[], float] = time.perf_counter,
                 prior: float = PRIOR_ACCEPTANCE):
        # untimed, the clock is never read: costs keep their priors and no guard is consulted, so decisions
        # follow acceptance alone; `clock` returns seconds, and costs and rates are kept in ms
        self.timed, self._clock = timed, clock
        self.costs = Costs()
        # shared rounds' own lines, per band of stream counts: they pay per-stream costs the lone line must not
        # learn, and a lone line fitted on rounds of one or two rows misjudges what a row of a 30-row round costs
        self.shared_costs: dict[int, Costs] = {}
        self.shared = SharedGuard()
        self.lone = LoneGuard()
        self._prior = Acceptance(prior)
        # what drafter drafts have landed lately, over every stream: a new stream's first guess at its own
        self._landed = Acceptance(prior, half_life=PRIOR_HALF_LIFE)
        self._lanes: dict[tuple[int, str], _Lane] = {}
        self._grants: dict[int, GrantLane] = {}  # streams whose drafter gives chances: their grants
        self._round: _Round | None = None

    def _now(self) -> float | None:
        return self._clock() * 1000.0 if self.timed else None

    def _lane(self, stream_id: int, kind: str) -> _Lane:
        """A stream's acceptance and stand-aside for one kind of draft: its own history prices its copy windows, by
        source, as it prices its drafter's ("" below; a source's copies break where another's hold)."""
        key = (stream_id, kind)
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(Acceptance(self._new_prior(bool(kind)).prior))
        return lane

    def _new_prior(self, copy: bool) -> Acceptance:
        """A new stream's acceptance before its own windows: copy drafts keep the prior, drafter drafts learn one."""
        return self._prior if copy else Acceptance(self._landed.chain(1)[0])

    def probing(self, stream_id: int) -> bool:
        """Whether the stream's drafter drafts this round are a probe (it stood aside, and drafts to test)."""
        lane = self._lanes.get((stream_id, ""))
        return lane is not None and lane.aside.probing

    def guards_draft(self, asks: Sequence[Ask], facts: DrafterFacts) -> bool:
        """Whether the guards let this round's asks draft: the shared guard's band, or the lone guard's for one ask."""
        if not self.timed:  # an untimed engine never consults the guards
            return True
        if len(asks) >= 2:
            return self.shared.drafted(len(asks)) if facts.shared_guard else True
        if len(asks) == 1 and not asks[0].copy and facts.lone_guard:  # copy drafts cost no steps: the rule prices them
            ask = asks[0]
            return self.lone.drafted(ask.stream_id, LoneGuard.band(ask.greedy, ask.context))
        return True

    def plan(self, asks: Sequence[Ask], extra_rows: int = 0, facts: DrafterFacts = DEPTH_RULE,
             hold_ms: Callable[[int, int], float] | None = None) -> list[int]:
        """Before proposing: each ask's depth for the next round (`extra_rows`: its rows without drafts). Where the
        drafter's facts give chances, a drafter ask's depth is its hold's: the last grant's, with slack; where they
        price the hold (`hold_ms`), a timed round keeps a hold only where it pays for its pass."""
        start = self._now()
        lanes = [self._lane(a.stream_id, a.kind) for a in asks]
        granting = [facts.chances and not a.copy for a in asks]
        drafted = self.guards_draft(asks, facts)
        depths, consulted, first = [0] * len(asks), [False] * len(asks), [False] * len(asks)
        if drafted:
            priced = self._priced(asks, lanes, granting, extra_rows)
            holds = [min(self._grant(a.stream_id).next_hold(facts.slack), a.max_depth) if g else 0
                     for a, g in zip(asks, granting)]
            # until a round is timed the line is in units of a plain round, which no pass's ms can be weighed against
            if facts.hold_costs and hold_ms is not None and self._line(len(asks)).timed:
                holds = self._paying_holds(asks, lanes, granting, holds, priced, extra_rows, hold_ms)
            for i, (ask, lane) in enumerate(zip(asks, lanes)):
                if ask.max_depth <= 0:
                    continue
                if granting[i]:  # a probe after a grant of none holds the slack
                    hold, probe, first[i] = holds[i], facts.slack, self._grant(ask.stream_id).granted is None
                else:  # a probe drafts what a new stream would: the depth the prior prices, at least one
                    hold, probe = priced[i], 0
                    if lane.aside.probes(hold):  # priced only where it is asked: every stream, every round, else
                        probe = max(1, lone_depth(self._new_prior(ask.copy), self.costs, ask.max_depth, not ask.copy))
                depths[i] = min(lane.aside.depth(hold, probe), ask.max_depth)
                consulted[i] = True
            depths = fit_one_pass(depths, granting, facts.hold_rows)
        else:  # a plain round ends each stream's drafted stretch
            for ask, grant in zip(asks, granting):
                if grant:
                    self._grant(ask.stream_id).end_stretch()
        # a round carrying a prompt chunk or no decoding stream tells neither mode's rate
        self._round = _Round(asks, depths, consulted, drafted, bool(asks) and not extra_rows, start, extra_rows,
                             [f and d > 0 for f, d in zip(first, depths)], self._now(), traces=traces.count())
        return depths

    def _priced(self, asks: Sequence[Ask], lanes: Sequence[_Lane], granting: Sequence[bool],
                extra_rows: int) -> list[int]:
        """The depth rule's depths for the asks grants do not price (their windows' pending rows count as extra)."""
        rule = [i for i, g in enumerate(granting) if not g]
        priced = [0] * len(asks)
        if not rule:
            return priced
        extra = extra_rows + len(asks) - len(rule)
        if len(rule) == 1 and not extra:
            ask = asks[rule[0]]
            priced[rule[0]] = lone_depth(lanes[rule[0]].acceptance, self.costs, ask.max_depth, not ask.copy)
            return priced
        depths = shared_depths([lanes[i].acceptance for i in rule], self.costs, [asks[i].max_depth for i in rule],
                               [not asks[i].copy for i in rule], extra,
                               self.shared_costs.get(SharedGuard.band(len(asks))))
        for i, depth in zip(rule, depths):
            priced[i] = depth
        return priced

    def _paying_holds(self, asks: Sequence[Ask], lanes: Sequence[_Lane], granting: Sequence[bool],
                      holds: Sequence[int], priced: Sequence[int], extra_rows: int,
                      hold_ms: Callable[[int, int], float]) -> list[int]:
        """The granted holds that pay for their verify rows and the hold pass, a drafted stretch's first one too (each
        switch of the shared guard to drafting would otherwise buy every stream a pass that lands nothing on text its
        drafter misses); an armed probe measures, so it is kept unpriced. A hold left out stands its stream aside."""
        rows, tokens, offers = len(asks) + extra_rows, float(len(asks)), []
        for ask, lane, grant, hold, depth in zip(asks, lanes, granting, holds, priced):
            if not grant:
                rows, tokens = rows + depth, tokens + sum(lane.acceptance.reach(depth))
                offers.append(None)
                continue
            held = self._grant(ask.stream_id)
            chances = held.last_settled(hold) or lane.acceptance.reach(hold)
            offers.append(HoldOffer(hold, sum(chances), lane.aside.probing))
        kept = keep_holds(offers, self._line(len(asks)).round_ms, rows, tokens, hold_ms)
        return [hold if keep else 0 for hold, keep in zip(holds, kept)]

    def _line(self, streams: int) -> Costs:
        """What times a round's verify rows: the band's line of shared rounds where timed, else the lone line."""
        line = self.shared_costs.get(SharedGuard.band(streams)) if streams >= 2 else None
        return line if line is not None and line.timed else self.costs

    def _grant(self, stream_id: int) -> GrantLane:
        grant = self._grants.get(stream_id)
        if grant is None:
            grant = self._grants[stream_id] = GrantLane()
        return grant

    def grant(self, held: Sequence[Held | None], other_drafts: Sequence[int]) -> list[int]:
        """After the hold, before the verify: how many of each planned ask's held drafts (None: it held none) its
        window verifies, priced by their chances and the round's verify costs; `other_drafts[i]`: drafts the
        window carries without a grant (copies, a grammar's). Each grant is kept for the stream's next hold."""
        done = self._round
        if done is None:
            return [h.drafts if h is not None else 0 for h in held]
        rows, tokens, at, chances, first = len(done.asks) + done.extra_rows, float(len(done.asks)), [], [], []
        for i, (ask, h, other) in enumerate(zip(done.asks, held, other_drafts)):
            if h is None:
                rows += other
                tokens += sum(self._lane(ask.stream_id, ask.kind).acceptance.reach(other))
                continue
            grant = self._grant(ask.stream_id)
            if h.chances is not None:
                grant.settle(h.chances)
            # a hold still running is priced by its lane's last settled confidences, else by its acceptance
            priced = h.chances if h.chances is not None else grant.last_settled(h.drafts)
            if priced is None:
                priced = self._lane(ask.stream_id, "").acceptance.reach(h.drafts)
            at.append(i)
            chances.append(list(priced)[:h.drafts])
            first.append(done.first[i] if i < len(done.first) else False)
        granted = grants(chances, first, self._line(len(done.asks)).round_ms, rows, tokens)
        out = [0] * len(held)
        for i, g in zip(at, granted):
            out[i] = g
            grant = self._grant(done.asks[i].stream_id)
            grant.held, grant.granted = held[i].drafts, g
        return out

    def caught_up(self) -> None:
        """After the drafter fed its lagging slots: what passed since `plan` was catch-up, not chain steps."""
        if self._round is not None:
            self._round.caught_up = self._now()

    def proposed(self) -> None:
        """After proposing: what passed since the catch-up (or `plan`) was the drafter's chain."""
        if self._round is not None:
            self._round.proposed = self._now()

    def observe(self, verified: Sequence[Verified]) -> None:
        """After committing: `verified[i]` is what the window of the i-th planned ask did."""
        done, self._round = self._round, None
        if done is None:
            return
        for ask, result, consulted in zip(done.asks, verified, done.consulted):
            lane = self._lanes.get((ask.stream_id, ask.kind))
            if lane is None:  # it left during the round
                continue
            lane.acceptance.observe(result.offered, result.accepted)
            if not ask.copy:
                self._landed.observe(result.offered, result.accepted)
            if consulted:
                lane.aside.round(result.offered)
        if self.timed:
            self._time(done, verified, self._now())

    def _time(self, done: _Round, verified: Sequence[Verified], end: float) -> None:
        # a round that traced a new shape paid once what its like never pays again: it tells no cost and no rate
        # (else the first windows of each new size price copies and drafts out, and nothing prices them back in)
        traced = traces.count() != done.traces
        steps = max((d for a, d in zip(done.asks, done.depths) if not a.copy), default=0)
        # a catch-up feeds context rows once, after a stand-aside or to a new stream: it is no chain step
        chain_start = done.caught_up if done.caught_up is not None else done.start
        if done.proposed is not None and steps and not traced:
            self.costs.observe_steps(steps, done.proposed - chain_start)
        forward_start = done.proposed if done.proposed is not None else done.start
        measured = done.measured and not traced
        lone = measured and len(done.asks) == 1
        if lone:  # shared rounds pay per-stream costs a lone round's line must not learn
            self.costs.observe_round(1 + verified[0].offered, end - forward_start)
        elif measured and len(done.asks) >= 2:
            line = self.shared_costs.setdefault(SharedGuard.band(len(done.asks)), Costs())
            line.observe_round(sum(1 + v.offered for v in verified), end - forward_start)
        tokens, ms = sum(v.committed for v in verified), end - done.start
        catch_up = done.caught_up - done.planned if done.caught_up is not None else 0.0
        told = told_kind(done, verified, traced)
        if told == "shared":
            self.shared.observe(len(done.asks), done.drafted, tokens, ms, catch_up)
        else:
            self.shared.interrupt()
        if told == "lone":
            ask = done.asks[0]
            self.lone.observe(ask.stream_id, LoneGuard.band(ask.greedy, ask.context), done.drafted, tokens, ms)
        elif told != "lone copy":
            # a lone copy round is no interruption: copies run in either mode, and a stream whose copies and drafter
            # rounds alternate would otherwise leave every round of its stretch unmeasured, never judged
            self.lone.interrupt()

    def leave(self, stream_id: int) -> None:
        """The stream ended: forget its acceptance and stand-aside (its band keeps the lone guard's verdict)."""
        for key in [key for key in self._lanes if key[0] == stream_id]:
            del self._lanes[key]
        self._grants.pop(stream_id, None)
