"""The DSpark drafter: each stream's tapped target rows absorbed into its lane, then a hold drafts a block."""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import traceback
from typing import Sequence, cast

import mlx.core as mx

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import DrafterError
from tensorfold_core.families import GROW_STEP
from tensorfold_core.hold_costs import HOLD_BLOCKS, HOLD_DEPTHS, HoldCosts
from tensorfold_core.protocols import (DEPTH_RULE, AheadAsk, Cache, DraftAsk, DrafterFacts, HeldDrafts,
                                       Model as TargetModel, TappedModel, TappedRows, held_on_target_wanted)
from tensorfold_core.sequences import common_prefix
from tensorfold_core.specs import DrafterOptions

from .lane import Lane
from .load import BITS, args_of, load
from .model import AheadBlock, Block, Model, Span
from .serving import serve_kernels

CATCH_UP_ROWS = 16  # a lane lagging by more rows (a prompt, a stretch stood aside) is absorbed before the chain
WARM_UP_ID = -1  # a stream id no lane core hands out
HOLD_ROWS = 32  # block rows one hold pass takes: a shared round's holds are cut to fit one
SLACK = 1  # drafts a hold adds past a full grant, and a probe's hold after a grant of none (the seed's draft_slack)
# context rows a hold may catch up: past them the lane keeps the last ones, with a cut (absorbing a row runs fc and
# every layer's k/v as 8-bit matmuls: a 1,800-token prompt took 0.8 s on the fast CPU configuration, 50 plain rounds)
HOLD_CATCH_UP = 256
TIMING_REPEATS = 3  # each warm-up hold pass is timed this many times and its best kept (a preempted one reads long)
# "1": where holds stay on the device, a catch-up's absorb is left to the hold's async eval instead of waited on (a
# measurement: bench variant `:lazy-catch-up`; the wait cost 4-12 ms a stream back from standing aside on an H100)
LAZY_CATCH_UP_ENV = "TENSORFOLD_DSPARK_LAZY_CATCH_UP"


# ---- admission: which checkpoints, which target, which width (core has checked the tokenizer) ----

def matches(ckpt: Checkpoint) -> bool:
    """A checkpoint in the published DFlash/DSpark layout: config.json carries a dflash_config object."""
    return isinstance(ckpt.config.get("dflash_config"), dict)


def admit(target: TargetModel, drafter_ckpt: Checkpoint, bits: int | None = None) -> None:
    """Refuse a width other than 8 bits, a target without taps, and a target whose layers, width or vocabulary
    differ from the ones the drafter was trained on."""
    name = drafter_ckpt.path.name
    if bits is not None and bits != BITS:
        raise DrafterError(f"--drafter-bits {bits}: the dspark drafter serves {name}'s linears as 8-bit MLX affine "
                           "codes, quantized at load from its float checkpoint; pass --drafter-bits 8 or leave the "
                           "flag out")
    args = args_of(drafter_ckpt)
    if not target.taps:
        raise DrafterError(f"drafter {name}: a DSpark drafter reads the target's layer taps, and the "
                           f"{target.model_type} family has none (it drafts for lfm2 and lfm2_moe targets)")
    tapped = cast(TappedModel, target)
    for key, want, got in (("dflash_config.num_target_layers", args.num_target_layers, tapped.taps),
                           ("hidden_size", args.hidden_size, tapped.hidden_size),
                           ("vocab_size", args.vocab_size, tapped.vocab_size)):
        if want != got:
            raise DrafterError(f"drafter {name}: its {key} is {want}, the {target.model_type} target's is {got}; "
                               "a DSpark drafter drafts only for the target it was trained on")


# ---- the drafter ----

@dataclasses.dataclass
class QueuedHold:
    """A hold queued before its stream's verify was read (`hold_ahead`): its drafts and where its window stood."""

    drafts: HeldDrafts
    start: int  # the verify window's first position
    tokens: int = -1  # the stream's token count its drafts follow, once the host read the verify (-1: not yet)
    pending: int = -1  # the token they follow


@dataclasses.dataclass(frozen=True)
class KeptLane:
    """A lane kept with a prompt state (a `KeptContext`): the context of its state's first `tokens` tokens."""

    lane: Lane
    tokens: int

    @property
    def nbytes(self) -> int:
        return self.lane.nbytes


class DSparkDrafter:
    """A `Drafter`: rows the target committed are absorbed into each stream's lane (its context keys and values),
    then a hold runs each asking stream's block [pending token, mask tokens] and picks drafts row after row."""

    name = "dspark"

    def __init__(self, model: Model, target: TappedModel, *, eos_ids: frozenset[int], options: DrafterOptions):
        self.model, self.target = model, target
        args = model.args
        self.block_size = min(args.block_size, options.max_depth)  # the most rows a block was trained with
        self.mask_id = args.mask_token_id
        self.eos_ids = eos_ids
        self.max_kept = options.max_kept
        self.dtype = target.dtype
        self.shape = (args.num_hidden_layers, args.num_key_value_heads, args.head_dim)
        self.lanes: dict[int, Lane] = {}  # live streams' lanes
        self.kept: list[Lane] = []  # released lanes, oldest first, adopted by a stream sharing their prefix
        # with a confidence head the lane core grants verify rows by the drafts' chances; without one, the depth rule
        # and its hold, a pass of its own, is priced by the holds timed below (the depth rule prices chain steps)
        # either way its lanes are kept with the prompt states, so a resumed stream drafts from its whole context
        self.facts = (DrafterFacts(chances=True, slack=SLACK, hold_rows=HOLD_ROWS, hold_costs=True,
                                   shared_guard=True, lone_guard=True, catch_up=HOLD_CATCH_UP, kept_context=True,
                                   hold_ahead=True)
                      if args.confidence else dataclasses.replace(DEPTH_RULE, kept_context=True, hold_ahead=True))
        if held_on_target_wanted():
            self.facts = dataclasses.replace(self.facts, held_on_target=True)
        self.lazy_catch_up = os.environ.get(LAZY_CATCH_UP_ENV, "0") == "1"
        # the hold's Markov step, and what serves each of the drafter's ops here (ops.py's table)
        self.pick, self.kernels = serve_kernels(model)
        self.holds = HoldCosts()  # timed by `time_holds` after the warm-up, then moved toward each settled hold
        self.last_hold: tuple[int, int, float] | None = None  # (blocks, deepest drafts, wall ms) of the last hold
        self._chances: dict[int, list[float]] = {}  # per stream, its last hold: the chance each draft and all before
        self._depths: dict[int, int] = {}  # per stream, the drafts its last ask asked (a queued hold's depth)
        self._ahead: dict[int, QueuedHold] = {}  # per stream, the hold queued on its last verify's device draws
        self.stats = dict(holds=0, held=0, absorbed=0, lane_reuses=0, lane_resumes=0, ahead=0, ahead_used=0,
                          ahead_missed=0)

    # -- what the ledger reads: a lane is sized at admission and never grows while its stream decodes --

    def lane_capacity(self, tokens: int) -> int:
        """Context rows a lane is made for, for a stream of at most `tokens`, in the caches' steps."""
        return -(-tokens // GROW_STEP) * GROW_STEP

    def slot_bytes_for(self, tokens: int) -> int:
        return Lane.bytes_for(*self.shape, self.lane_capacity(tokens), self.dtype)

    def kept_bytes(self) -> int:
        return sum(lane.nbytes for lane in self.kept)

    def shed_kept(self, wanted_bytes: int | None = None) -> int:
        freed = 0
        while self.kept and (wanted_bytes is None or freed < wanted_bytes):
            freed += self.kept.pop(0).nbytes
        if freed:
            mx.clear_cache()
        return freed

    # -- the Proposer protocol --

    def release(self, stream_id: int) -> None:
        """Keep the stream's lane for a later request sharing its uncut prefix, or for the prompt state the host may
        keep of the stream (`keep_context`, cuts and all); the oldest kept give way."""
        lane = self.lanes.pop(stream_id, None)
        self._chances.pop(stream_id, None)
        self._depths.pop(stream_id, None)
        self._ahead.pop(stream_id, None)
        if lane is None:
            return
        lane.pending = []
        lane.tokens = tuple(lane.tokens)  # the stream's own list, which it no longer extends
        if lane.n:
            self._keep(lane)

    def _keep(self, lane: Lane) -> None:
        # a cut lane has no prefix to share: it stays only for `keep_context`, which runs right after its release
        self.kept = [kept for kept in self.kept if kept.whole]
        if self.max_kept:
            self.kept.append(lane)
        excess = len(self.kept) - self.max_kept
        if excess > 0:
            del self.kept[:excess]
            mx.clear_cache()

    def keep_context(self, stream_id: int, tokens: Sequence[int], cache: Cache) -> KeptLane | None:
        """The released lane of the stream, its rows since the last hold absorbed from `cache`, copied to the size
        of `tokens` (the prompt state the host keeps); the lane leaves the kept ones."""
        lane = next((kept for kept in reversed(self.kept) if kept.stream == stream_id), None)
        if lane is None:
            return None
        self.kept.remove(lane)
        taken = self.target.take_features(cache)
        if taken is not None:
            lane.pending.append(taken)
        try:
            self._absorb([(lane, None)])
            kept = lane.copy(len(tokens), self.lane_capacity(len(tokens)), self.dtype)
        except Exception:  # the state is kept without a context; the stream that resumes it absorbs its own
            return None
        kept.tokens = tuple(tokens)
        return KeptLane(kept, len(tokens))

    def resume_context(self, stream_id: int, context: KeptLane, tokens: Sequence[int], limit: int) -> None:
        """The stream's lane starts as a copy of the kept lane's rows before its resume point."""
        lane = context.lane.copy(len(tokens), self.lane_capacity(max(limit, len(tokens))), self.dtype)
        lane.stream, lane.tokens = stream_id, tokens
        self.lanes[stream_id] = lane
        self.stats["lane_resumes"] += 1

    def return_context(self, context: KeptLane) -> None:
        """A kept lane whose prompt state was not kept joins the kept lanes."""
        self._keep(context.lane)

    def catch_up(self, asks: Sequence[DraftAsk]) -> int:
        """Absorb the lanes lagging by more than a round's rows (their prompts, or rows committed while they stood
        aside); the rows absorbed (0: nothing ran)."""
        work = self._sync(asks)
        lagging = [(lane, bound) for _, lane, _, bound in work if lane.pending_rows() > CATCH_UP_ROWS]
        try:
            rows = self._absorb(lagging)
            if not (self.lazy_catch_up and self.facts.held_on_target):
                mx.eval([a for lane, _ in lagging for a in lane.keys + lane.values])
        except Exception:
            self._drop([lane for lane, _ in lagging])
            raise
        return rows

    def hold_ms(self, blocks: int, depth: int) -> float:
        """The hold pass's price in wall ms (0 until `time_holds` ran)."""
        return self.holds.ms(blocks, depth)

    def chances(self, stream_id: int) -> list[float] | None:
        """The running products of the confidences of the drafts the last settled hold gave the stream (a hold
        settles before `propose` returns, or, held on the device, when the verify reads its drafts: until then the
        last settled ones price it); None where it held none."""
        return self._chances.get(stream_id)

    def propose(self, asks: Sequence[DraftAsk]) -> list:
        """Each ask's block drafts: its lane absorbs the rows verified since its last hold, in the hold's graph
        (`HeldDrafts` on the device where the facts say held_on_target)."""
        return self._propose(asks, held=self.facts.held_on_target)

    def _propose(self, asks: Sequence[DraftAsk], held: bool) -> list:
        drafts: list = [[] for _ in asks]
        work = [w for w in self._sync(asks) if not self._take_ahead(asks[w[0]], w[2], drafts, w[0])]
        if not held:
            for i, ask in enumerate(asks):  # a stream asked but not held this time has no chances to report
                if not isinstance(drafts[i], HeldDrafts):
                    self._chances.pop(ask.stream_id, None)
        if not work:
            return drafts
        work.sort(key=lambda w: -w[2])  # deepest first: each Markov step's streams are a prefix of the last's
        lanes = [lane for _, lane, _, _ in work]
        if held:
            return self._propose_held(asks, work, lanes, drafts)
        start = time.perf_counter()
        try:
            self._absorb([(lane, bound) for _, lane, _, bound in work])
            steps, flags, chances = self._hold([asks[i].tokens for i, _, _, _ in work], lanes, [w[2] for w in work])
        except Exception:
            self._drop(lanes)
            raise
        # the hold settled (its drafts read back): its wall time, the verified rows it absorbed included, teaches
        # the price of passes like it, so the price follows the contexts served
        self.last_hold = (len(work), work[0][2], (time.perf_counter() - start) * 1000.0)
        self.holds.settle(*self.last_hold)
        self.stats["holds"] += 1
        for j, (i, _, depth, _) in enumerate(work):
            chain = [steps[s][j] for s in range(depth)]
            bad = next((s for s in range(depth) if flags[s][j]), depth)  # a NaN row's draft and all after it
            end = next((k + 1 for k, t in enumerate(chain[:bad]) if t in self.eos_ids), bad)
            drafts[i] = chain[:end]
            if chances:
                running, out = 1.0, []
                for s in range(end):
                    running *= chances[s][j]
                    out.append(running)
                self._chances[asks[i].stream_id] = out
        return drafts

    def _sync(self, asks: Sequence[DraftAsk]) -> list[tuple[int, Lane, int, int | None]]:
        """(ask index, lane, depth, catch-up bound) per ask the drafter drafts for; each lane takes the rows its
        stream's target cache committed since the last ask."""
        out, seen = [], set()
        for i, ask in enumerate(asks):
            if ask.stream_id in seen:
                raise ValueError(f"stream {ask.stream_id} asks twice in one call")
            seen.add(ask.stream_id)
            depth = min(int(ask.depth), self.block_size)
            tokens = ask.tokens
            if depth <= 0 or not tokens or not 0 <= tokens[-1] < self.target.vocab_size:
                continue
            lane = self._lane(ask.stream_id, tokens, ask.limit)
            lane.tokens = tokens
            self._depths[ask.stream_id] = depth
            if ask.cache is not None:
                taken = self.target.take_features(ask.cache)
                if taken is not None:
                    lane.pending.append(taken)
            out.append((i, lane, depth, ask.catch_up))
        return out

    def _absorb(self, work: list[tuple[Lane, int | None]]) -> int:
        """fc + hidden_norm over every lane's fresh rows at once, then each layer's keys and values into the lanes
        (lazy: the caller evaluates); the rows absorbed."""
        pieces = [(lane, piece) for lane, bound in work for piece in lane.fresh(bound)]
        if not pieces:
            return 0
        written = self._context_of(pieces)
        self._write(written)
        for lane, piece in pieces:
            lane.advance(piece.start, piece.rows.shape[0])
        rows = sum(piece.rows.shape[0] for _, piece in pieces)
        self.stats["absorbed"] += rows
        return rows

    def _context_of(self, pieces: list[tuple[Lane, TappedRows]]) -> list[tuple[Lane, list]]:
        """Each piece's keys and values a layer, from one fc + hidden_norm over every piece's tapped rows."""
        rows = [piece.rows for _, piece in pieces]
        c = self.model.context_rows((rows[0] if len(rows) == 1 else mx.concatenate(rows)).astype(self.dtype))
        spans, at = [], 0
        for _, piece in pieces:
            spans.append(Span(at, piece.rows.shape[0], piece.start))
            at += piece.rows.shape[0]
        layers = self.model.context(c, spans)
        return [(lane, [per_span[j] for per_span in layers]) for j, (lane, _) in enumerate(pieces)]

    def _write(self, written: list[tuple[Lane, list]]) -> None:
        """Each lane's new rows into its buffers from its row n (its host length moves apart: `Lane.advance`)."""
        for lane, layers in written:
            for layer, (keys, values) in enumerate(layers):
                lane.write(layer, keys, values)

    def _propose_held(self, asks: Sequence[DraftAsk], work: list, lanes: list[Lane], drafts: list) -> list:
        """The hold launched and not waited on: each stream's drafts stay on the device (`HeldDrafts`) until its
        verify has read its logits. Until then its chances are its last settled hold's (seed 002), its NaN flags and
        eos cut nothing (such drafts are verified and rejected), and the hold is not timed (the host's clock would
        hold the verify's forward too): its price stays the one timed at warm-up."""
        try:
            self._absorb([(lane, bound) for _, lane, _, bound in work])
            steps, flags, chances = self._hold_graph([asks[i].tokens for i, _, _, _ in work], lanes,
                                                     [w[2] for w in work])
            mx.async_eval(steps, flags, chances, [a for lane in lanes for a in lane.keys + lane.values])
        except Exception:
            self._drop(lanes)
            raise
        self.stats["holds"] += 1
        self.stats["held"] += 1
        for (i, _, depth, _), held_drafts in zip(work, self._hand_held(steps, chances, [(asks[i].stream_id, depth)
                                                                                      for i, _, depth, _ in work])):
            drafts[i] = held_drafts
        return drafts

    def _hand_held(self, steps: list[mx.array], chances: list[mx.array],
                   streams: list[tuple[int, int]]) -> list[HeldDrafts]:
        """Each (stream, depth)'s drafts of a launched hold, on the device; the first read settles them all: the
        picks on the host, and their chances become the streams' settled ones."""
        settled: list = []

        def settle() -> list[list[int]]:
            if not settled:
                settled.append([s.tolist() for s in steps])
                values = [c.tolist() for c in chances]
                for j, (stream_id, depth) in enumerate(streams):
                    running, out = 1.0, []
                    for s in range(depth if values else 0):
                        running *= values[s][j]
                        out.append(running)
                    if out:
                        self._chances[stream_id] = out
            return settled[0]

        return [HeldDrafts(mx.concatenate([steps[s][j:j + 1] for s in range(depth)]),
                           lambda j=j, depth=depth: [settle()[s][j] for s in range(depth)])
                for j, (_, depth) in enumerate(streams)]

    # -- holds queued before the host reads the verify (`facts.hold_ahead`) --

    def hold_ahead(self, asks: Sequence[AheadAsk]) -> list[int]:
        """Each ask's next hold on its verify's device values, launched and not waited on: the lane absorbs the
        window's rows at once (the rows past the acceptance masked, and overwritten by the next absorb) and the block
        starts from the verify's bonus draw; the streams queued (a lane not caught up to the window holds in step)."""
        # a queued hold its stream's next round did not take stays until the stream's next queue or its release: it
        # can never be taken, since every round commits a token and `_take_ahead` matches the token count
        work = []
        for ask in asks:
            lane = self.lanes.get(ask.stream_id)
            # the grant that sets the next ask is read with the verify: one draft past the last ask covers a full
            # grant's slack, and the next ask cuts the queued drafts to its own depth
            last = self._depths.get(ask.stream_id, 0)
            depth = min(last + self.facts.slack, ask.max_depth, self.block_size)
            if lane is not None and last > 0 and depth > 0 and lane.end == ask.start and not lane.pending:
                work.append((ask, lane, depth))
        if not work:
            return []
        work.sort(key=lambda w: -w[2])  # deepest first, as `_hold_graph` steps them
        cap = max(1, HOLD_ROWS // len(work))  # the queued blocks fit one hold pass
        depths = [min(depth, cap) for _, _, depth in work]
        lanes = [lane for _, lane, _ in work]
        try:
            # written from row n on, which stays the host's length until `settle_ahead`
            self._write(self._context_of([(lane, TappedRows(ask.start, ask.rows)) for ask, lane, _ in work]))
            ids, blocks, row = [], [], 0
            for (ask, lane, _), depth in zip(work, depths):
                ids += [ask.pending.reshape(1)] + ([mx.full((depth - 1,), self.mask_id, mx.uint32)] if depth > 1
                                                    else [])
                positions = ask.start + 1 + ask.accepted + mx.arange(depth, dtype=mx.int32)
                blocks.append(AheadBlock(row, depth, positions, lane, lane.n + 1 + ask.accepted,
                                         lane.n + ask.rows.shape[0]))
                row += depth
            previous = mx.concatenate([ask.pending.reshape(1) for ask, _, _ in work])
            steps, flags, chances = self._draft_blocks(mx.concatenate(ids), blocks, previous, depths)
            mx.async_eval(steps, flags, chances, [a for lane in lanes for a in lane.keys + lane.values])
        except Exception:  # the streams' lanes start afresh; their next holds run in step
            self._drop(lanes)
            return []
        held = self._hand_held(steps, chances, [(ask.stream_id, depth) for (ask, _, _), depth in zip(work, depths)])
        for (ask, _, _), drafts in zip(work, held):
            self._ahead[ask.stream_id] = QueuedHold(drafts, ask.start)
        self.stats["holds"] += 1
        self.stats["ahead"] += len(work)
        return [ask.stream_id for ask, _, _ in work]

    def settle_ahead(self, stream_id: int, accepted: int, pending: int, queued_on: tuple[int, int]) -> None:
        """The host read the verify: the lane keeps the window's first 1 + accepted rows (the target's rows of the
        committed tokens, whatever the device's acceptance), and the queued drafts follow `pending` at the stream's
        next ask where the device queued them on the host's acceptance and draw (`queued_on`)."""
        queued, lane = self._ahead.get(stream_id), self.lanes.get(stream_id)
        if queued is None or lane is None:
            return
        lane.advance(queued.start, 1 + accepted)
        if tuple(queued_on) == (accepted, pending):
            queued.tokens, queued.pending = queued.start + accepted + 2, pending
        else:  # a draw the device made otherwise: the block ran from another context
            del self._ahead[stream_id]
            self.stats["ahead_missed"] += 1

    def _take_ahead(self, ask: DraftAsk, depth: int, drafts: list, i: int) -> bool:
        """Whether the ask's stream has a queued hold for the context it asks with: its first `depth` drafts."""
        queued = self._ahead.pop(ask.stream_id, None)
        if queued is None or queued.tokens != len(ask.tokens) or queued.pending != ask.tokens[-1]:
            return False
        drafts[i] = queued.drafts[:depth]
        self.stats["ahead_used"] += 1
        return True

    def _hold(self, contexts: list[Sequence[int]], lanes: list[Lane], depths: list[int]):
        """The hold's graph, then one eval for the whole hold, the lanes' absorbed rows included: its picks, NaN
        flags and confidences on the host."""
        steps, flags, chances = self._hold_graph(contexts, lanes, depths)
        mx.eval(steps, flags, chances, [a for lane in lanes for a in lane.keys + lane.values])
        return [s.tolist() for s in steps], [f.tolist() for f in flags], [c.tolist() for c in chances]

    def _hold_graph(self, contexts: list[Sequence[int]], lanes: list[Lane], depths: list[int]):
        """One pass over every block, the target's head, then the Markov head row after row (ties to the lowest
        id), lazily: each step's picks, NaN flags and confidences."""
        ids, blocks, row = [], [], 0
        for context, lane, depth in zip(contexts, lanes, depths):
            ids += [context[-1]] + [self.mask_id] * (depth - 1)
            blocks.append(Block(row, depth, len(context) - 1, lane))  # the pending token's own position
            row += depth
        previous = mx.array([context[-1] for context in contexts], dtype=mx.uint32)
        return self._draft_blocks(mx.array(ids, dtype=mx.uint32), blocks, previous, depths)

    def _draft_blocks(self, ids: mx.array, blocks: list, previous: mx.array, depths: list[int]):
        """The blocks' layers and the target's head, then each step's Markov picks (deepest block first)."""
        final = self.model.blocks(self.target.embed(ids), blocks)
        logits = self.target.head(final)
        steps, flags, rows, before = [], [], [], []
        for step in range(depths[0]):
            m = sum(1 for d in depths if d > step)
            rows.append([block.start + step for block in blocks[:m]])
            previous = previous[:m]
            before.append(previous)
            token, flag = self.pick(logits[mx.array(rows[-1])], previous)
            flags.append(flag)
            steps.append(token)
            previous = token.astype(mx.uint32)
        return steps, flags, self._confidences(final, rows, before)

    def _confidences(self, final: mx.array, rows: list[list[int]], before: list[mx.array]) -> list[mx.array]:
        """Each step's confidences, from one call over every step's rows (none reads a confidence, so they wait
        for the last pick): per step, the rows' final states and the tokens before their drafts; [] with no head."""
        if not self.model.args.confidence:
            return []
        joined = [r for step in rows for r in step]
        chance = self.model.confidence(final[mx.array(joined)], before[0] if len(before) == 1 else
                                       mx.concatenate(before))
        out, at = [], 0
        for step in rows:
            out.append(chance[at:at + len(step)])
            at += len(step)
        return out

    def _drop(self, lanes: list[Lane]) -> None:
        """Lanes whose arrays hold a graph that failed: their streams start afresh at the next ask."""
        failed = {id(lane) for lane in lanes}
        self.lanes = {k: lane for k, lane in self.lanes.items() if id(lane) not in failed}

    def _lane(self, stream_id: int, tokens: Sequence[int], limit: int) -> Lane:
        """The stream's lane; a new stream's is made at the size priced at admission, holding the longest prefix
        of its context a kept or live lane shares (a live one is copied, a kept one taken over)."""
        lane = self.lanes.get(stream_id)
        if lane is not None:
            return lane
        capacity = self.lane_capacity(max(limit, len(tokens)))
        best, shared = None, 0
        for other in [*self.kept, *self.lanes.values()]:  # kept oldest first: ">=" prefers the newest
            n = min(common_prefix(other.tokens, tokens), other.whole, len(tokens) - 1)
            if n and n >= shared:
                best, shared = other, n
        if best is None:
            lane = Lane(*self.shape, capacity, self.dtype)
        else:
            self.stats["lane_reuses"] += 1
            if any(best is kept for kept in self.kept):
                self.kept = [kept for kept in self.kept if kept is not best]
                if best.capacity == capacity:
                    best.trim(shared)
                    best.stream = stream_id
                    self.lanes[stream_id] = best
                    return best
            lane = best.copy(shared, capacity, self.dtype)
        lane.stream = stream_id
        self.lanes[stream_id] = lane
        return lane

    # -- start and stop --

    def warm_up(self) -> None:
        """One short hold over a real target cache, so a drafter that cannot run fails at start."""
        cache = self.target.new_cache(8)
        try:
            self.target.forward([cache], [[0, 0]], [0])
            self.target.keep(cache, 2)
            self._propose([DraftAsk(WARM_UP_ID, [0, 0, 0], 2, limit=8, cache=cache)], held=False)
        finally:
            self.lanes.pop(WARM_UP_ID, None)
            self._chances.pop(WARM_UP_ID, None)
        self.stats = dict.fromkeys(self.stats, 0)

    def time_holds(self, repeats: int = TIMING_REPEATS) -> None:
        """Time hold passes of each of HOLD_BLOCKS blocks at each of HOLD_DEPTHS drafts (fewer where the blocks
        would pass one hold pass), on lanes of no context, the best of `repeats`; they price every hold from now."""
        timed = HoldCosts()
        ids = [WARM_UP_ID - i for i in range(max(HOLD_BLOCKS))]
        try:
            for blocks in HOLD_BLOCKS:
                for depth in sorted({min(d, self.block_size, max(1, HOLD_ROWS // blocks)) for d in HOLD_DEPTHS}):
                    asks = [DraftAsk(i, [0, 0], depth, limit=GROW_STEP) for i in ids[:blocks]]
                    times = []
                    for _ in range(repeats):
                        self._propose(asks, held=False)
                        times.append(self.last_hold[2])
                    timed.time(blocks, depth, min(times))
        finally:
            for i in ids:
                self.lanes.pop(i, None)
                self._chances.pop(i, None)
        self.holds = timed
        self.stats = dict.fromkeys(self.stats, 0)

    def close(self) -> None:
        """Drop every lane, live or kept, stop the target's taps, and give MLX's cached buffers back."""
        self.lanes.clear()
        self._ahead.clear()
        self.kept.clear()
        self._chances.clear()
        self.target.features([])
        mx.clear_cache()


def start(target: TargetModel, drafter_ckpt: Checkpoint, options: DrafterOptions = DrafterOptions()) -> DSparkDrafter:
    """Load the drafter (8-bit, one matrix at a time), tap the target's layers and warm up; a failure frees it."""
    name = drafter_ckpt.path.name
    admit(target, drafter_ckpt)
    tapped = cast(TappedModel, target)
    eos_ids = options.eos_ids if options.eos_ids is not None else frozenset(drafter_ckpt.tokenizer().eos_ids)
    model = load(drafter_ckpt, tapped.dtype)  # a layout error is a CheckpointError naming the key or tensor
    try:
        tapped.features(model.args.target_layer_ids)
    except ValueError as exc:
        raise DrafterError(f"drafter {name}: the target cannot tap its layers ({exc})") from exc
    drafter = DSparkDrafter(model, tapped, eos_ids=eos_ids, options=options)
    del model  # the drafter owns the weights from here: freeing it frees them
    try:
        drafter.warm_up()
        if drafter.facts.hold_costs:
            drafter.time_holds()
    except Exception as exc:
        drafter.close()
        del drafter
        # the traceback's frames would keep the drafter (their `self`) alive for as long as the error lives
        traceback.clear_frames(exc.__traceback__)
        gc.collect()
        mx.clear_cache()
        raise DrafterError(f"drafter {name}: warm-up failed ({type(exc).__name__}: {exc}); the drafter was freed") \
            from exc
    return drafter
