"""On a GPU: the load probe, drafted == plain == concurrent, and plain decode speed, per kernel table mode.

Each mode runs in a child process with TENSORFOLD_KERNELS set: `builtin` (MLX's own ops everywhere) and `records`
(the family's table: its kernel records where it names them). Rounds are forced shared and drafted even where the
probe fails, so a backend that is not row-invariant shows its mismatches instead of hiding them.
Usage: python3 tools/device/gpu_exact.py --out DIR [--model tiny-llama] [--drafter tiny-llama-drafter]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Point:\n    def __init__(self, x, y):\n",
           "def fib(n):\n    if n < 2:\n", "for i in range(10):\n    print(", "import json\n\n\ndef load(path):\n",
           "    def __repr__(self):\n        return", "try:\n    import numpy as np\nexcept ImportError:\n",
           "def parse_args():\n    parser = argparse.ArgumentParser("]


def decode_all(engine_of, requests, together: bool) -> list[list[int]]:
    """Each request's token ids: alone in a fresh engine each, or all streams in one engine's shared rounds."""
    from tensorfold_core.lanes.stream import Stream
    from tensorfold_core.lanes.types import TokenEvent

    groups = [list(range(len(requests)))] if together else [[i] for i in range(len(requests))]
    out: list[list[int]] = [[] for _ in requests]
    for group in groups:
        engine = engine_of()
        for i in group:
            request = requests[i]
            limit = len(request.prompt_ids) + request.max_tokens
            on_event = (lambda i: lambda e: out[i].extend(e.token_ids) if isinstance(e, TokenEvent) else None)(i)
            engine.add(Stream(id=i + 1, request=request, cache=engine.model.new_cache(limit), on_event=on_event,
                              limit=limit))
        engine.run_until_idle()
    return out


def child(args) -> dict:
    import mlx.core as mx

    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.loading import load_target, start_drafter
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.sampling import SamplingParams
    from tensorfold_core.specs import DrafterOptions

    target = load_target(args.model, ServeOptions(dtype="bfloat16"))
    model, tokenizer = target.model, target.tokenizer
    drafter = start_drafter(args.drafter, model, tokenizer, DrafterOptions(dtype="bfloat16"))
    report = {"mode": os.environ.get("TENSORFOLD_KERNELS"), "device": str(mx.default_device()),
              "kernels": model.kernels, "probe": target.probe, "cases": 0, "mismatches": []}
    for label, sampling in (("greedy", lambda i: SamplingParams()),
                            ("seeded", lambda i: SamplingParams(temperature=0.8, seed=100 + i))):
        requests = [GenerationRequest(prompt_ids=tokenizer.encode(p), max_tokens=args.tokens, sampling=sampling(i),
                                      stop_token_ids=frozenset(tokenizer.eos_ids)) for i, p in enumerate(PROMPTS)]
        serial = [GenerationRequest(r.prompt_ids, r.max_tokens, r.sampling, r.stop_token_ids, draft=False)
                  for r in requests]
        start = time.perf_counter()
        plain = decode_all(lambda: Engine(model, copy_drafts=False), serial, together=False)
        plain_s = time.perf_counter() - start
        runs = {
            "drafted alone": decode_all(lambda: Engine(model, drafter=drafter, copy_drafts=True), requests, False),
            "plain together": decode_all(lambda: Engine(model, copy_drafts=False), serial, True),
            "drafted together": decode_all(lambda: Engine(model, drafter=drafter), requests, True),
        }
        tokens = sum(len(ids) for ids in plain)
        report[f"{label} plain tok/s (one stream at a time, prefill included)"] = round(tokens / plain_s, 1)
        for name, ids in runs.items():
            for i, (want, got) in enumerate(zip(plain, ids)):
                report["cases"] += 1
                if want != got:
                    at = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                    report["mismatches"].append(f"{label} {name} prompt {i}: first difference at token {at}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--drafter", default="tiny-llama-drafter")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    reports, failed = [], False
    for mode in ("builtin", "records"):
        env = dict(os.environ, TENSORFOLD_KERNELS=mode)
        done = subprocess.run([sys.executable, __file__, "--child", "--out", str(args.out), "--model", args.model,
                               "--drafter", args.drafter, "--tokens", str(args.tokens)], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            reports.append({"mode": mode, "error": done.stderr[-3000:]})
            failed = True
            continue
        reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
    (args.out / "gpu_exact.json").write_text(json.dumps(reports, indent=1))
    for r in reports:
        print(json.dumps(r, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
