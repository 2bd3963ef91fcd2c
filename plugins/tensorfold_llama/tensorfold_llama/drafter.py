"""The llama drafter: a smaller same-tokenizer llama proposing greedy chains, one cache (slot) per stream."""

from __future__ import annotations

import dataclasses
import gc
import os
import traceback
from typing import Sequence

import mlx.core as mx

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError, DrafterError
from tensorfold_core.families import GROW_STEP
from tensorfold_core.kernels import DRAFTER_BUILTIN_ENV
from tensorfold_core.protocols import DEPTH_RULE, DraftAsk, HeldDrafts, Model as TargetModel, held_on_target_wanted
from tensorfold_core.quantized import serve_codes
from tensorfold_core.sequences import common_prefix
from tensorfold_core.specs import DrafterOptions, LoadOptions

from .load import load
from .cache import KVCache
from .model import Model

MODEL_TYPES = ("llama", "mistral")
BITS = (0, 4, 8)
WARM_UP_ID = -1  # a stream id no lane core hands out


# ---- admission: which checkpoints, which width (core has checked the tokenizer) ----

def matches(ckpt: Checkpoint) -> bool:
    """A llama or mistral checkpoint can draft."""
    try:
        return ckpt.model_type in MODEL_TYPES
    except CheckpointError:
        return False


def _held(ckpt: Checkpoint) -> tuple[int, str]:
    """(bits, words) of the weights a checkpoint holds: (4, "4-bit") for MLX affine, (0, "bfloat16") for float."""
    quant = ckpt.quantization
    if quant is not None:
        bits = quant.get("bits")
        return bits, f"{bits}-bit"
    dtype = ckpt.config.get("dtype") or ckpt.config.get("torch_dtype")
    if not isinstance(dtype, str):  # older configs omit it: the first float tensor tells
        dtype = next((str(v.dtype).removeprefix("mlx.core.") for v in ckpt.tensors().values()
                      if mx.issubdtype(v.dtype, mx.floating)), "float")
    return 0, dtype


def admit(target: TargetModel, drafter_ckpt: Checkpoint, bits: int | None = None) -> None:
    """Refuse a checkpoint this drafter does not read, or whose weights are not `bits` wide (None: any)."""
    name = drafter_ckpt.path.name
    if not matches(drafter_ckpt):
        raise DrafterError(f"drafter {name}: model_type {drafter_ckpt.config.get('model_type')!r} is not drafted "
                           f"by the llama drafter ({', '.join(MODEL_TYPES)})")
    if bits is None:
        return
    if bits not in BITS:
        raise DrafterError(f"--drafter-bits {bits}: expected 0 (the float checkpoint), 4 or 8")
    held, words = _held(drafter_ckpt)
    if held != bits:
        other = "a float checkpoint" if bits == 0 else f"{'an' if bits == 8 else 'a'} {bits}-bit checkpoint"
        raise DrafterError(f"--drafter-bits {bits}: {name} holds {words} weights; "
                           f"pass --drafter-bits {held} or {other}")


# ---- the drafter ----

class Slot:
    """One stream's drafter cache and the tokens it was fed (context, then the drafts fed back)."""

    __slots__ = ("cache", "tokens", "skipped", "cut", "whole", "unread")

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.tokens: list[int] = []
        # a bounded catch-up skips context tokens: from `cut` on, tokens[i] is the context's [i + skipped]; rotary
        # positions are relative, so the drafter reads the cut context as if it were whole
        self.skipped = 0
        self.cut = 0
        self.whole = 0  # leading tokens equal to the context's own prefix (before any cut)
        self.unread: object | None = None  # a held chain fed to the cache whose drafts the host has not read yet

    def trim(self, tokens: int) -> None:
        self.unread = None  # a held chain read after this cannot say which rows it fed
        self.cache.trim(tokens)
        del self.tokens[tokens:]
        self.whole = min(self.whole, tokens)
        self.cut = min(self.cut, tokens)

    def feed(self, context: list[int], limit: int | None) -> list[int]:
        """Trim to the context and return the rows still to feed, at most `limit` of them plus the last one."""
        start = self.cut + common_prefix(self.tokens, context, self.cut, self.cut + self.skipped)
        # the last context token is always fed: its row gives the first draft
        start = min(start, len(context) - self.skipped - 1)
        self.trim(start)
        rows = context[start + self.skipped:]
        if limit is not None and len(rows) > limit + 1:
            skip = len(rows) - limit - 1
            self.skipped, self.cut, rows = self.skipped + skip, start, rows[skip:]
        return rows

    def fed(self, rows: list[int]) -> None:
        self.tokens += rows
        if not self.skipped:
            self.whole = len(self.tokens)


def _nbytes(cache: KVCache) -> int:
    """Bytes a slot's cache really holds (its arrays), whatever capacity it was made with."""
    return sum(a.nbytes for a in cache.keys + cache.values)


class LlamaDrafter:
    """A `Drafter`: greedy chains of a small llama, batched over every asking stream, evaluated once a call."""

    name = "llama"

    def __init__(self, model: Model, *, vocab_limit: int, eos_ids: frozenset[int], options: DrafterOptions,
                 source: str = ""):
        # no chances: the core's depth rule prices its drafts; on a GPU its chains stay on the device for the verify
        self.facts = dataclasses.replace(DEPTH_RULE, held_on_target=held_on_target_wanted())
        self.model = model
        self.vocab_limit = min(vocab_limit, model.vocab_size)  # padded drafter rows are never valid target ids
        self.eos_ids = eos_ids
        self.max_depth = options.max_depth
        self.max_kept = options.max_kept
        self.source = source
        self.slots: dict[int, Slot] = {}  # live streams' slots
        self.kept: list[Slot] = []  # released slots, oldest first, adopted by a stream sharing their prefix
        self.stats = dict(proposals=0, forwards=0, rows=0, slot_reuses=0)

    @property
    def kernels(self) -> dict:
        """What serves each of the drafter model's row-path ops here (the llama table, as the target's)."""
        return self.model.kernels

    # -- what the ledger reads: a slot is sized at admission and never grows while its stream decodes --

    def slot_capacity(self, tokens: int) -> int:
        """Tokens a slot is made for, for a stream of at most `tokens`: its chain's drafts fit too, and capacities
        come in the cache's steps (and its model's size classes) so a kept slot often fits a later stream as it is."""
        return self.model.capacity_for(-(-(tokens + self.max_depth) // GROW_STEP) * GROW_STEP)

    def slot_bytes(self) -> int:
        """Bytes the live streams' slots hold."""
        return sum(_nbytes(s.cache) for s in self.slots.values())

    def slot_bytes_for(self, tokens: int) -> int:
        """Bytes one stream's slot holds for a stream of at most `tokens` (the ledger reserves this at admission)."""
        return self.model.cache_bytes(self.slot_capacity(tokens))

    def kept_bytes(self) -> int:
        """Bytes the kept (released) slots hold: they give way first when room is needed."""
        return sum(_nbytes(s.cache) for s in self.kept)

    def shed_kept(self, wanted_bytes: int | None = None) -> int:
        """Free kept slots, oldest first, until `wanted_bytes` are freed (all of them for None); return bytes freed."""
        freed = 0
        while self.kept and (wanted_bytes is None or freed < wanted_bytes):
            freed += _nbytes(self.kept.pop(0).cache)
        if freed:
            mx.clear_cache()
        return freed

    # -- the Proposer protocol --

    def release(self, stream_id: int) -> None:
        """Keep the stream's slot for a later request sharing its prefix; the oldest kept slots give way."""
        slot = self.slots.pop(stream_id, None)
        if slot is None:
            return
        if slot.tokens and self.max_kept:
            self.kept.append(slot)
        excess = len(self.kept) - self.max_kept
        if excess > 0:
            del self.kept[:excess]
            mx.clear_cache()

    def catch_up(self, asks: Sequence[DraftAsk]) -> int:
        """Feed slots lagging more than a step all but their last context row; the rows fed (0: nothing ran)."""
        work = [(slot, rows[:-1]) for _, slot, rows, _ in self._sync(asks) if len(rows) > 2]
        if not work:
            return 0
        caches = [slot.cache for slot, _ in work]
        try:
            ids = mx.array([t for _, rows in work for t in rows], dtype=mx.uint32)
            self.model.forward_ids(caches, ids, [len(rows) for _, rows in work], [0] * len(work), commit=True)
            mx.eval([c.keys + c.values for c in caches])
        except Exception:
            self._drop(work)
            raise
        for slot, rows in work:
            slot.fed(rows)
        rows = sum(len(rows) for _, rows in work)
        self._count(rows)
        return rows

    def propose(self, asks: Sequence[DraftAsk]) -> list[list[int]] | list[HeldDrafts]:
        """Each ask's greedy chain: slots synced to the context by their common prefix, then one lazy graph; held on
        the device (`HeldDrafts`, no wait) where the facts say held_on_target, else read back, cut after an eos."""
        self.stats["proposals"] += 1
        drafts: list = [[] for _ in asks]
        work = self._sync(asks)
        if not work:
            return drafts
        work.sort(key=lambda w: -w[3])  # deepest first: each step's streams are a prefix of the last step's
        try:
            steps = self._chain([w[1].cache for w in work], [w[2] for w in work], [w[3] for w in work])
            if not self.facts.held_on_target:
                mx.eval(steps, [w[1].cache.keys + w[1].cache.values for w in work])  # no graph outlives the call
        except Exception:
            self._drop([(slot, rows) for _, slot, rows, _ in work])
            raise
        if self.facts.held_on_target:
            return self._held(drafts, work, steps)
        steps = [s.tolist() for s in steps]
        for j, (i, slot, rows, depth) in enumerate(work):
            chain = [steps[s][j] for s in range(depth)]
            slot.fed(rows + chain[:-1])  # the last draft was never fed back
            cut = next((k + 1 for k, t in enumerate(chain) if t in self.eos_ids), depth)
            drafts[i] = chain[:cut]
        return drafts

    def _held(self, drafts: list, work: list, steps: list[mx.array]) -> list:
        """Each chain as `HeldDrafts`: the verify reads it on the device. A slot is told its fed drafts when the host
        reads them, unless it was trimmed since (the next sync then trims the rows it was not told of); an eos cuts
        nothing (such drafts are verified and rejected)."""
        read: list = []

        def settle() -> list[list[int]]:
            if not read:
                read.append([s.tolist() for s in steps])
                for j, (_, slot, _, depth) in enumerate(work):
                    if slot.unread is read_marks[j]:
                        slot.fed([read[0][s][j] for s in range(depth - 1)])
            return read[0]

        read_marks = []
        for j, (i, slot, rows, depth) in enumerate(work):
            slot.fed(rows)
            slot.unread = object()
            read_marks.append(slot.unread)
            ids = mx.concatenate([steps[s][j:j + 1] for s in range(depth)])
            drafts[i] = HeldDrafts(ids, lambda j=j, depth=depth: [settle()[s][j] for s in range(depth)])
        return drafts

    def _sync(self, asks: Sequence[DraftAsk]) -> list[tuple[int, Slot, list[int], int]]:
        """(ask index, slot, rows to feed, depth) per ask the drafter can draft for, its slot trimmed to the context."""
        out, seen = [], set()
        for i, ask in enumerate(asks):
            if ask.stream_id in seen:
                raise ValueError(f"stream {ask.stream_id} asks twice in one propose call")
            seen.add(ask.stream_id)
            tokens = ask.tokens if isinstance(ask.tokens, list) else list(ask.tokens)
            depth = min(int(ask.depth), self.max_depth)
            if depth <= 0 or not tokens:
                continue
            slot = self._slot(ask.stream_id, tokens, ask.limit)
            rows = slot.feed(tokens, ask.catch_up)
            # ids the drafter cannot embed get no drafts rather than an error; only rows not yet fed need checking
            if min(rows) < 0 or max(rows) >= self.model.vocab_size:
                continue
            out.append((i, slot, rows, depth))
        return out

    def _drop(self, work) -> None:
        """Slots whose caches hold a graph that failed: the next ask starts them afresh."""
        failed = {id(slot) for slot, _ in work}
        self.slots = {k: s for k, s in self.slots.items() if id(s) not in failed}

    def _chain(self, caches: list[KVCache], feeds: list[list[int]], depths: list[int]) -> list[mx.array]:
        """Run the first (ragged) windows, then one row per stream a step, each step queued as it is built: each
        step's picks, lazy (the caller waits once for the whole chain, or lets the verify read it)."""
        model, limit = self.model, self.vocab_limit
        ids = mx.array([t for feed in feeds for t in feed], dtype=mx.uint32)
        logits = model.forward_ids(caches, ids, [len(f) for f in feeds], [1] * len(feeds), commit=True)
        self._count(sum(len(f) for f in feeds))
        # the chain may run past an eos: stopping would need a host read; the draft is cut after the eval
        token = mx.argmax(logits[:, :limit], axis=-1)  # ties go to the lowest id, as the target's greedy draw
        mx.async_eval(token)  # the device runs each step while Python builds the next, as mlx-lm's generate loop does
        steps = [token]
        for step in range(1, depths[0]):
            m = sum(1 for d in depths if d > step)
            token = token[:m]
            logits = model.forward_ids(caches[:m], token, [1] * m, [1] * m, commit=True)
            self._count(m)
            token = mx.argmax(logits[:, :limit], axis=-1)
            mx.async_eval(token)
            steps.append(token)
        mx.async_eval(steps, [c.keys + c.values for c in caches])  # the caches too, so no graph outlives the chain
        return steps

    def _count(self, rows: int) -> None:
        self.stats["forwards"] += 1
        self.stats["rows"] += rows

    def _slot(self, stream_id: int, tokens: list[int], limit: int) -> Slot:
        """The stream's slot; for a new stream one of the size priced at admission, holding the longest prefix a
        kept slot shares with the context."""
        slot = self.slots.get(stream_id)
        if slot is not None:
            return slot
        capacity = self.slot_capacity(max(limit, len(tokens)))
        best, shared = None, 0
        for kept in self.kept:  # oldest first, so ">=" prefers the newest of equal prefixes
            n = common_prefix(kept.tokens[:kept.whole], tokens)
            if n and n >= shared:
                best, shared = kept, n
        if best is None:
            slot = Slot(self.model.new_cache(capacity))
        else:
            self.kept.remove(best)
            self.stats["slot_reuses"] += 1
            best.trim(shared)  # only its uncut prefix stands for this context
            best.skipped = best.cut = 0
            slot = best if best.cache.capacity == capacity else self._resized(best, capacity)
        self.slots[stream_id] = slot
        return slot

    def _resized(self, kept: Slot, capacity: int) -> Slot:
        """A kept slot's tokens in a cache of the admitted size: the old one goes once copied (while both live,
        the ledger holds the kept slot and the stream's reservation alike)."""
        cache = self.model.new_cache(capacity)
        cache.restore(kept.cache.snapshot(), kept.cache.offset)  # either cache layout, through its own methods
        slot = Slot(cache)
        slot.tokens, slot.whole = kept.tokens, kept.whole
        return slot

    # -- start and stop --

    def warm_up(self) -> None:
        """One short chain, so a drafter that cannot run fails at start rather than in a stream's round."""
        try:
            self.propose([DraftAsk(WARM_UP_ID, [0], 2)])
        finally:
            self.slots.pop(WARM_UP_ID, None)
        self.stats = dict.fromkeys(self.stats, 0)

    def close(self) -> None:
        """Drop every slot, live or kept, and give MLX's cached buffers back."""
        self.slots.clear()
        self.kept.clear()
        mx.clear_cache()


def start(target: TargetModel, drafter_ckpt: Checkpoint, options: DrafterOptions = DrafterOptions()) -> LlamaDrafter:
    """Load the drafter through the llama loader and warm it up; a failed warm-up frees it and raises DrafterError."""
    name = drafter_ckpt.path.name
    eos_ids = options.eos_ids if options.eos_ids is not None else frozenset(drafter_ckpt.tokenizer().eos_ids)
    # the table the target serves (on CUDA its compiled parts and GEMV records; on the CPU MLX's ops): the target
    # verifies every draft, so the drafter needs no row invariance, and the table is chosen for its speed alone
    builtin = os.environ.get(DRAFTER_BUILTIN_ENV) == "1"
    model = load(drafter_ckpt, LoadOptions(dtype=options.dtype, builtin_kernels=builtin))
    serve_codes(model)  # a quantized drafter's codes: unpacked once on the CPU, for many rows on CUDA (quantized.py)
    drafter = LlamaDrafter(model, vocab_limit=target.vocab_size, eos_ids=eos_ids, options=options,
                           source=str(drafter_ckpt.path))
    del model  # the drafter owns the weights from here: freeing it frees them
    try:
        drafter.warm_up()
    except Exception as exc:
        drafter.close()
        del drafter
        # the traceback's frames would keep the drafter (their `self`) alive for as long as the error lives
        traceback.clear_frames(exc.__traceback__)
        gc.collect()  # and any cycle through them, so the weights go now rather than at the next collection
        mx.clear_cache()
        raise DrafterError(f"drafter {name}: warm-up failed ({type(exc).__name__}: {exc}); the drafter was freed") \
            from exc
    return drafter
