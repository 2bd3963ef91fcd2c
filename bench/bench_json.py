"""Constrained JSON decoding: drafted against `"draft": false` on one server, ids checked first, and the grammar's
per-token cost (llguidance's mask plus its advance) against a plain token's time."""

from __future__ import annotations

import argparse
import time

import openai

from common import (MODEL, BenchMismatch, blas_env, check_same_replies, exit_code, fail_if_any, median,
                    platform_lines, server, spread, table)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "email": {"type": "string", "maxLength": 32},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}
RECORDS = {"type": "array", "maxItems": 6, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "path", "size", "ok"],
    "properties": {"id": {"type": "integer"}, "path": {"type": "string", "maxLength": 24},
                   "size": {"type": "integer"}, "ok": {"type": "boolean"}}}}
SCHEMAS = {"person": PERSON, "records": RECORDS}
ASKS = ["Describe a person as JSON.", "import os\nimport sys\n", "List the files as JSON records.",
        "def scan(root):\n", "class Config:\n"]


def ask(client, schema: dict, content: str, tokens: int, draft: bool) -> dict:
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=tokens, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}},
        extra_body={"draft": draft, "return_token_ids": True})
    choice = reply.choices[0]
    return {"ids": choice.token_ids, "wall": time.perf_counter() - start, "text": choice.message.content,
            "stats": reply.usage.model_extra["tensorfold"], "finish": choice.finish_reason}


def grammar_cost(schema: dict, replies: list[dict]) -> float:
    """Microseconds per token of the grammar alone: each reply's ids replayed through a fresh matcher, timing its
    mask (as the row stage reads it) and its advance."""
    from tensorfold_core.lanes.constraints import Grammar
    from tensorfold_core.loading import open_checkpoint
    from tensorfold_core.server.structured import Grammars, json_grammar

    tokenizer = open_checkpoint(MODEL).tokenizer()
    grammars = Grammars(tokenizer)
    grammar = Grammar(json_grammar(schema), grammars.guidance)
    seconds, tokens = 0.0, 0
    for reply in replies:
        constraint = grammar.matcher(8192)
        for token in reply["ids"]:
            start = time.perf_counter()
            constraint.allowed()
            constraint.consume(token)
            seconds += time.perf_counter() - start
            tokens += 1
    return 1e6 * seconds / max(tokens, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--blas", default="openblas-nehalem", help="bundled, openblas or openblas-CORE")
    args = parser.parse_args()
    print("\n".join(platform_lines(args.blas)))
    rows, failures = [], []
    with server(MODEL, "--dtype", args.dtype, "--parallel", "1", env=blas_env(args.blas)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=1200)
        ask(client, PERSON, "warm up", 16, True)
        for name, schema in SCHEMAS.items():
            plain_runs, drafted_runs = [], []
            for _ in range(args.reps):
                plain_runs.append([ask(client, schema, a, args.tokens, False) for a in ASKS])
                drafted_runs.append([ask(client, schema, a, args.tokens, True) for a in ASKS])
            try:  # ids first: a cell whose tokens differ gets no speed
                for plain, drafted in zip(plain_runs, drafted_runs):
                    check_same_replies(f"{name} drafted vs plain", [r["ids"] for r in plain],
                                       [r["ids"] for r in drafted])
            except BenchMismatch as exc:
                failures.append(exc)
                rows.append([name, "FAIL", "", "", "", "", ""])
                continue
            rate = lambda run: sum(len(r["ids"]) for r in run) / sum(r["wall"] for r in run)
            plain_rates = [rate(run) for run in plain_runs]
            drafted_rates = [rate(run) for run in drafted_runs]
            stats = [r["stats"] for r in drafted_runs[0]]
            accepted = sum(s["accepted"] for s in stats) / max(sum(s["drafted"] for s in stats), 1)
            tokens = sum(len(r["ids"]) for r in plain_runs[0])
            cost_us = grammar_cost(schema, plain_runs[0])
            plain_ms = 1000.0 / median(plain_rates)
            rows.append([name, f"{tokens}", f"{median(plain_rates):.1f} ({spread(plain_rates)})",
                         f"{median(drafted_rates):.1f} ({spread(drafted_rates)})",
                         f"{median(drafted_rates) / median(plain_rates):.2f}x", f"{accepted:.0%}",
                         f"{cost_us:.0f} us ({cost_us / 10 / plain_ms:.1f}%)"])
    print(table(["schema", "tokens/rep", "plain tok/s", "drafted tok/s", "drafted/plain", "drafts kept",
                 "grammar per token (of a plain token)"], rows))
    fail_if_any(failures)
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_code(main))
