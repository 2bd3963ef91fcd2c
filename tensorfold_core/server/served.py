"""What the server needs of a host: the one interface it types against (tensorfold_core.host.Host gives it)."""

from __future__ import annotations

from typing import Callable, Hashable, Protocol, runtime_checkable

from ..lanes.types import GenerationRequest
from ..tokenizer import Tokenizer


@runtime_checkable
class ServedHost(Protocol):
    """A model being served: its name, context and tokenizer, and the engine's submit / cancel / reports."""

    model_id: str
    context: int
    tokenizer: Tokenizer

    def submit(self, request: GenerationRequest, on_event: Callable, prompt_param: str = "prompt") -> Hashable:
        """Queue a request; one that can never be served raises RequestError naming `prompt_param`."""

    def cancel(self, ticket: Hashable) -> None:
        """End the request at its next round (a queued one at once)."""

    def health(self) -> dict:
        """Liveness and load: status, streams, queue, rounds, memory; called on the event loop, so it only reads."""

    def capabilities(self) -> dict:
        """What the install can do and how this host serves."""

    def streams_report(self) -> list[dict]:
        """Each stream decoding now: id, prompt_tokens, generated, rounds, drafted, accepted, tokens_per_s."""

    def metrics(self) -> dict:
        """Counters for /metrics: running, waiting, ledger bytes by kind, budget, prompt cache, spec decoding."""
