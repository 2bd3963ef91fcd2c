"""Prompt cache: time to first token of a long prompt cold, then resumed from its kept state; ratio printed."""

from __future__ import annotations

import argparse
import sys
import time

import openai

from common import BenchMismatch, check_same_ids, exit_code, server

REPLY_TOKENS = 16  # enough of a reply that a resume from a wrong state shows in its ids


def first_token(client, prompt_ids: list[int]) -> tuple[float, int, list[int]]:
    """Seconds to the first streamed token, the cached tokens the usage reports, and the reply's ids."""
    start = time.perf_counter()
    stream = client.completions.create(model="bench", prompt=prompt_ids, max_tokens=REPLY_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"return_token_ids": True})
    ttft, cached, ids = None, 0, []
    for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - start
        for choice in chunk.choices:
            ids += getattr(choice, "token_ids", None) or []
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return ttft, cached, ids


def check_resumed(model: str, cold: list[int], resumed: list[int]) -> None:
    """The resumed reply must be the cold one, token for token: a kept state that changes the reply is a bug."""
    if not cold:
        raise BenchMismatch(f"{model}: the cold reply has no token ids to compare")
    check_same_ids(f"{model}: the resumed reply against the cold one", cold, resumed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--require-cold", action="store_true", help="fail unless the first run reports 0 cached")
    parser.add_argument("--require-reuse", action="store_true", help="fail unless the repeat reuses the prompt")
    args = parser.parse_args(argv)
    prompt = [(i * 7919) % 7000 + 100 for i in range(args.tokens)]
    flags = ["--context", str(args.tokens + REPLY_TOKENS + 64), "--model-name", "bench", "--drafter", "none"]
    with server(args.model, *flags) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
        cold, cold_cached, cold_ids = first_token(client, prompt)
        warm, warm_cached, warm_ids = first_token(client, prompt)
    check_resumed(args.model, cold_ids, warm_ids)
    print(f"model {args.model}, prompt {args.tokens} tokens; resumed reply equal to the cold one "
          f"({len(cold_ids)} tokens)")
    print(f"cold:    first token {cold * 1000:9.1f} ms, cached_tokens {cold_cached}")
    print(f"resumed: first token {warm * 1000:9.1f} ms, cached_tokens {warm_cached}")
    print(f"ratio cold/resumed: {cold / warm:.1f}x")
    ok = True
    if args.require_cold and cold_cached != 0:
        print("FAIL: the cold run reported cached tokens")
        ok = False
    if args.require_reuse and warm_cached < args.tokens - 1:
        print(f"FAIL: the repeat resumed {warm_cached} of {args.tokens - 1} tokens")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(exit_code(main))
