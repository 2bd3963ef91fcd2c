"""Accepted drafts per block of the served DSpark drafter on held-out files: greedy, blocks of N, here on the CPU."""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

from tensorfold_core.checkmode import decode
from tensorfold_core.lanes.engine import Engine
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import load_target, start_drafter
from tensorfold_core.options import ServeOptions
from tensorfold_core.specs import DrafterOptions

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default="tiny-lfm2-moe")
    ap.add_argument("--drafter", default="tiny-lfm2-moe-dspark")
    ap.add_argument("--data", type=Path, default=ROOT / ".zoo/data")
    ap.add_argument("--prompts", type=int, default=32, help="held-out windows, evenly spaced over the files")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=8, help="drafts a block (every round holds one)")
    ap.add_argument("--out", type=Path, default=ROOT / ".zoo/dspark-eval.json")
    args = ap.parse_args()
    heldout = np.load(args.data / "heldout.npy").astype(np.int64)
    starts = np.linspace(0, heldout.size - args.prompt_len - 1, args.prompts).astype(int)
    target = load_target(args.target, ServeOptions(dtype="float32"))
    drafter = start_drafter(args.drafter, target.model, target.tokenizer, DrafterOptions(dtype="float32"))
    t0 = time.time()
    per_block, equal, tokens, decode_rounds = Counter(), 0, 0, 0
    for start in starts:
        request = GenerationRequest(prompt_ids=heldout[start:start + args.prompt_len].tolist(),
                                    max_tokens=args.tokens, stop_token_ids=frozenset())
        capacity = args.prompt_len + args.tokens
        plain = Engine(target.model, shared_rounds=target.row_invariant, copy_drafts=False)
        want, _, _ = decode(plain, request, capacity)
        engine = Engine(target.model, shared_rounds=target.row_invariant, drafter=drafter, fixed_depth=args.depth,
                        copy_drafts=False)
        got, rounds, _ = decode(engine, request, capacity)
        equal += got == want
        tokens += len(got)
        decode_rounds += sum(1 for r in rounds if r["tokens"])
        for r in rounds:
            if r["drafted"]:
                per_block[r["kept"]] += 1
    blocks = sum(per_block.values())
    kept = sum(k * n for k, n in per_block.items())
    out = {"target": args.target, "drafter": args.drafter, "dtype": "float32", "drafter_bits": 8,
           "prompts": len(starts), "prompt_len": args.prompt_len, "tokens": args.tokens, "depth": args.depth,
           "replies_equal_plain": f"{equal}/{len(starts)}", "blocks": blocks,
           "accepted_per_block": round(kept / blocks, 3) if blocks else 0.0,
           "tokens_per_round": round(tokens / max(1, decode_rounds), 3),
           "accepted_histogram": {str(k): per_block[k] for k in range(args.depth + 1)},
           "eval_s": round(time.time() - t0, 1)}
    drafter.close()
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
