"""`tensorfold run`: greedy decoding in-process, printing text, token ids and what each round did."""

from __future__ import annotations

import time

from .lanes.engine import Engine
from .lanes.stream import Stream
from .lanes.types import DoneEvent, GenerationRequest, TokenEvent
from .options import ServeOptions


def check_run(model: str, prompt: str, *, max_tokens: int = 64, chat: bool = False, dtype: str = "auto",
              progress=lambda stage: None) -> dict:
    """Decode `prompt` greedily and report text, token ids and per-round stats."""
    from .host import load_target

    name, loaded, tokenizer, ckpt, probe = load_target(model, ServeOptions(dtype=dtype), progress)
    prompt_ids = (tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat
                  else tokenizer.encode(prompt))
    context = int(ckpt.config.get("max_position_embeddings") or 8192)
    request = GenerationRequest(prompt_ids=prompt_ids, max_tokens=min(max_tokens, context - len(prompt_ids)),
                                stop_token_ids=frozenset(tokenizer.eos_ids))
    events = []
    engine = Engine(loaded, shared_rounds=probe.get("row_invariant", False))
    cache = loaded.new_cache(len(prompt_ids) + request.max_tokens)
    engine.add(Stream(id=1, request=request, cache=cache, on_event=events.append,
                      limit=len(prompt_ids) + request.max_tokens))
    rounds, token_ids = [], []
    while not engine.idle():
        start = time.perf_counter()
        seen = len(events)
        engine.round()
        new = [t for e in events[seen:] if isinstance(e, TokenEvent) for t in e.token_ids]
        token_ids += new
        rounds.append({"tokens": len(new), "ms": round((time.perf_counter() - start) * 1000, 3)})
    done = next(e for e in events if isinstance(e, DoneEvent))
    decode_rounds = [r for r in rounds if r["tokens"]]
    decode_ms = sum(r["ms"] for r in decode_rounds[1:])
    return {
        "model": name,
        "prompt_ids": prompt_ids,
        "text": tokenizer.decode(token_ids),
        "token_ids": token_ids,
        "finish_reason": done.finish_reason,
        "usage": done.usage,
        "rounds": rounds,
        "decode_tokens_per_s": round(1000 * (len(token_ids) - 1) / decode_ms, 2) if decode_ms else None,
        "row_invariance": probe,
    }
