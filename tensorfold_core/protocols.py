"""The Model protocol: what a family gives the lane core."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import mlx.core as mx

from .errors import DrafterError


@runtime_checkable
class Cache(Protocol):
    """One stream's state in the model: `offset` tokens committed, plus the rows of the last window until kept."""

    offset: int
    capacity: int


@runtime_checkable
class Model(Protocol):
    """A loaded checkpoint that runs many streams' ragged windows in one forward (a round)."""

    model_type: str
    vocab_size: int  # rows of the logits (the config's, padding included)
    dtype: mx.Dtype
    kernels: dict  # what serves each row-path op on this backend: "mlx" (built-in) or "RECORD (kind)"
    taps: int  # layers a drafter may tap (a `TappedModel`, below); 0: this family has no taps

    def new_cache(self, capacity: int, marks: int = 0) -> Cache:
        """A cache that can hold `capacity` committed tokens plus one window; a family whose state cannot be
        trimmed keeps resume points every `marks` tokens (and where `cache.mark(n)` asks, if it has one)."""

    def cache_bytes(self, tokens: int) -> int:
        """Bytes a cache of `tokens` capacity holds (the ledger prices caches with it)."""

    def forward(self, caches: Sequence[Cache], windows: Sequence[Sequence[int]],
                logit_rows: Sequence[int]) -> mx.array:
        """Run each window on its cache; return float32 logits [sum(logit_rows), vocab_size] for the
        last `logit_rows[i]` rows of each window, packed in order. Each row is bit-equal whatever else
        shares the call (row invariance, where the backend has it). Every cache must be `keep`-ed before
        its next forward."""

    def forward_ids(self, caches: Sequence[Cache], ids: mx.array, lengths: Sequence[int],
                    logit_rows: Sequence[int], commit: bool = False) -> mx.array:
        """`forward` on `sum(lengths)` ids already packed in an mx.array (a drafter's lazy argmaxes stay on the
        device), unchecked against the vocabulary (the caller keeps them below `vocab_size`); `commit` keeps every
        row at once (no `keep`, no eval). A refused call changes no cache. The public forward a drafter may call."""

    def keep(self, cache: Cache, rows: int) -> None:
        """Commit the first `rows` rows of the last window run on `cache` and drop the rest."""

    def snapshot(self, cache: Cache) -> "KeptModelState":
        """A standalone copy of the cache's committed state, for the prompt cache."""

    def restore(self, state: "KeptModelState", capacity: int, tokens: int | None = None, marks: int = 0) -> Cache:
        """A new cache holding the first `tokens` tokens of a kept state (a count its resume_point allows)."""

    def state_bytes(self, state: "KeptModelState") -> int:
        """Bytes a kept state holds."""


@dataclass(frozen=True)
class TappedRows:
    """Tapped rows a cache committed: row i is absolute position `start + i`, each the named layers' outputs side
    by side [rows, len(layers) * hidden_size]."""

    start: int
    rows: mx.array


def missing_members(obj, protocol: type) -> list[str]:
    """The members `protocol` (and the protocols it extends) declares that `obj` lacks, found by plain attribute
    lookup, so an mlx Module's dict-held members count on every Python (isinstance misses them from 3.12)."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if getattr(cls, "_is_protocol", False) and cls is not Protocol:
            names |= set(getattr(cls, "__annotations__", {}))
            names |= {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}
    return sorted(name for name in names if not hasattr(obj, name))


def can_keep_later(model) -> bool:
    """Whether `model` is a LookaheadModel. Not isinstance: from Python 3.12 a runtime protocol's check reads
    attributes statically and misses what an mlx Module keeps in its own dict (a family's `kernels`)."""
    return callable(getattr(model, "keep_later", None))


@runtime_checkable
class LookaheadModel(Model, Protocol):
    """A model whose commits can wait: the engine runs a plain greedy round's next step on the device's argmax
    while the host reads this round's logits (lanes/ahead.py); a model without it runs every round in step."""

    def keep_later(self, cache: Cache, rows: int) -> list:
        """`keep` without waiting: the same checks and commit, returning the arrays to evaluate with the next step."""


def window_features(model, cache: Cache) -> mx.array | None:
    """The tapped rows of `cache`'s open window, before its commit, where the model offers them (a drafter's hold
    queued before the host reads the verify absorbs them at once); None where it does not or the window is untapped."""
    rows = getattr(model, "window_features", None)
    return rows(cache) if callable(rows) else None


@runtime_checkable
class TappedModel(Model, Protocol):
    """A model whose `taps` > 0: it hands a drafter (DSpark) the rows of the layers it names, and binds the drafter
    to its own embedding and head. A drafter checks `taps` first; core calls `tap_from` alone."""

    hidden_size: int  # width of an embedded id, a head input, and each tapped layer's part of a row

    def features(self, layers: Sequence[int]) -> None:
        """From now on keep the post-layer residual rows of `layers` (ids below `taps`) for every row a cache
        commits (from its `tap_from` bound on), prompt chunks and verified rows alike, until `take_features` hands
        them over; `[]` stops."""

    def take_features(self, cache: Cache) -> TappedRows | None:
        """The tapped rows `cache` committed since the last take (None: none), handed over and dropped there."""

    def tap_from(self, cache: Cache, position: int) -> None:
        """Tap only `cache`'s windows holding a row at `position` or later: the engine's bound on what a drafter can
        absorb (a stream that never drafts, a prompt's rows a hold's catch-up would cut away)."""

    def embed(self, ids: mx.array) -> mx.array:
        """The model's input embedding of `ids` [n, hidden_size], in its activation dtype."""

    def head(self, rows: mx.array) -> mx.array:
        """The model's output head (no final norm) over `rows` [n, hidden_size]: float32 logits [n, vocab_size]."""


class KeptModelState(Protocol):
    """A family's kept state: how many tokens it holds and where it can resume."""

    tokens: int

    def resume_point(self, limit: int) -> int:
        """The most tokens, at most `limit`, a restore of this state can start from (0: none)."""


class HeldDrafts:
    """A hold's drafts kept on the device (`DrafterFacts.held_on_target`): `ids` ([depth], lazy) join the verify's
    window there, and `read()` gives them on the host once the verify's logits are read (no wait of its own)."""

    def __init__(self, ids: mx.array, read: Callable[[], list[int]]):
        self.ids, self._read = ids, read

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, cut: slice) -> "HeldDrafts":
        """The first drafts (a grant's cut), still on the device."""
        if not isinstance(cut, slice) or cut.start not in (None, 0) or cut.step not in (None, 1):
            raise TypeError("held drafts are cut from the first: drafts[:n]")
        n = len(range(*cut.indices(len(self))))
        return self if n == len(self) else HeldDrafts(self.ids[:n], lambda: self._read()[:n])

    def read(self) -> list[int]:
        return self._read()


# drafts held on the device for the verify (`DrafterFacts.held_on_target`): 1 on, 0 off, unset on a GPU only
HELD_ENV = "TENSORFOLD_HELD_ON_TARGET"


def held_on_target_wanted() -> bool:
    """Drafts kept on the device for the verify: by default on a GPU (one host wait a drafted round fewer), not on the
    CPU, where the hold and the verify share the cores either way; TENSORFOLD_HELD_ON_TARGET=1 or 0 decides."""
    chosen = os.environ.get(HELD_ENV, "")
    if chosen not in ("", "0", "1"):
        raise DrafterError(f"{HELD_ENV}={chosen!r}: set it to 1 (drafts held on the device), 0 (read back) or unset "
                           "(held on a GPU)")
    return chosen == "1" if chosen else mx.default_device().type == mx.DeviceType.gpu


MAX_DRAFT_DEPTH = 15  # the most drafts a window carries: 16 verify rows, the widest window the kernels serve


@runtime_checkable
class Proposer(Protocol):
    """Gives streams drafts to verify: the core's copy proposer, or a drafter from a plugin."""

    name: str

    def propose(self, asks: Sequence["DraftAsk"]) -> list[list[int]]:
        """For each ask, up to `depth` tokens to follow `tokens`; one call a round so steps batch."""

    def release(self, stream_id: int) -> None:
        """The stream left; a drafter may keep its slot for a later request sharing the prefix."""


@dataclass(frozen=True)
class DrafterFacts:
    """What a drafter tells the lane core beyond its drafts; the defaults leave its drafts to the depth rule."""

    chances: bool = False  # a `ChanceDrafter`: its drafts' chances price the verify rows, and grants set its holds
    slack: int = 1  # drafts a hold adds past a full grant; a probe after a grant of none holds this many
    hold_rows: int = 0  # block rows one hold pass takes (0: unbounded); a shared round's holds are cut to fit one
    # a `HoldPricedDrafter`: its hold is a pass of its own (not chain steps), so a timed round keeps a granted hold
    # only where its expected drafts pay for their verify rows and the pass that `hold_ms` prices
    hold_costs: bool = False
    # committed tokens per wall ms of drafted and plain stretches decide whether shared rounds (per band of stream
    # counts) and lone streams (per sampling mode and context band) draft at all: the depth rule's drafters and copy
    # drafts have run under both since the guards were written; a drafter may switch either off
    shared_guard: bool = True
    lone_guard: bool = True
    # most context rows a hold may catch up (0: all it lacks); past it the drafter reads the last rows, with a cut,
    # as a probe does: a drafter whose absorb costs more a row than a long prompt's drafts land bounds it
    catch_up: int = 0
    # a `ContextKeepingDrafter`: a kept prompt state holds the stream's drafter context too, so a drafting stream that
    # resumes it drafts as the fresh stream would (seed 003: "the drafter keeps its context with each kept prompt state")
    kept_context: bool = False
    # its `propose` gives `HeldDrafts`: the hold is launched, not waited on, and a verify window reads its drafts on
    # the device; a stream with a grammar reads them back first (seed 002: `held_on_target`)
    held_on_target: bool = False
    # a `HoldAheadDrafter`: the engine may queue a greedy stream's next hold on the verify's device draws before the
    # host reads them (TENSORFOLD_HOLD_AHEAD=1), so the device runs verify and hold back to back
    hold_ahead: bool = False


DEPTH_RULE = DrafterFacts()


@runtime_checkable
class Drafter(Proposer, Protocol):
    """A plugin's drafter: everything core calls of it. It reaches the target only through the Model protocol."""

    facts: DrafterFacts  # DEPTH_RULE: no chances, the core's depth rule prices its drafts

    def catch_up(self, asks: Sequence["DraftAsk"]) -> int:
        """Feed lagging slots before `propose`, so the core times this once-off work apart from the chain steps
        it prices drafts by; the rows fed (0: nothing ran)."""

    def slot_bytes_for(self, tokens: int) -> int:
        """Bytes one stream's slot holds for a stream of at most `tokens` (reserved at admission; a slot is made
        at that size when the stream first asks and never grows while it decodes)."""

    def kept_bytes(self) -> int:
        """Bytes the kept (released) slots hold: they give way first when room is needed."""

    def shed_kept(self, wanted_bytes: int | None = None) -> int:
        """Free kept slots, oldest first, until `wanted_bytes` are freed (all for None); the bytes freed."""

    def close(self) -> None:
        """Drop every slot, live or kept, and give the device's buffers back."""


@runtime_checkable
class ChanceDrafter(Drafter, Protocol):
    """A drafter whose `facts.chances` is set (DSpark's confidence head). A drafter checks nothing here; core calls
    `chances` only where the facts say so."""

    def chances(self, stream_id: int) -> Sequence[float] | None:
        """For the drafts the last `propose` gave this stream, the chance each lands with every draft before it (a
        running product, one per draft); None while that hold has not settled (it still runs on the device)."""


@dataclass(frozen=True)
class AheadAsk:
    """A stream's next hold, asked before the host reads its verify: the window's tapped rows and the verify's
    acceptance and bonus draw, all still on the device."""

    stream_id: int
    start: int  # the window's first position (its pending token's)
    rows: mx.array  # the window's tapped rows [1 + drafts, taps * hidden], of which 1 + accepted are kept
    accepted: mx.array  # drafts the verify accepts (int32 scalar)
    pending: mx.array  # the verify's draw after them, the next window's pending token (uint32 scalar)
    max_depth: int  # the most drafts the stream's next window may carry


@runtime_checkable
class HoldAheadDrafter(Drafter, Protocol):
    """A drafter whose `facts.hold_ahead` is set (DSpark). Core calls these only where the facts say so."""

    def hold_ahead(self, asks: Sequence[AheadAsk]) -> list[int]:
        """Queue each ask's next hold on its device values, absorbing the window's rows (lazy, not waited on); the
        streams queued. A later `propose` for one of them gives its queued drafts."""

    def settle_ahead(self, stream_id: int, accepted: int, pending: int, queued_on: tuple[int, int]) -> None:
        """The host read the verify: `accepted` of the window's drafts stand and `pending` follows them; the hold
        was queued on the device's (accepted, pending) `queued_on`, and stands only where they are the host's."""


@runtime_checkable
class HoldPricedDrafter(Drafter, Protocol):
    """A drafter whose `facts.hold_costs` is set (DSpark: a hold runs its layers and the target's head as one pass).
    Core calls `hold_ms` and `time_holds` only where the facts say so."""

    def hold_ms(self, blocks: int, depth: int) -> float:
        """What a hold pass of `blocks` streams' blocks, the deepest of `depth` drafts, costs in wall ms now (timed
        after warm-up, moved toward each hold that settles; 0 while untimed)."""

    def time_holds(self) -> None:
        """Time the hold passes afresh, the prices `hold_ms` starts from (a server's warm-up calls it after its cold
        holds, which a build's seconds would otherwise have moved)."""


@runtime_checkable
class KeptContext(Protocol):
    """A drafter's context kept with a prompt state: its bytes (counted with the state's) and the leading tokens it
    stands for."""

    nbytes: int
    tokens: int


@runtime_checkable
class ContextKeepingDrafter(Drafter, Protocol):
    """A drafter whose `facts.kept_context` is set (DSpark's lanes). Core calls these only where the facts say so."""

    def keep_context(self, stream_id: int, tokens: Sequence[int], cache: Cache) -> KeptContext | None:
        """The stream, released, is kept as a prompt state of `tokens` (its target `cache` at their end): hand over
        its context for those tokens, complete to their end (None: the drafter holds none for it)."""

    def resume_context(self, stream_id: int, context: KeptContext, tokens: Sequence[int], limit: int) -> None:
        """A new stream resumes the prompt state `context` was kept with at `len(tokens)` tokens: its slot starts
        from a copy of the context's first tokens (the kept context stays with its state for later resumes)."""

    def return_context(self, context: KeptContext) -> None:
        """A context `keep_context` handed over whose state the prompt cache did not keep: the drafter keeps it
        as it keeps a released slot."""


class DraftAsk:
    """One stream's ask: its committed tokens (pending one last), the depth wanted, the most catch-up rows, the
    most tokens the stream may hold (what its slot was priced for at admission), and the stream's target cache."""

    __slots__ = ("stream_id", "tokens", "depth", "catch_up", "limit", "cache")

    def __init__(self, stream_id: int, tokens: Sequence[int], depth: int, catch_up: int | None = None,
                 limit: int | None = None, cache: Cache | None = None):
        self.stream_id = stream_id
        self.tokens = tokens
        self.depth = depth
        self.catch_up = catch_up  # None: a drafter feeds all the context it lacks; a bound lets it skip the rest
        self.limit = len(tokens) + depth if limit is None else limit
        # read-only to a drafter: only for `TappedModel.take_features` (None where the asker has no target cache)
        self.cache = cache

    def __repr__(self):
        return f"DraftAsk(stream_id={self.stream_id}, tokens=<{len(self.tokens)}>, depth={self.depth})"
