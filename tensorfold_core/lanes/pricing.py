"""The depth rule: decayed acceptance per depth, measured costs, and the depths with the most tokens per ms."""

from __future__ import annotations

from typing import Sequence

PRIOR_ACCEPTANCE = 0.6  # a depth's acceptance before its stream has verified a draft there
PRIOR_WEIGHT = 2.0  # pseudo-trials the prior counts for against a depth's measured trials
ACCEPTANCE_HALF_LIFE = 16.0  # verified windows after which an observation weighs half
COST_HALF_LIFE = 32.0  # timings after which a round's or a chain's time weighs half
PRIOR_ROW_SHARE = 0.1  # one more window row, as a share of a plain round, until spread rows are timed
PRIOR_STEP_SHARE = 0.1  # one drafter step, as a share of a plain round, until a chain is timed
SLOPE_WEIGHT = 1.0  # the spread of rows (rows squared) the prior slope counts for in the fitted line
MIN_MS = 1e-6  # keeps a rate finite when a clock stands still


def _decay(half_life: float) -> float:
    return 0.5 ** (1.0 / half_life)


class Acceptance:
    """One stream's decayed acceptance per depth: p_i = P(draft i lands | drafts 1..i-1 landed)."""

    def __init__(self, prior: float = PRIOR_ACCEPTANCE, half_life: float = ACCEPTANCE_HALF_LIFE):
        self.prior = prior
        self._decay = _decay(half_life)
        self._trials: list[float] = []
        self._hits: list[float] = []

    def observe(self, offered: int, accepted: int) -> None:
        """A window carried `offered` drafts and the target's draws kept the first `accepted` of them."""
        if offered <= 0:
            return
        accepted = min(max(accepted, 0), offered)
        # draft i is only tried where drafts 1..i-1 landed, so a miss ends the evidence
        reached = min(offered, accepted + 1)
        grow = reached - len(self._trials)
        if grow > 0:
            self._trials += [0.0] * grow
            self._hits += [0.0] * grow
        for i in range(len(self._trials)):
            # every depth fades, so stale deep evidence gives way to the shallower depths it leans on
            self._trials[i] *= self._decay
            self._hits[i] *= self._decay
        for i in range(reached):
            self._trials[i] += 1.0
            if i < accepted:
                self._hits[i] += 1.0

    def chain(self, max_depth: int) -> list[float]:
        """p_1..p_max_depth; a depth with little data leans on the depth before it, the first on the prior."""
        probs, base = [], self.prior
        for i in range(max_depth):
            trials, hits = (self._trials[i], self._hits[i]) if i < len(self._trials) else (0.0, 0.0)
            base = (hits + PRIOR_WEIGHT * base) / (trials + PRIOR_WEIGHT)
            probs.append(base)
        return probs

    def reach(self, max_depth: int) -> list[float]:
        """For each depth k, the chance drafts 1..k all land: the tokens its k-th draft adds on average."""
        out, reach = [], 1.0
        for p in self.chain(max_depth):
            reach *= p
            out.append(reach)
        return out

    def expected_tokens(self, depth: int) -> float:
        """Tokens a window of `depth` drafts commits on average: 1 + p1 + p1·p2 + ..."""
        return 1.0 + sum(self.reach(depth))


class Costs:
    """Engine-wide measured costs in ms: a line fitted to a lone round's time by its rows, and a drafter step."""

    def __init__(self, half_life: float = COST_HALF_LIFE):
        self._decay = _decay(half_life)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._steps = self._chain_ms = 0.0
        self._primed: tuple[float, float] | None = None  # (ms, ms a row) of forwards timed at start

    def prime(self, forwards: dict[int, float]) -> None:
        """Forwards of `rows` rows timed at start, {rows: ms}: the line through them prices rounds until one is
        timed, and its slope stands in for the prior's while the rounds timed since are all of one width (a band
        of streams running plain), where a row's share of a CPU round would price a GPU's verify rows out."""
        if len(forwards) < 2:
            raise ValueError(f"priming a cost line takes forwards of two widths or more, not {sorted(forwards)}")
        n = len(forwards)
        mean_x, mean_y = sum(forwards) / n, sum(forwards.values()) / n
        spread = sum((x - mean_x) ** 2 for x in forwards)
        slope = max(sum((x - mean_x) * (y - mean_y) for x, y in forwards.items()) / spread, 0.0)
        self._primed = (max(mean_y - slope * mean_x, 0.0), slope)

    def observe_round(self, rows: int, ms: float) -> None:
        """A lone decode round of `rows` window rows took `ms` (shared rounds carry other costs: keep them out)."""
        d = self._decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + ms
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * ms

    def observe_steps(self, steps: int, ms: float) -> None:
        """A drafter chain of `steps` steps (streams' chains batched, so the deepest one) took `ms`."""
        if steps <= 0:
            return
        self._steps = self._steps * self._decay + steps
        self._chain_ms = self._chain_ms * self._decay + ms

    @property
    def timed(self) -> bool:
        """Whether a round or primed forwards were timed: before that the line is the prior's, in units of a plain
        round."""
        return self._w > 0.0 or self._primed is not None

    def line(self) -> tuple[float, float]:
        """(ms a round pays whatever its rows, ms a row adds); before any timing, in units of a plain round."""
        if self._w == 0.0:
            if self._primed is not None:
                return self._primed
            unit = self.step_ms() / PRIOR_STEP_SHARE if self._steps else 1.0
            return unit * (1.0 - PRIOR_ROW_SHARE), unit * PRIOR_ROW_SHARE
        mean_x, mean_y = self._x / self._w, self._y / self._w
        # rounds of one width (a stream standing aside) say nothing of the slope: lean on the primed one, or the prior's
        unit = mean_y / (1.0 + PRIOR_ROW_SHARE * (mean_x - 1.0))
        prior = self._primed[1] if self._primed is not None else PRIOR_ROW_SHARE * unit
        spread = max(self._xx - self._x * self._x / self._w, 0.0)
        covariance = self._xy - self._x * self._y / self._w
        slope = max((covariance + SLOPE_WEIGHT * prior) / (spread + SLOPE_WEIGHT), 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope

    def round_ms(self, rows: int) -> float:
        """The fitted time of a round of `rows` window rows."""
        fixed, per_row = self.line()
        return max(fixed + per_row * rows, MIN_MS)

    def step_ms(self) -> float:
        """One drafter step's time: the decayed mean of timed chains, else the prior's share of a plain round."""
        if self._steps:
            return self._chain_ms / self._steps
        return PRIOR_STEP_SHARE * self.round_ms(1)


def _timer(costs: Costs):
    """round_ms with the line fitted once: pricing asks for many widths a round."""
    fixed, per_row = costs.line()
    return lambda rows: max(fixed + per_row * rows, MIN_MS)


def lone_depth(acceptance: Acceptance, costs: Costs, max_depth: int, step_cost: bool = True) -> int:
    """The depth k maximising E[tokens](k) / (round_ms(k+1) + k·step_ms); 0 when the plain round wins."""
    round_ms, step = _timer(costs), costs.step_ms() if step_cost else 0.0
    best, best_rate, tokens = 0, 1.0 / round_ms(1), 1.0
    for k, reach in enumerate(acceptance.reach(max_depth), start=1):
        tokens += reach
        rate = tokens / (round_ms(k + 1) + k * step)
        if rate > best_rate:  # strict: a tie keeps the shallower window
            best, best_rate = k, rate
    return best


def shared_depths(acceptances: Sequence[Acceptance], costs: Costs, max_depths: Sequence[int],
                  step_cost: bool | Sequence[bool] = True, extra_rows: int = 0,
                  rounds: Costs | None = None) -> list[int]:
    """Each stream's depth for the round's most tokens per ms, priced as a whole; 0 only where drafting doesn't pay."""
    n = len(acceptances)
    # step_cost False (for all, or per stream) marks copy drafts: they cost rows but no drafter steps
    steps = [step_cost] * n if isinstance(step_cost, bool) else list(step_cost)
    # `rounds`: a line timed on rounds like this one, where there is one; else the lone line times it
    round_ms, step = _timer(rounds if rounds is not None and rounds.timed else costs), costs.step_ms()
    base_rows = n + extra_rows  # extra rows carry no drafts (a prompt chunk) but lengthen the round
    best, best_rate = [0] * n, n / round_ms(base_rows)
    # a stream's k-th draft adds reach[k-1] tokens for one row; reaches fall with depth, so the best m offers
    # over all streams are a prefix of each stream's and the most tokens any m more rows can buy
    offers = sorted((-r, i, k) for i, (a, m) in enumerate(zip(acceptances, max_depths))
                    for k, r in enumerate(a.reach(m)))
    deepest = max((m for m, s in zip(max_depths, steps) if s), default=0)
    # no rate past a chain of `top` steps beats every offer's tokens over the cheapest drafted round and that chain
    most_tokens, least_ms = n - sum(neg_reach for neg_reach, _, _ in offers), round_ms(base_rows + 1)
    for top in range(deepest + 1):  # the deepest drafter chain this round may run
        if offers and most_tokens / (least_ms + top * step) <= best_rate:
            break  # a longer chain only costs more
        # one propose call batches every stream's steps, so chains run side by side and the round waits for the longest
        counts, tokens, rows, chain, top_rate = [0] * n, float(n), base_rows, top * step, 0.0
        for neg_reach, i, k in offers:
            if steps[i] and k >= top:
                continue
            tokens, rows = tokens - neg_reach, rows + 1
            counts[i] += 1
            rate = tokens / (round_ms(rows) + chain)
            # falling gains over a line's rising cost: once the rate drops it keeps dropping
            if rate < top_rate:
                break
            top_rate = rate
            if rate > best_rate:
                best, best_rate = counts.copy(), rate
    return best
