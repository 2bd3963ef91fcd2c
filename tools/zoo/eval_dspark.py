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
    chances = recorded_chances(drafter)
    t0 = time.time()
    per_block, equal, tokens, decode_rounds = Counter(), 0, 0, 0
    pairs: list[tuple[list[float], int]] = []  # (a block's chances, drafts the verify kept)
    for start in starts:
        request = GenerationRequest(prompt_ids=heldout[start:start + args.prompt_len].tolist(),
                                    max_tokens=args.tokens, stop_token_ids=frozenset())
        capacity = args.prompt_len + args.tokens
        plain = Engine(target.model, shared_rounds=target.row_invariant, copy_drafts=False)
        want, _, _ = decode(plain, request, capacity)
        engine = Engine(target.model, shared_rounds=target.row_invariant, drafter=drafter, fixed_depth=args.depth,
                        copy_drafts=False)
        chances.clear()
        got, rounds, _ = decode(engine, request, capacity)
        equal += got == want
        tokens += len(got)
        decode_rounds += sum(1 for r in rounds if r["tokens"])
        drafted = [r for r in rounds if r["drafted"]]
        for r in drafted:
            per_block[r["kept"]] += 1
        if len(chances) == len(drafted):  # one hold a drafted round: its chances price that round's verify
            pairs += [(c, r["kept"]) for c, r in zip(chances, drafted) if c]
    blocks = sum(per_block.values())
    kept = sum(k * n for k, n in per_block.items())
    out = {"target": args.target, "drafter": args.drafter, "dtype": "float32", "drafter_bits": 8,
           "prompts": len(starts), "prompt_len": args.prompt_len, "tokens": args.tokens, "depth": args.depth,
           "replies_equal_plain": f"{equal}/{len(starts)}", "blocks": blocks,
           "accepted_per_block": round(kept / blocks, 3) if blocks else 0.0,
           "tokens_per_round": round(tokens / max(1, decode_rounds), 3),
           "accepted_histogram": {str(k): per_block[k] for k in range(args.depth + 1)},
           "calibration": calibration(pairs, args.depth), "eval_s": round(time.time() - t0, 1)}
    drafter.close()
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


def recorded_chances(drafter) -> list:
    """Each hold's chances as the drafter settles them (its streams' running products), in hold order."""
    out: list = []
    propose = drafter.propose

    def recorded(asks):
        drafts = propose(asks)
        out.extend(drafter.chances(ask.stream_id) for ask in asks)
        return drafts

    drafter.propose = recorded
    return out


def calibration(pairs: list[tuple[list[float], int]], depth: int) -> dict:
    """How the confidence head's chances meet what the verify kept: per draft j, the mean chance that it and every
    draft before it land against the share of blocks that kept at least j; and the expected drafts a block (the
    chances' sum, what the grants price) against those kept."""
    by_draft = []
    for j in range(depth):
        held = [(c[j], kept > j) for c, kept in pairs if len(c) > j]
        if held:
            by_draft.append({"draft": j + 1, "blocks": len(held), "mean_chance": round(float(np.mean([h[0] for h in held])), 3),
                             "kept_share": round(float(np.mean([h[1] for h in held])), 3)})
    expected = sum(sum(c) for c, _ in pairs)
    kept = sum(min(k, len(c)) for c, k in pairs)
    return {"blocks": len(pairs), "expected_per_block": round(expected / max(1, len(pairs)), 3),
            "kept_per_block": round(kept / max(1, len(pairs)), 3), "by_draft": by_draft}


if __name__ == "__main__":
    main()
