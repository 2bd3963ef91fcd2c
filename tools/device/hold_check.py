"""Which part of which DSpark hold pass hangs on this machine: time_holds' cells one by one, each part evaluated apart.

    python3 tools/device/hold_check.py [tiny-lfm2]     (prints a line before each part; a hang dumps the stacks)
"""

from __future__ import annotations

import faulthandler
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from exact_cases import dspark_checkpoint

HANG_S = 20


def part(what: str, *arrays) -> None:
    """Evaluate one part of a hold alone, saying what it is first (the last line printed names a hang)."""
    print(f"    {what} ...", end=" ", flush=True)
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    start = time.perf_counter()
    mx.eval(*arrays)
    faulthandler.cancel_dump_traceback_later()
    print(f"{(time.perf_counter() - start) * 1000:.1f} ms", flush=True)


def main() -> int:
    from tensorfold_core.families import GROW_STEP
    from tensorfold_core.hold_costs import HOLD_BLOCKS, HOLD_DEPTHS
    from tensorfold_core.loading import load_target, resolve_model, start_drafter
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.protocols import DraftAsk
    from tensorfold_core.specs import DrafterOptions
    from tensorfold_dspark.drafter import HOLD_ROWS, DSparkDrafter
    from tensorfold_dspark.model import Block

    name = sys.argv[1] if len(sys.argv) > 1 else "tiny-lfm2"
    target_dir = resolve_model(name)
    target = load_target(str(target_dir), ServeOptions(dtype="bfloat16"))
    mask_id = target.tokenizer.backend.token_to_id("<|mask|>")
    DSparkDrafter.time_holds = lambda self, *a, **k: None  # the cells run below, one part at a time
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = dspark_checkpoint(target_dir, Path(tmp) / "dspark", mask_id, [[1, 2, 3, 4]])
        drafter = start_drafter(str(ckpt), target.model, target.tokenizer, DrafterOptions(dtype="bfloat16"))
    print(f"{name}: loaded, warmed up; block size {drafter.block_size}", flush=True)
    ids = [-1 - i for i in range(max(HOLD_BLOCKS))]
    for blocks in HOLD_BLOCKS:
        for depth in sorted({min(d, drafter.block_size, max(1, HOLD_ROWS // blocks)) for d in HOLD_DEPTHS}):
            print(f"  {blocks} blocks x {depth} drafts", flush=True)
            asks = [DraftAsk(i, [0, 0], depth, limit=GROW_STEP) for i in ids[:blocks]]
            work = drafter._sync(asks)
            lanes = [lane for _, lane, _, _ in work]
            drafter._absorb([(lane, bound) for _, lane, _, bound in work])
            part("absorb", [a for lane in lanes for a in lane.keys + lane.values])
            tokens, blocks_, row = [], [], 0
            for lane in lanes:
                tokens += [0] + [drafter.mask_id] * (depth - 1)
                blocks_.append(Block(row, depth, 1, lane))
                row += depth
            embedded = drafter.target.embed(mx.array(tokens, dtype=mx.uint32))
            part("embed", embedded)
            final = drafter.model.blocks(embedded, blocks_)
            part("drafter layers", final)
            logits = drafter.target.head(final)
            part("target head", logits)
            previous = mx.zeros((len(lanes),), mx.uint32)
            at = mx.array([b.start for b in blocks_])
            token, flag = drafter.pick(logits[at], previous)  # the served step: the record's launch where it serves
            part(f"markov pick ({drafter.kernels.get('markov pick', 'mlx')})", token, flag)
            chance = drafter.model.confidence(final[at], previous)
            part("confidence", *([] if chance is None else [chance]))
            for i in ids:
                drafter.lanes.pop(i, None)
    print("no hang", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
