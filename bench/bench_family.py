"""One family's plain decode speed against mlx-lm `generate` on the same checkpoint, tokens checked first."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from common import BenchMismatch, check_same_ids, exit_code, fail_if_any, model_dir

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def ours(model: str, tokens: int, dtype: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tensorfold_core", "run", model, PROMPT, "--max-tokens", str(tokens),
                          "--json", "--dtype", dtype], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def theirs(path: str, prompt_ids: list[int], tokens: int, dtype: str) -> tuple[list[int], float]:
    """mlx-lm's greedy decode of the same prompt ids: its token ids and decode tokens per second."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm.load(path)
    if dtype != "auto":
        model.set_dtype(getattr(mx, dtype))
    ids, stamps = [], []
    for response in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=tokens):
        if response.finish_reason == "stop":  # the final response of a stop carries the eos, which ours omits
            break
        ids.append(response.token)
        stamps.append(time.perf_counter())
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
    return ids, rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("models", nargs="+", help="shipped names or dirs")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args(argv)
    failures = []
    for model in args.models:
        ours_rates, theirs_rates = [], []
        try:
            for rep in range(args.reps):  # alternate the two so a busy machine slows both alike
                run = ours(model, args.tokens, args.dtype)
                ids, rate = theirs(model_dir(model), run["prompt_ids"], args.tokens, args.dtype)
                check_same_ids(f"{model} ({args.dtype}) rep {rep + 1}: tensorfold against mlx-lm", ids,
                               run["token_ids"])
                ours_rates.append(run["decode_tokens_per_s"])
                theirs_rates.append(rate)
        except BenchMismatch as failure:
            failures.append(failure)
            print(f"FAIL {failure}; no speed quoted")
            continue
        a, b = statistics.median(ours_rates), statistics.median(theirs_rates)
        print(f"{model} ({args.dtype}): tensorfold {a:7.1f} tok/s | mlx-lm generate {b:7.1f} tok/s | "
              f"ratio {a / b:.2f}x (medians of {args.reps}, same greedy tokens)")
    fail_if_any(failures)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
