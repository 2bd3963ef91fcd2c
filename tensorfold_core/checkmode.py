"""`tensorfold run`: greedy decoding in-process, printing text, token ids and what each round did."""

from __future__ import annotations

import time

from .lanes.engine import Engine
from .lanes.stream import Stream
from .lanes.types import DoneEvent, GenerationRequest, TokenEvent
from .errors import OptionError
from .loading import load_target, start_drafter
from .options import ServeOptions
from .protocols import MAX_DRAFT_DEPTH
from .specs import DrafterOptions


def parse_draft(value: str | None) -> tuple[str, int] | None:
    """`DRAFTER,N` into (drafter, depth)."""
    if value is None:
        return None
    name, _, depth = value.rpartition(",")
    if not name or not depth.isdigit() or not 1 <= int(depth) <= MAX_DRAFT_DEPTH:
        raise OptionError(f"--draft {value}: expected DRAFTER,N with N from 1 to {MAX_DRAFT_DEPTH}")
    return name, int(depth)


def decode(engine: Engine, request: GenerationRequest, capacity: int) -> tuple[list[int], list[dict], DoneEvent]:
    """One stream through `engine` to its end: token ids, per-round stats, and its done event."""
    events = []
    stream = Stream(id=1, request=request, cache=engine.model.new_cache(capacity), on_event=events.append,
                    limit=capacity)
    engine.add(stream)
    rounds, token_ids = [], []
    while not engine.idle():
        start = time.perf_counter()
        seen, drafted, accepted = len(events), stream.stats.drafted, stream.stats.accepted
        engine.round()
        new = [t for e in events[seen:] if isinstance(e, TokenEvent) for t in e.token_ids]
        token_ids += new
        rounds.append({"tokens": len(new), "drafted": stream.stats.drafted - drafted,
                       "kept": stream.stats.accepted - accepted,
                       "ms": round((time.perf_counter() - start) * 1000, 3)})
    return token_ids, rounds, next(e for e in events if isinstance(e, DoneEvent))


def check_run(model: str, prompt: str, *, max_tokens: int = 64, chat: bool = False, dtype: str = "auto",
              draft: str | None = None, progress=lambda stage: None) -> dict:
    """Decode `prompt` greedily (through a drafter's windows with --draft) and report tokens and rounds."""
    drafting = parse_draft(draft)
    target = load_target(model, ServeOptions(dtype=dtype), progress)
    loaded, tokenizer = target.model, target.tokenizer
    prompt_ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
                  else tokenizer.encode(prompt))
    context = target.context()
    request = GenerationRequest(prompt_ids=prompt_ids, max_tokens=min(max_tokens, context - len(prompt_ids)),
                                stop_token_ids=frozenset(tokenizer.eos_ids))
    capacity = len(prompt_ids) + request.max_tokens
    plain = Engine(loaded, shared_rounds=target.row_invariant, copy_drafts=False)
    token_ids, rounds, done = decode(plain, request, capacity)
    result = {}
    if drafting is not None:
        drafter = start_drafter(drafting[0], loaded, tokenizer, DrafterOptions(dtype=dtype))
        engine = Engine(loaded, shared_rounds=target.row_invariant, drafter=drafter,
                        fixed_depth=drafting[1], copy_drafts=False)
        drafted_ids, drafted_rounds, drafted_done = decode(engine, request, capacity)
        result = {"drafter": drafting[0], "depth": drafting[1], "plain_token_ids": token_ids,
                  "equal_to_plain": drafted_ids == token_ids, "plain_rounds": len(rounds)}
        token_ids, rounds, done = drafted_ids, drafted_rounds, drafted_done
    decode_rounds = [r for r in rounds if r["tokens"]]
    decode_ms = sum(r["ms"] for r in decode_rounds[1:])
    return {
        "model": target.name,
        "prompt_ids": prompt_ids,
        "text": tokenizer.decode(token_ids),
        "token_ids": token_ids,
        "finish_reason": done.finish_reason,
        "usage": done.usage,
        "rounds": rounds,
        "decode_tokens_per_s": round(1000 * (len(token_ids) - 1) / decode_ms, 2) if decode_ms else None,
        "row_invariance": target.probe,
        "kernels": target.model.kernels,
        **result,
    }
