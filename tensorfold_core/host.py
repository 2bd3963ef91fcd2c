"""The engine thread: submit / cancel / events, admission up to --parallel, and model loading for serving."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from . import __version__
from .backend import device_info
from .errors import RequestError
from .lanes.engine import Engine
from .lanes.stream import Stream
from .lanes.types import DoneEvent, GenerationRequest
from .memory.admission import Admission
from .memory.ledger import GIB, Ledger, default_budget
from .memory.prompt_cache import PromptCache
from .options import ServeOptions
from .protocols import Model
from .tokenizer import Tokenizer

log = logging.getLogger("tensorfold")
DEFAULT_CONTEXT_CAP = 8192


@dataclass(frozen=True)
class Ticket:
    """A submitted request's handle, for cancel()."""

    id: int


class Host:
    """Owns the model and the one thread that runs MLX; the server talks to it through submit and cancel."""

    def __init__(self, model: Model, tokenizer: Tokenizer, options: ServeOptions, *, model_id: str,
                 context: int, info: dict | None = None, drafter=None, start: bool = True, timed: bool = True):
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.model_id = model_id
        self.context = context
        self.info = dict(info or {})
        shared = self.info.get("row_invariance", {}).get("row_invariant", True)
        self.drafter = drafter
        budget = int(options.memory_gib * GIB) if options.memory_gib else default_budget()
        self.ledger = Ledger(budget)
        prompt_cache = PromptCache(self.ledger, int(options.prompt_cache_gib * GIB))
        self.admission = Admission(model, self.ledger, prompt_cache, drafter, resume=shared,
                                   marks=options.prefill_chunk)
        self.engine = Engine(model, prefill_chunk=options.prefill_chunk, shared_rounds=shared, drafter=drafter,
                             timed=timed, on_leave=self.admission.leave)
        memory = {"budget_bytes": budget, "prompt_cache_cap_bytes": prompt_cache.cap_bytes,
                  "prompt_cache_resumes": shared}
        self._capabilities = capabilities(options, extra={"model": model_id, "context": context,
                                                          "memory": memory, **self.info})
        self._ids = itertools.count(1)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Stream] = deque()
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="tensorfold-engine", daemon=True)
        if start:
            self._thread.start()

    def validate(self, request: GenerationRequest) -> None:
        """Refuse at once what can never be served; the message carries the numbers."""
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestError("the prompt has no tokens", param="prompt")
        if n >= self.context:
            raise RequestError(f"this model's context is {self.context} tokens; the prompt has {n} "
                               f"(at least one must be left for the reply)", param="messages",
                               code="context_length_exceeded")
        bad = next((t for t in request.prompt_ids if not 0 <= t < self.model.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{self.model.vocab_size - 1})",
                               param="prompt")
        if request.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        self.admission.check(self.limit(request))

    def limit(self, request: GenerationRequest) -> int:
        """Most tokens the stream may hold: prompt + max_tokens, within the context."""
        return min(self.context, len(request.prompt_ids) + request.max_tokens)

    def submit(self, request: GenerationRequest, on_event: Callable) -> Ticket:
        self.validate(request)
        ticket = Ticket(next(self._ids))
        self._inbox.put(("submit", ticket.id, request, on_event))
        self._wake.set()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        self._inbox.put(("cancel", ticket.id, None, None))
        self._wake.set()


    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, stream_id, request, on_event = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                self._waiting.append((stream_id, request, on_event))
                continue
            queued = next((w for w in self._waiting if w[0] == stream_id), None)
            if queued is not None:
                self._waiting.remove(queued)
                usage = {"prompt_tokens": len(queued[1].prompt_ids), "completion_tokens": 0,
                         "total_tokens": len(queued[1].prompt_ids), "prompt_tokens_details": {"cached_tokens": 0}}
                queued[2](DoneEvent(finish_reason="cancelled", usage=usage))
            else:
                self.engine.cancel(stream_id)

    def _admit(self) -> None:
        """First come, first served: a stream that does not fit waits, and so do those behind it."""
        while self._waiting and len(self.engine.streams) < self.options.parallel:
            stream_id, request, on_event = self._waiting[0]
            limit = self.limit(request)
            admitted = self.admission.admit(stream_id, request.prompt_ids, limit)
            if admitted is None:
                return
            self._waiting.popleft()
            cache, cached_tokens = admitted
            self.engine.add(Stream(id=stream_id, request=request, cache=cache, on_event=on_event, limit=limit,
                                   cached_tokens=cached_tokens))

    def _loop(self) -> None:
        while not self._closed:
            self._drain_inbox()
            self._admit()
            if self.engine.idle():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                self.engine.round()
            except Exception:  # keep serving: the engine already failed the streams it could name
                log.exception("round failed")

    def queued(self) -> int:
        return len(self._waiting)

    def health(self) -> dict:
        return {"status": "ok", "model": self.model_id, "streams": len(self.engine.streams),
                "queued": self.queued(), "rounds": self.engine.rounds, "memory": self.admission.snapshot()}

    def capabilities(self) -> dict:
        # the static part was worked out at load (MLX is touched only by the loading and engine threads)
        live = {"memory": {**self._capabilities["memory"], **self.admission.snapshot()}, "queued": self.queued()}
        return {**self._capabilities, **live}

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if self.drafter is not None and hasattr(self.drafter, "close"):
            self.drafter.close()


def capabilities(options: ServeOptions, extra: dict | None = None) -> dict:
    """What this install can do and how it serves: version, backend, device, plugins, serve flags."""
    from .plugins import registry

    reg = registry()
    return {
        "version": __version__,
        **device_info(),
        "families": [{"name": f.name, "model_types": list(f.model_types)} for f in reg.families()],
        "drafters": [d.name for d in reg.drafters()],
        "models": [{"name": m.name, "role": m.role, "default": m.default} for m in reg.models()],
        "plugins": reg.roll_call(),
        "serve_flags": {name: {"default": field.default, "description": field.description}
                        for name, field in ServeOptions.model_fields.items()},
        "options": options.model_dump(),
        **(extra or {}),
    }


def load_target(model: str | None, options: ServeOptions, progress: Callable[[str], None] = lambda stage: None):
    """Resolve, refuse drafter-only checkpoints by name, load, and probe row invariance."""
    from .checkpoint import load_model
    from .errors import DrafterError
    from .probe import row_invariance
    from .plugins import registry
    from .specs import LoadOptions

    progress("resolving")
    name = model or registry().default_model().name
    shipped = registry().shipped(name)
    if shipped is not None and shipped.role == "drafter":
        raise DrafterError(f"{name} is admitted only as a drafter; serve a target with --drafter {name}")
    progress("loading weights")
    loaded, tokenizer, ckpt = load_model(name, LoadOptions(dtype=options.dtype))
    progress("probing row invariance")
    probe = row_invariance(loaded)
    return name, loaded, tokenizer, ckpt, probe


def _blas_hint() -> str:
    """Where a preloaded OpenBLAS broke row invariance, the kernels known to keep it (docs/performance.md)."""
    preloaded = "openblas" in os.environ.get("LD_PRELOAD", "").lower()
    return "; with OpenBLAS preloaded, OPENBLAS_CORETYPE=Nehalem keeps rows invariant" if preloaded else ""


def load_host(model: str | None, options: ServeOptions,
              progress: Callable[[str], None] = lambda stage: None, timed: bool = True) -> Host:
    """Load the target and its drafter, and start the engine thread over them (untimed: depths never read the
    clock, so tests see the same drafts however busy the machine is)."""
    from .drafting import drafter_name, start_drafter

    name, loaded, tokenizer, ckpt, probe = load_target(model, options, progress)
    drafter, draft_name = None, drafter_name(name, options.drafter)
    if not probe.get("row_invariant", False):
        log.warning("backend is not row-invariant (%s): each stream runs its own forward, undrafted%s",
                    probe.get("detail"), _blas_hint())
    elif draft_name is not None:
        progress(f"starting drafter {draft_name}")
        drafter = start_drafter(draft_name, options.drafter_bits, loaded, tokenizer, dtype=options.dtype)
    max_positions = int(ckpt.config.get("max_position_embeddings") or DEFAULT_CONTEXT_CAP)
    context = options.context or min(max_positions, DEFAULT_CONTEXT_CAP)
    model_id = options.model_name or name
    info = {"row_invariance": probe, "checkpoint": str(ckpt.path), "model_type": ckpt.model_type,
            "drafter": draft_name if drafter is not None else None}
    return Host(loaded, tokenizer, options, model_id=model_id, context=context, info=info, drafter=drafter,
                timed=timed)
