"""The llama drafter: a smaller same-tokenizer llama proposing greedy chains, one cache (slot) per stream."""

from __future__ import annotations

import gc
import traceback
from dataclasses import dataclass, fields
from typing import Sequence

import mlx.core as mx

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError, DrafterError, OptionError
from tensorfold_core.families import GROW_STEP, WINDOW_SLACK
from tensorfold_core.protocols import DraftAsk
from tensorfold_core.specs import LoadOptions

from .load import load
from .cache import KVCache
from .model import Model

MODEL_TYPES = ("llama", "mistral")
BITS = (0, 4, 8)
MAX_DEPTH = 15
WARM_UP_ID = -1  # a stream id no lane core hands out


@dataclass(frozen=True)
class DrafterOptions:
    """How the drafter starts: weights dtype, deepest chain, kept slots, eos ids."""

    dtype: str = "auto"
    max_depth: int = MAX_DEPTH
    max_kept: int = 4  # the serve default of --parallel
    eos_ids: frozenset[int] | None = None  # None: the drafter tokenizer's (equal to the target's once admitted)

    def __post_init__(self):
        if not 1 <= self.max_depth <= MAX_DEPTH:
            raise OptionError(f"drafter max_depth {self.max_depth}: expected 1..{MAX_DEPTH}")
        if self.max_kept < 0:
            raise OptionError(f"drafter max_kept {self.max_kept}: expected 0 or more")
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", frozenset(int(t) for t in self.eos_ids))

    @classmethod
    def of(cls, options) -> "DrafterOptions":
        """Read a DrafterOptions, a dict, or any object with some of the fields (ServeOptions' parallel -> max_kept)."""
        if isinstance(options, cls):
            return options
        if options is None or isinstance(options, dict):
            get = dict(options or {}).get
        else:
            get = lambda key: getattr(options, key, None)
        values = {f.name: get(f.name) for f in fields(cls) if get(f.name) is not None}
        if "max_kept" not in values and get("parallel") is not None:
            values["max_kept"] = get("parallel")
        return cls(**values)


# ---- admission: which checkpoints, which tokenizer, which width ----

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


def _entry(value) -> str:
    return "no token" if value is None else repr(value)


def _vocab_difference(target, drafter) -> str | None:
    def by_id(vocab):  # BPE/WordPiece: {token: id}; Unigram: [[piece, score], ...]
        if isinstance(vocab, dict):
            return {i: t for t, i in vocab.items()}
        return dict(enumerate(vocab or []))

    a, b = by_id(target), by_id(drafter)
    for i in sorted(set(a) | set(b)):
        if a.get(i) != b.get(i):
            return f"token id {i}: target {_entry(a.get(i))} vs drafter {_entry(b.get(i))}"
    return None


def _merge_difference(target, drafter) -> str | None:
    show = lambda m: repr(" ".join(m) if isinstance(m, list) else m)
    a, b = target or [], drafter or []
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or a[i] != b[i]:
            left = show(a[i]) if i < len(a) else f"none ({len(a)} merges)"
            right = show(b[i]) if i < len(b) else f"none ({len(b)} merges)"
            return f"merges differ at merge {i}: target {left} vs drafter {right}"
    return None


def _added_difference(target, drafter) -> str | None:
    a, b = ({t.get("id"): t for t in tokens or []} for tokens in (target, drafter))
    for i in sorted(set(a) | set(b), key=lambda i: (i is None, i)):
        left, right = a.get(i), b.get(i)
        if left == right:
            continue
        if left is None or right is None or left.get("content") != right.get("content"):
            text = lambda t: _entry(t and t.get("content"))
            return f"added token id {i}: target {text(left)} vs drafter {text(right)}"
        key = next(k for k in sorted(set(left) | set(right)) if left.get(k) != right.get(k))
        return f"added token id {i} ({left.get('content')!r}): {key} {left.get(key)!r} vs {right.get(key)!r}"
    return None


def tokenizer_difference(target: dict, drafter: dict) -> str | None:
    """The first difference of two `Tokenizer.fingerprint()`s, in words; None when they match."""
    tm, dm = target.get("model") or {}, drafter.get("model") or {}
    if tm.get("type") != dm.get("type"):
        return f"tokenizer models differ: target {tm.get('type')} vs drafter {dm.get('type')}"
    why = _vocab_difference(tm.get("vocab"), dm.get("vocab")) or _merge_difference(tm.get("merges"), dm.get("merges"))
    if why:
        return why
    for key in sorted((set(tm) | set(dm)) - {"vocab", "merges"}):
        if tm.get(key) != dm.get(key):
            return f"tokenizer model field {key!r} differs: target {tm.get(key)!r} vs drafter {dm.get(key)!r}"
    why = _added_difference(target.get("added_tokens"), drafter.get("added_tokens"))
    if why:
        return why
    if target.get("bos") != drafter.get("bos"):
        return f"bos ids differ: {target.get('bos')} vs {drafter.get('bos')}"
    if target.get("eos") != drafter.get("eos"):
        return f"eos ids differ: {target.get('eos')} vs {drafter.get('eos')}"
    return None


def admit(target_tokenizer, target_model, drafter_ckpt: Checkpoint, bits: int | None = None) -> None:
    """Refuse a drafter whose tokenizer differs from the target's, or whose weights are not `bits` wide."""
    name = drafter_ckpt.path.name
    if not matches(drafter_ckpt):
        raise DrafterError(f"drafter {name}: model_type {drafter_ckpt.config.get('model_type')!r} is not drafted "
                           f"by the llama drafter ({', '.join(MODEL_TYPES)})")
    try:
        drafter_tokenizer = drafter_ckpt.tokenizer()
    except CheckpointError as exc:
        raise DrafterError(f"drafter {name}: its tokenizer cannot be compared with the target's ({exc})") from exc
    why = tokenizer_difference(target_tokenizer.fingerprint(), drafter_tokenizer.fingerprint())
    if why:
        raise DrafterError(f"drafter {name} does not share the target's tokenizer: {why}")
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

    __slots__ = ("cache", "tokens", "skipped", "cut", "whole")

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.tokens: list[int] = []
        # a bounded catch-up skips context tokens: from `cut` on, tokens[i] is the context's [i + skipped]; rotary
        # positions are relative, so the drafter reads the cut context as if it were whole
        self.skipped = 0
        self.cut = 0
        self.whole = 0  # leading tokens equal to the context's own prefix (before any cut)

    def trim(self, tokens: int) -> None:
        self.cache.trim(tokens)
        del self.tokens[tokens:]
        self.whole = min(self.whole, tokens)
        self.cut = min(self.cut, tokens)

    def feed(self, context: list[int], limit: int | None) -> list[int]:
        """Trim to the context and return the rows still to feed, at most `limit` of them plus the last one."""
        start = self.cut + _common_prefix(self.tokens, context, self.cut, self.cut + self.skipped)
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


def _common_prefix(a: Sequence[int], b: Sequence[int], a_from: int = 0, b_from: int = 0, chunk: int = 512) -> int:
    """Length of the common prefix of a[a_from:] and b[b_from:], without copying either: chunks compare at C speed."""
    n = max(min(len(a) - a_from, len(b) - b_from), 0)
    at = 0
    while at < n and a[a_from + at:a_from + min(at + chunk, n)] == b[b_from + at:b_from + min(at + chunk, n)]:
        at += chunk
    if at >= n:
        return n
    end = min(at + chunk, n)
    return next((i for i in range(at, end) if a[a_from + i] != b[b_from + i]), end)


def _round_up(tokens: int) -> int:
    # slots grow in the cache's own step, so its storage stays `cache_bytes(capacity)`
    return -(-tokens // GROW_STEP) * GROW_STEP


class LlamaDrafter:
    """A `Proposer`: greedy chains of a small llama, batched over every asking stream, evaluated once a call."""

    name = "llama"

    def __init__(self, model: Model, *, vocab_limit: int, eos_ids: frozenset[int], options: DrafterOptions,
                 ledger=None, source: str = ""):
        self.model = model
        self.vocab_limit = min(vocab_limit, model.vocab_size)  # padded drafter rows are never valid target ids
        self.eos_ids = eos_ids
        self.max_depth = options.max_depth
        self.max_kept = options.max_kept
        self.ledger = ledger  # the memory ledger (a later issue) is charged where slots are made, grown and freed
        self.source = source
        self.slots: dict[int, Slot] = {}  # live streams' slots
        self.kept: list[Slot] = []  # released slots, oldest first, adopted by a stream sharing their prefix
        self.stats = dict(proposals=0, forwards=0, rows=0, slot_reuses=0)

    # -- the ledger's view (its charging comes in a later issue; these are the numbers it will read) --

    def slot_bytes(self) -> int:
        """Bytes the live streams' slots hold."""
        return sum(self.model.cache_bytes(s.cache.capacity) for s in self.slots.values())

    def slot_bytes_for(self, tokens: int) -> int:
        """Bytes one stream's slot holds at most for a stream of `tokens` (the ledger reserves this at admission)."""
        return self.model.cache_bytes(_round_up(tokens + self.max_depth))

    def kept_bytes(self) -> int:
        """Bytes the kept (released) slots hold: they give way first when room is needed."""
        return sum(self.model.cache_bytes(s.cache.capacity) for s in self.kept)

    def shed_kept(self, wanted_bytes: int | None = None) -> int:
        """Free kept slots, oldest first, until `wanted_bytes` are freed (all of them for None); return bytes freed."""
        freed = 0
        while self.kept and (wanted_bytes is None or freed < wanted_bytes):
            freed += self.model.cache_bytes(self.kept.pop(0).cache.capacity)
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

    def propose(self, asks: Sequence[DraftAsk]) -> list[list[int]]:
        """Each ask's greedy chain: slots synced to the context by their common prefix, then one lazy graph."""
        self.stats["proposals"] += 1
        drafts: list[list[int]] = [[] for _ in asks]
        work = self._sync(asks)
        if not work:
            return drafts
        work.sort(key=lambda w: -w[3])  # deepest first: each step's streams are a prefix of the last step's
        try:
            steps = self._chain([w[1].cache for w in work], [w[2] for w in work], [w[3] for w in work])
        except Exception:
            self._drop([(slot, rows) for _, slot, rows, _ in work])
            raise
        for j, (i, slot, rows, depth) in enumerate(work):
            chain = [steps[s][j] for s in range(depth)]
            slot.fed(rows + chain[:-1])  # the last draft was never fed back
            cut = next((k + 1 for k, t in enumerate(chain) if t in self.eos_ids), depth)
            drafts[i] = chain[:cut]
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
            slot = self._slot(ask.stream_id, tokens)
            rows = slot.feed(tokens, ask.catch_up)
            # ids the drafter cannot embed get no drafts rather than an error; only rows not yet fed need checking
            if min(rows) < 0 or max(rows) >= self.model.vocab_size:
                continue
            self._reserve(slot, len(slot.tokens) + len(rows) + depth - 1)
            out.append((i, slot, rows, depth))
        return out

    def _drop(self, work) -> None:
        """Slots whose caches hold a graph that failed: the next ask starts them afresh."""
        failed = {id(slot) for slot, _ in work}
        self.slots = {k: s for k, s in self.slots.items() if id(s) not in failed}

    def _chain(self, caches: list[KVCache], feeds: list[list[int]], depths: list[int]) -> list[list[int]]:
        """Run the first (ragged) windows, then one row per stream a step; one mx.eval for the whole chain."""
        model, limit = self.model, self.vocab_limit
        ids = mx.array([t for feed in feeds for t in feed], dtype=mx.uint32)
        logits = model.forward_ids(caches, ids, [len(f) for f in feeds], [1] * len(feeds), commit=True)
        self._count(sum(len(f) for f in feeds))
        # the chain may run past an eos: stopping would need a host read; the draft is cut after the eval
        token = mx.argmax(logits[:, :limit], axis=-1)  # ties go to the lowest id, as the target's greedy draw
        steps = [token]
        for step in range(1, depths[0]):
            m = sum(1 for d in depths if d > step)
            token = token[:m]
            logits = model.forward_ids(caches[:m], token, [1] * m, [1] * m, commit=True)
            self._count(m)
            token = mx.argmax(logits[:, :limit], axis=-1)
            steps.append(token)
        mx.eval(steps, [c.keys + c.values for c in caches])  # the caches too, so no graph outlives the call
        return [s.tolist() for s in steps]

    def _count(self, rows: int) -> None:
        self.stats["forwards"] += 1
        self.stats["rows"] += rows

    def _slot(self, stream_id: int, tokens: list[int]) -> Slot:
        """The stream's slot; for a new stream, the kept slot sharing the longest prefix, else a fresh one."""
        slot = self.slots.get(stream_id)
        if slot is not None:
            return slot
        best, shared = None, 0
        for kept in self.kept:  # oldest first, so ">=" prefers the newest of equal prefixes
            n = _common_prefix(kept.tokens[:kept.whole], tokens)
            if n and n >= shared:
                best, shared = kept, n
        if best is not None:
            self.kept.remove(best)
            self.stats["slot_reuses"] += 1
            slot = best
            slot.trim(shared)  # only its uncut prefix stands for this context
            slot.skipped = slot.cut = 0
        else:
            slot = Slot(self.model.new_cache(_round_up(len(tokens) + self.max_depth)))
        self.slots[stream_id] = slot
        return slot

    def _reserve(self, slot: Slot, tokens: int) -> None:
        """Grow a slot to hold `tokens`; the ledger will price this growth (and its copy) here."""
        cache = slot.cache
        if tokens <= cache.capacity:
            return
        capacity = _round_up(tokens + self.max_depth)
        cache.reserve(capacity + WINDOW_SLACK - cache.offset)
        cache.capacity = capacity

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


def start(target_model, drafter_ckpt: Checkpoint, options=None, ledger=None) -> LlamaDrafter:
    """Load the drafter through the llama loader and warm it up; a failed warm-up frees it and raises DrafterError."""
    opts = DrafterOptions.of(options)
    name = drafter_ckpt.path.name
    eos_ids = opts.eos_ids if opts.eos_ids is not None else frozenset(drafter_ckpt.tokenizer().eos_ids)
    model = load(drafter_ckpt, LoadOptions(dtype=opts.dtype))
    drafter = LlamaDrafter(model, vocab_limit=target_model.vocab_size, eos_ids=eos_ids, options=opts, ledger=ledger,
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
