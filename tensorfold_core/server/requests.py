"""A request body's fields as the engine's requests: sampling, penalties, logit_bias, logprobs, grammar, n seeds."""

from __future__ import annotations

import uuid

from ..errors import RequestError
from ..lanes.constraints import Grammar
from ..lanes.rows import Penalties
from ..lanes.types import GenerationRequest
from ..sampling import SamplingParams, seed_from_prompt
from .served import ServedHost

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs (vLLM's default for completions' logprobs too)


def logit_bias(raw: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({"token id": bias in [-100, 100]}) as sorted (id, bias) pairs; bad keys are a 400."""
    pairs = []
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias: token id {token} is outside the vocabulary (0..{vocab_size - 1})",
                               param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise RequestError(f"logit_bias: bias {value} for token {token} is outside [-100, 100]",
                               param="logit_bias")
        pairs.append((token, float(value)))
    return tuple(sorted(pairs))


def choice_seeds(seed: int | None, prompt_ids: list[int], n: int) -> list[int]:
    """The i-th of n choices is keyed by seed + i (a request without a seed: the prompt's own seed + i), so
    choice 0 is the reply the same request with n = 1 gets."""
    base = seed if seed is not None else seed_from_prompt(prompt_ids)
    return [(base + i) & 0xFFFFFFFFFFFFFFFF for i in range(n)]


def engine_requests(host: ServedHost, body, prompt_ids: list[int], *, streams: int, logprobs: int | None,
                    grammar: Grammar | None) -> list[GenerationRequest]:
    """One GenerationRequest per stream the body asks for (n, or best_of); eos ids are stop tokens; no limit is
    the rest of the context. Streams of one request read their shared prompt once (a prefill group)."""
    limit = body.token_limit()
    max_tokens = limit if limit is not None else max(1, host.context - len(prompt_ids))
    vocab = host.tokenizer.backend.get_vocab_size(with_added_tokens=True)
    penalties = Penalties(presence=body.presence_penalty, frequency=body.frequency_penalty,
                          repetition=body.repetition_penalty, bias=logit_bias(body.logit_bias, vocab))
    group = uuid.uuid4().hex if streams > 1 else None
    out = []
    for seed in choice_seeds(body.seed, prompt_ids, streams):
        sampling = SamplingParams(temperature=body.temperature, top_k=max(0, body.top_k), top_p=body.top_p,
                                  min_p=body.min_p, seed=seed)
        out.append(GenerationRequest(prompt_ids=list(prompt_ids), max_tokens=max_tokens, sampling=sampling,
                                     stop_token_ids=frozenset(host.tokenizer.eos_ids), draft=body.draft,
                                     penalties=penalties, logprobs=logprobs, grammar=grammar, prefill_group=group))
    return out
