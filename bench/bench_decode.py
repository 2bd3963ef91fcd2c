"""Single-stream greedy decode on code prompts: tensorfold drafted and plain against mlx-lm, ids checked first."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

import openai

from common import (CODE_PROMPTS, MODEL, BenchMismatch, blas_env, capabilities, check_same_replies, complete,
                    decode_rate, exit_code, fail_if_any, median, model_dir, platform_lines, server, spread, table,
                    tokenize)

WARM_UP = "x = 1\n"  # a prompt no timed cell uses, so its kept state and drafter slot help none of them


@dataclass(frozen=True)
class Cell:
    """One way of decoding: a server's flags and the requests' `draft`, or mlx-lm with or without a draft model."""

    name: str
    what: str
    flags: tuple[str, ...] = ()
    draft: bool = True
    mlx_lm: bool = False
    draft_model: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # the server's environment on top of the run's


CELLS = [
    Cell("serial", "`--drafter none`, requests `\"draft\": false` (the reference)", ("--drafter", "none"), False),
    Cell("copy", "`--drafter none`, requests drafted (copy drafts only)", ("--drafter", "none")),
    Cell("serial@drafter", "default drafter, requests `\"draft\": false`", (), False),
    Cell("drafted", "default drafter (tiny-llama-drafter, bf16 checkpoint)"),
    Cell("drafted-4bit", "`--drafter tiny-llama-drafter-4bit`", ("--drafter", "tiny-llama-drafter-4bit")),
    Cell("serial-op-by-op", "as serial, each layer's parts run op by op (`TENSORFOLD_COMPILE=0`)",
         ("--drafter", "none"), False, env=(("TENSORFOLD_COMPILE", "0"),)),
    Cell("drafted-op-by-op", "as drafted, each layer's parts run op by op (`TENSORFOLD_COMPILE=0`)",
         env=(("TENSORFOLD_COMPILE", "0"),)),
    Cell("mlx-lm", "mlx_lm.stream_generate, same checkpoint dir", mlx_lm=True),
    Cell("mlx-lm-spec", "mlx_lm.stream_generate, draft_model=tiny-llama-drafter", mlx_lm=True,
         draft_model="tiny-llama-drafter"),
]
BASELINE = "serial"


@dataclass
class Result:
    """One cell run: per-prompt replies, the decode rate, and what the server said about itself."""

    replies: list[dict]
    rate: float
    served: dict = field(default_factory=dict)


def run_tensorfold(cell: Cell, dtype: str, env: dict, prompts: list[list[int]], tokens: int) -> Result:
    flags = ["--dtype", dtype, *cell.flags]
    with server(MODEL, *flags, env={**env, **dict(cell.env)}) as url:
        caps = capabilities(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=1200)
        complete(client, tokenize([WARM_UP])[0], 8, draft=cell.draft)
        replies = [complete(client, p, tokens, draft=cell.draft) for p in prompts]
    served = {"drafter": caps.get("drafter"), "row_invariance": caps.get("row_invariance", {})}
    return Result(replies, decode_rate(replies), served)


def run_mlx_lm(cell: Cell, dtype: str, env: dict, prompts: list[list[int]], tokens: int, num_draft: int) -> Result:
    """A fresh worker process (this script with --mlx-lm-worker), so every cell starts alike."""
    job = {"model": model_dir(MODEL), "draft": model_dir(cell.draft_model) if cell.draft_model else None,
           "num_draft": num_draft, "dtype": dtype, "prompts": prompts, "tokens": tokens,
           "warm_up": tokenize([WARM_UP])[0]}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--mlx-lm-worker"], input=json.dumps(job),
                          capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(f"mlx-lm worker failed: {proc.stderr[-2000:]}")
    replies = json.loads(proc.stdout.strip().splitlines()[-1])
    return Result(replies, decode_rate(replies))


def mlx_lm_worker() -> int:
    """Greedy decode with mlx-lm (speculative when a draft model is given); replies as JSON on stdout."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import stream_generate

    job = json.load(sys.stdin)
    model, tokenizer = mlx_lm.load(job["model"])
    draft = mlx_lm.load(job["draft"])[0] if job["draft"] else None
    if job["dtype"] != "auto":
        for m in (model, draft):
            if m is not None:
                m.set_dtype(getattr(mx, job["dtype"]))
    extra = {"draft_model": draft, "num_draft_tokens": job["num_draft"]} if draft is not None else {}

    def one(prompt: list[int], tokens: int) -> dict:
        ids, first, last, finish, offered = [], None, None, None, 0
        start = time.perf_counter()
        for response in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=tokens, **extra):
            now = time.perf_counter() - start
            finish = response.finish_reason
            if finish == "stop":  # the final response of a stop carries the eos, which no reply contains
                break
            ids.append(response.token)
            offered += bool(response.from_draft)
            first = now if first is None else first
            last = now
        return {"ids": ids, "finish": finish, "first": first, "last": last, "wall": time.perf_counter() - start,
                "stats": {"accepted": offered} if draft is not None else {}}

    one(job["warm_up"], 8)
    print(json.dumps([one(p, job["tokens"]) for p in job["prompts"]]))
    return 0


def check(name: str, results: list[Result], reference: list[list[int]]) -> None:
    """Every rep's replies against the serial reference, full ids and lengths; BenchMismatch names the first."""
    for rep, result in enumerate(results):
        check_same_replies(f"cell {name}, rep {rep + 1}", reference, [reply["ids"] for reply in result.replies])


def draft_columns(cell: Cell, results: list[Result]) -> tuple[str, str]:
    """Tokens committed per target round, and drafts kept / offered, summed over reps."""
    stats = [r["stats"] for res in results for r in res.replies]
    tokens = sum(len(r["ids"]) for res in results for r in res.replies)
    if cell.mlx_lm:
        return "-", (f"{sum(s.get('accepted', 0) for s in stats)} kept" if cell.draft_model else "-")
    rounds = sum(s.get("rounds", 0) for s in stats)
    offered, kept = sum(s.get("drafted", 0) for s in stats), sum(s.get("accepted", 0) for s in stats)
    per_round = f"{tokens / rounds:.2f}" if rounds else "-"
    return per_round, (f"{kept}/{offered} ({kept / offered:.0%})" if offered else "0")


def report(config: tuple[str, str], cells: list[Cell], runs: dict[str, list[Result]],
           prompts: list[str]) -> list[BenchMismatch]:
    """The config's table; a cell whose ids differ gets FAIL and no speed, and comes back in the list."""
    dtype, blas = config
    print(f"\n## dtype {dtype}, BLAS {blas}\n")
    served = next((r.served for c in cells if not c.mlx_lm for r in runs[c.name] if r.served), {})
    verdict = served.get("row_invariance", {})
    print(f"row-invariance probe: {'pass' if verdict.get('row_invariant') else 'FAIL'} ({verdict.get('detail')})")
    for c in cells:
        if not c.mlx_lm and c.flags != ("--drafter", "none"):
            drafters = {r.served.get("drafter") for r in runs[c.name]}
            print(f"{c.name}: server drafter {', '.join(str(d) for d in drafters)}")
    reference = [r["ids"] for r in runs[BASELINE][0].replies]
    finishes = [r["finish"] for r in runs[BASELINE][0].replies]
    print(f"reference: {len(reference)} prompts, {sum(map(len, reference))} tokens "
          f"({finishes.count('stop')} ended at an eos)")
    rows, failures = [], []
    base_rates = [r.rate for r in runs[BASELINE]]
    for c in cells:
        try:
            check(f"{c.name} ({dtype}, BLAS {blas})", runs[c.name], reference)
        except BenchMismatch as failure:
            failures.append(failure)
            rows.append([c.name, f"FAIL: {failure}", "-", "-", "-", "-", "-"])
            continue
        rates = [r.rate for r in runs[c.name]]
        ratios = [a / b for a, b in zip(rates, base_rates) if b]
        per_round, kept = draft_columns(c, runs[c.name])
        rows.append([c.name, "equal", f"{median(rates):.1f}", spread(rates), f"{median(ratios):.2f}x", per_round,
                     kept])
    print()
    print(table(["cell", "token ids", "tok/s (median)", "range", f"vs {BASELINE}", "tokens/round", "drafts kept"],
                rows))
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each reply")
    parser.add_argument("--reps", type=int, default=3, help="rounds over every cell, in a rotated order")
    parser.add_argument("--prompts", type=int, default=len(CODE_PROMPTS), help="how many of the code prompts")
    parser.add_argument("--dtypes", default="auto,float32", help="comma list of --dtype values")
    parser.add_argument("--blas", default="bundled", help="comma list: bundled, openblas, openblas-CORE (e.g. openblas-nehalem)")
    parser.add_argument("--cells", default=",".join(c.name for c in CELLS), help="comma list of cells")
    parser.add_argument("--mlx-draft", type=int, default=3, help="mlx-lm's num_draft_tokens")
    parser.add_argument("--mlx-lm-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mlx_lm_worker:
        return mlx_lm_worker()
    names = args.cells.split(",")
    unknown = set(names) - {c.name for c in CELLS}
    if unknown:
        parser.error(f"unknown cells {sorted(unknown)}")
    cells = [c for c in CELLS if c.name in names or c.name == BASELINE]
    texts = CODE_PROMPTS[:args.prompts]
    prompts = tokenize(texts)
    configs = [(d, b) for b in args.blas.split(",") for d in args.dtypes.split(",")]
    print("\n".join(platform_lines(args.blas)))
    print(f"{len(prompts)} prompts ({sum(map(len, prompts))} prompt tokens), {args.tokens} tokens each, greedy; "
          f"{args.reps} reps; cells alternate within each rep, a fresh process per cell")
    runs = {config: {c.name: [] for c in cells} for config in configs}
    for rep in range(args.reps):
        for k, config in enumerate(configs):
            shift = (rep + k) % len(cells)
            for c in cells[shift:] + cells[:shift]:  # a rotated order, so no cell always runs first
                dtype, blas = config
                env = blas_env(blas)
                started = time.perf_counter()
                if c.mlx_lm:
                    result = run_mlx_lm(c, dtype, env, prompts, args.tokens, args.mlx_draft)
                else:
                    result = run_tensorfold(c, dtype, env, prompts, args.tokens)
                runs[config][c.name].append(result)
                print(f"rep {rep + 1} {dtype}/{blas} {c.name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    failures = [f for config in configs for f in report(config, cells, runs[config], texts)]
    print("\n".join(["", *platform_lines()[:1]]))
    fail_if_any(failures)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
