"""A tensor-parallel group over mx.distributed: rank 0 serves and sends every forward to the ranks that follow it."""

from __future__ import annotations

import itertools
import json
import logging
import os
import sys
import threading
import time
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .errors import GroupError
from .families import packed_ids
from .protocols import Model

log = logging.getLogger("tensorfold")

# what each launcher (`mlx.launch`) sets, and the backend it launched: only these make `serve` join a group
LAUNCHERS = (("MLX_HOSTFILE", "ring"), ("MLX_JACCL_COORDINATOR", "jaccl"), ("MLX_WORLD_SIZE", "nccl"))
TIMEOUT_ENV = "TENSORFOLD_GROUP_TIMEOUT"
# a collective that waits this long has a rank that stopped answering (a killed rank is seen at once: its socket
# closes); long enough for a prompt chunk of a large model on a slow CPU
DEFAULT_TIMEOUT_S = 120.0
EXIT_GROUP_DOWN = 3  # a rank's exit status when the group failed under it


@dataclass(frozen=True)
class Launch:
    """What the launcher's environment says: the backend, this process's rank and the group's size."""

    backend: str
    rank: int
    size: int
    local: int = 1  # ranks on this rank's machine (the ring hostfile's addresses say), sharing its memory


def launched(env: dict | None = None) -> Launch | None:
    """The group this process was launched into, read from the environment alone (None: launched alone)."""
    env = os.environ if env is None else env
    backend = next((name for key, name in LAUNCHERS if env.get(key)), None)
    if backend is None:
        return None
    rank = int(env.get("MLX_RANK", 0))
    if backend != "ring":
        return Launch(backend, rank, int(env.get("MLX_WORLD_SIZE", 0)))
    try:
        with open(env["MLX_HOSTFILE"]) as f:
            text = f.read().strip()
        hosts = [node[0].rpartition(":")[0] for node in json.loads(text)] if text else [""]
    except (OSError, ValueError, IndexError, TypeError):
        return Launch(backend, rank, 0)  # unreadable: init says why
    return Launch(backend, rank, len(hosts), hosts.count(hosts[rank]) if rank < len(hosts) else 1)


def timeout_s(env: dict | None = None) -> float:
    env = os.environ if env is None else env
    return float(env.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S)


def describe_launch() -> dict:
    """The group `capabilities --json` shows before any rank joins: size, backend and this rank."""
    launch = launched()
    return {"size": 1, "backend": None} if launch is None else {"size": launch.size, "backend": launch.backend,
                                                                "rank": launch.rank}


@dataclass(frozen=True)
class Joined:
    """The group this process joined and the backend it runs on."""

    group: mx.distributed.Group
    backend: str
    local: int = 1  # ranks on this machine

    @property
    def rank(self) -> int:
        return self.group.rank()


def join() -> Joined | None:
    """The group this process was launched into, joined (None: launched alone, or into a group of one)."""
    launch = launched()
    if launch is None or launch.size == 1:
        return None
    try:
        group = mx.distributed.init(strict=True, backend=launch.backend)
    except RuntimeError as exc:
        raise GroupError(f"rank {launch.rank} could not join its {launch.backend} group: {exc}") from exc
    return Joined(group, launch.backend, max(1, launch.local)) if group.size() > 1 else None


# -- what rank 0 tells the others: every call that changes a cache or a kept state, in order --

@dataclass(frozen=True)
class NewCache:
    cache: int
    capacity: int
    marks: int


@dataclass(frozen=True)
class Restore:
    cache: int
    state: int
    capacity: int
    tokens: int | None
    marks: int


@dataclass(frozen=True)
class Forward:
    caches: list[int]
    ids: list[int]
    lengths: list[int]
    logit_rows: list[int]
    commit: bool


@dataclass(frozen=True)
class Keep:
    cache: int
    rows: int


@dataclass(frozen=True)
class Mark:
    cache: int
    tokens: int


@dataclass(frozen=True)
class Snapshot:
    cache: int
    state: int


@dataclass(frozen=True)
class Free:
    caches: list[int] = field(default_factory=list)
    states: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Hello:
    """Rank 0's shard, described: a rank whose own differs (another checkpoint, dtype or group) refuses to follow."""

    shard: str


@dataclass(frozen=True)
class Stop:
    """Rank 0 is closing: the others leave their loop."""


COMMANDS = {kind.__name__: kind for kind in (Hello, NewCache, Restore, Forward, Keep, Mark, Snapshot, Free, Stop)}


def describe_shard(model: Model) -> str:
    """What every rank's shard must agree on: family, dtype, vocabulary, group size and the whole model's parameter
    count (a rank's own may differ from rank 0's where a width splits in whole quantization groups)."""
    count = getattr(model, "whole_parameters", None) or sum(a.size for _, a in tree_flatten(model.parameters()))
    return (f"{model.model_type} {model.dtype} vocab {model.vocab_size} shards {model.shards} "
            f"{count} parameters in all")


def encode(commands: Sequence) -> bytes:
    return json.dumps([[type(c).__name__, asdict(c)] for c in commands], separators=(",", ":")).encode()


def decode(payload: bytes) -> list:
    return [COMMANDS[name](**fields) for name, fields in json.loads(payload)]


class Channel:
    """Rank 0's bytes to every rank, as an all_sum to which the others add zeros: one collective for most rounds."""

    BLOCK = 4096  # a round's commands fit one block unless its windows are prompt chunks

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def _sum(self, data: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(data), group=self.group)
        mx.eval(out)
        return np.array(out, copy=False)

    def send(self, payload: bytes) -> None:
        head, first = np.zeros(self.BLOCK, np.uint8), self.BLOCK - 4
        head[:4] = np.frombuffer(len(payload).to_bytes(4, "little"), np.uint8)
        head[4:4 + min(len(payload), first)] = np.frombuffer(payload[:first], np.uint8)
        self._sum(head)
        if len(payload) > first:
            self._sum(np.frombuffer(payload[first:], np.uint8))

    def receive(self) -> bytes:
        head, first = self._sum(np.zeros(self.BLOCK, np.uint8)), self.BLOCK - 4
        n = int.from_bytes(head[:4].tobytes(), "little")
        data = head[4:4 + min(n, first)].tobytes()
        if n > first:
            data += self._sum(np.zeros(n - first, np.uint8)).tobytes()
        return data


class Replica:
    """One rank's caches and kept states by id, and the model shard they run on: every rank applies the same calls."""

    def __init__(self, model: Model):
        self.model = model
        self.trail = model.reductions  # what shard() left: the forward's sums in order
        self.caches: dict[int, object] = {}
        self.states: dict[int, object] = {}
        self.held = 0  # bytes its caches (priced at capacity) and kept states hold; read by /health

    def _add_cache(self, key: int, cache) -> object:
        self.caches[key] = cache
        self.held += self.model.cache_bytes(cache.capacity)
        return cache

    def apply(self, command):
        """Run one command on this rank's shard; a forward's lazy logits, a new cache or state, else None."""
        m = self.model
        if isinstance(command, Forward):
            caches = [self.caches[c] for c in command.caches]
            self.trail.clear()  # a graph refused half-built leaves no sums to run
            return m.forward_ids(caches, mx.array(command.ids, dtype=mx.uint32), command.lengths, command.logit_rows,
                                 command.commit)
        if isinstance(command, Keep):
            return m.keep(self.caches[command.cache], command.rows)
        if isinstance(command, NewCache):
            return self._add_cache(command.cache, m.new_cache(command.capacity, marks=command.marks))
        if isinstance(command, Restore):
            state = self.states[command.state]
            return self._add_cache(command.cache, m.restore(state, command.capacity, command.tokens,
                                                            marks=command.marks))
        if isinstance(command, Mark):
            return self.caches[command.cache].mark(command.tokens)
        if isinstance(command, Snapshot):
            state = self.states[command.state] = m.snapshot(self.caches[command.cache])
            self.held += m.state_bytes(state)
            return state
        if isinstance(command, Hello):
            mine = describe_shard(m)
            if command.shard != mine:
                raise ValueError(f"rank 0 serves {command.shard}; this rank loaded {mine}: launch every rank "
                                 "with the same model and flags")
            return None
        if isinstance(command, Free):
            for key in command.caches:
                self.held -= m.cache_bytes(self.caches.pop(key).capacity)
            for key in command.states:
                self.held -= m.state_bytes(self.states.pop(key))
            return None
        raise ValueError(f"a group cannot apply {command!r}")


class Watchdog:
    """Calls `expired(what)` when one collective has waited past `timeout` seconds (a rank stopped answering)."""

    def __init__(self, timeout: float, expired: Callable[[str], None], poll: float = 0.5):
        self.timeout, self.expired, self.poll = timeout, expired, poll
        self._since: tuple[float, str] | None = None
        threading.Thread(target=self._watch, name="tensorfold-group-watchdog", daemon=True).start()

    @contextmanager
    def armed(self, what: str):
        self._since = (time.monotonic(), what)
        try:
            yield
        finally:
            self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll)
            since = self._since
            if since is not None and time.monotonic() - since[0] > self.timeout:
                self.expired(since[1])
                return


def _say(message: str) -> None:
    """One line on stderr: where the launcher gathers every rank's output."""
    print(f"tensorfold: {message}", file=sys.stderr, flush=True)


def _leave(message: str) -> None:
    """A rank stuck in a collective cannot be woken: say why and leave, so the launcher or supervisor restarts."""
    _say(message)
    os._exit(EXIT_GROUP_DOWN)


class GroupCache:
    """Rank 0's handle on one cache held by every rank under the same id."""

    def __init__(self, key: int, inner):
        self.id, self.inner = key, inner

    @property
    def offset(self) -> int:
        return self.inner.offset

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def window(self) -> int | None:
        return self.inner.window


class MarkedGroupCache(GroupCache):
    """A handle on a cache that keeps resume points where asked (`mark`), on every rank."""

    def __init__(self, key: int, inner, group: "GroupModel"):
        super().__init__(key, inner)
        self._group = group

    def mark(self, tokens: int) -> None:
        self._group.mark(self, tokens)


class GroupState:
    """Rank 0's handle on one kept state held by every rank under the same id."""

    def __init__(self, key: int, inner):
        self.id, self.inner = key, inner

    @property
    def tokens(self) -> int:
        return self.inner.tokens

    def resume_point(self, limit: int) -> int:
        return self.inner.resume_point(limit)


class GroupModel:
    """The Model the lane core drives on rank 0: each call runs on rank 0's shard and reaches the others in order."""

    def __init__(self, model: Model, group: mx.distributed.Group, backend: str, timeout: float | None = None):
        self.inner, self.group, self.backend = model, group, backend
        self.model_type, self.vocab_size, self.dtype = model.model_type, model.vocab_size, model.dtype
        self.kernels, self.taps = model.kernels, model.taps
        self.replica, self.channel = Replica(model), Channel(group)
        self.failure: str | None = None
        self.timeout = timeout_s() if timeout is None else timeout
        self._ids = itertools.count(1)
        self._queue: list = []
        self._freed: deque[tuple[str, int]] = deque()  # handles gone since the last send (finalizers append)
        self._watchdog = Watchdog(self.timeout, self._expired)
        self._queue.append(Hello(describe_shard(model)))  # checked by every rank before its first forward

    # -- the Model protocol --

    def new_cache(self, capacity: int, marks: int = 0) -> GroupCache:
        return self._cache(NewCache(next(self._ids), capacity, marks))

    def restore(self, state: GroupState, capacity: int, tokens: int | None = None, marks: int = 0) -> GroupCache:
        return self._cache(Restore(next(self._ids), state.id, capacity, tokens, marks))

    def snapshot(self, cache: GroupCache) -> GroupState:
        command = Snapshot(cache.id, next(self._ids))
        handle = GroupState(command.state, self._do(command))
        weakref.finalize(handle, self._freed.append, ("state", command.state))
        return handle

    def state_bytes(self, state: GroupState) -> int:
        return self.inner.state_bytes(state.inner)

    def cache_bytes(self, tokens: int) -> int:
        return self.inner.cache_bytes(tokens)  # one rank's shard: every rank holds the same

    def forward(self, caches: Sequence[GroupCache], windows: Sequence[Sequence[int]],
                logit_rows: Sequence[int]) -> mx.array:
        ids = packed_ids(windows, self.vocab_size)
        return self.forward_ids(caches, ids, [len(window) for window in windows], logit_rows)

    def forward_ids(self, caches: Sequence[GroupCache], ids: mx.array, lengths: Sequence[int],
                    logit_rows: Sequence[int], commit: bool = False) -> mx.array:
        """The forward on every rank: built here first, then sent, then evaluated here in the ranks' common order."""
        # built first, so a call the family refuses reaches no rank; evaluated here, not lazily by the caller, so no
        # other collective can run between this forward's sums
        if self.failure:
            raise GroupError(self.failure)
        command = Forward([c.id for c in caches], np.array(ids).astype(np.int64).tolist(), list(lengths),
                          list(logit_rows), commit)
        logits = self._do(command)
        with self._watchdog.armed(f"a forward of {sum(lengths)} rows"):
            try:
                self._send()
                self.replica.trail.evaluate(logits)
            except RuntimeError as exc:  # a rank's connection closed: the group cannot run another collective
                raise GroupError(self._down(exc, "during a forward")) from exc
        return logits

    def sync(self) -> None:
        """Between rounds: send what is queued (caches freed) and so hear at once of a rank that is gone."""
        if self.failure:
            return
        with self._watchdog.armed("a sync between rounds"):
            try:
                self._send()
            except RuntimeError as exc:
                self._down(exc, "between rounds")

    def keep(self, cache: GroupCache, rows: int) -> None:
        self._do(Keep(cache.id, rows))

    def mark(self, cache: GroupCache, tokens: int) -> None:
        self._do(Mark(cache.id, tokens))

    # -- taps stay on rank 0: its rows are whole after every reduce, and only its drafter reads them --

    @property
    def hidden_size(self) -> int:
        return self.inner.hidden_size

    def features(self, layers: Sequence[int]) -> None:
        self.inner.features(layers)

    def take_features(self, cache: GroupCache):
        return self.inner.take_features(cache.inner)

    def tap_from(self, cache: GroupCache, position: int) -> None:
        self.inner.tap_from(cache.inner, position)

    def embed(self, ids: mx.array) -> mx.array:
        return self.inner.embed(ids)

    def head(self, rows: mx.array) -> mx.array:
        return self.inner.head(rows)

    # -- the group --

    def report(self, held_bytes: int) -> dict:
        """The group for /health and capabilities: size, backend, each rank's held bytes (rank 0's: the ledger's)."""
        out = {"size": self.group.size(), "backend": self.backend, "status": "down" if self.failure else "ok",
               "held_bytes": [held_bytes] + [self.replica.held] * (self.group.size() - 1),
               "timeout_s": self.timeout}
        return {**out, "error": self.failure} if self.failure else out

    def close(self) -> None:
        """Tell the other ranks to leave (they exit 0); nothing more runs on the group."""
        if self.failure:
            return
        self._queue.append(Stop())
        with self._watchdog.armed("closing the group"):
            try:
                self._send()
            except RuntimeError as exc:
                log.warning("the group was down at close: %s", exc)
        self.failure = "the group is closed"

    def _do(self, command):
        out = self.replica.apply(command)  # first here: a refused call raises before any rank hears of it
        self._queue.append(command)
        return out

    def _cache(self, command) -> GroupCache:
        inner = self._do(command)
        # a handle has `mark` exactly where its cache has: admission asks for it that way
        handle = MarkedGroupCache(command.cache, inner, self) if hasattr(inner, "mark") else GroupCache(
            command.cache, inner)
        weakref.finalize(handle, self._freed.append, ("cache", command.cache))
        return handle

    def _send(self) -> None:
        if self._freed:
            gone = [self._freed.popleft() for _ in range(len(self._freed))]
            self._do(Free([key for kind, key in gone if kind == "cache"],
                          [key for kind, key in gone if kind == "state"]))
        commands, self._queue = self._queue, []
        self.channel.send(encode(commands))

    def _down(self, exc: Exception, when: str) -> str:
        self.failure = (f"the {self.backend} group of {self.group.size()} is down: {exc} (a rank failed {when}); "
                        "restart the group")
        log.error(self.failure)
        return self.failure

    def _expired(self, what: str) -> None:
        self.failure = (f"the {self.backend} group of {self.group.size()} is down: {what} waited more than "
                        f"{self.timeout:g} s for a rank ({TIMEOUT_ENV}); restart the group")
        _leave(self.failure)


def follow(model: Model, group: mx.distributed.Group, timeout: float | None = None) -> int:
    """A rank past 0: apply rank 0's commands to this shard until it stops (0) or the group fails (EXIT_GROUP_DOWN)."""
    rank, replica, channel = group.rank(), Replica(model), Channel(group)
    timeout = timeout_s() if timeout is None else timeout
    watchdog = Watchdog(timeout, lambda what: _leave(f"rank {rank}: {what} waited more than {timeout:g} s for a "
                                                    f"rank ({TIMEOUT_ENV}); leaving the group"))
    while True:
        try:
            commands = decode(channel.receive())  # idle between requests: no deadline here
        except RuntimeError as exc:
            log.error("rank %d: the group is down (%s); leaving", rank, exc)
            return EXIT_GROUP_DOWN
        for command in commands:
            if isinstance(command, Stop):
                return 0
            with watchdog.armed(f"a {type(command).__name__.lower()}"):
                try:
                    out = replica.apply(command)
                    if isinstance(command, Forward):
                        replica.trail.evaluate(out)
                except RuntimeError as exc:
                    log.error("rank %d: the group is down (%s); leaving", rank, exc)
                    return EXIT_GROUP_DOWN
                except ValueError as exc:  # this rank cannot do what rank 0 did: its shard is not rank 0's
                    _say(f"rank {rank}: {exc}; leaving the group")
                    return EXIT_GROUP_DOWN
