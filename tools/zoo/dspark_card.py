"""Write a shipped DSpark drafter's model card from its config, its weights and the CPU evaluation in tools/zoo/runs/."""

from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tools/zoo/runs"
MODELS = ROOT / "plugins/tensorfold_dspark/tensorfold_dspark/models"
FIRST = "tiny-lfm2-moe-dspark"  # the first shipped: its receipts kept their names (runs/dspark-*)


def receipts(name: str) -> str:
    """The prefix of a drafter's receipts in runs/."""
    return "dspark" if name == FIRST else name


def parameters(weights: Path) -> int:
    """Parameters counted from the safetensors header's shapes, so no framework reads the weights."""
    with open(weights, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    count = 0
    for name, entry in header.items():
        if name != "__metadata__":
            n = 1
            for d in entry["shape"]:
                n *= d
            count += n
    return count


def training(receipt: dict | None, log: str, prefix: str) -> str:
    """The training section: what the receipt and its log say, or that none survived."""
    if receipt is None:
        return """The session that trained these weights was cut off before it committed, and its training receipt
(steps, schedule, data, losses, where it ran) was lost with it. Nothing here is inferred from the weights: the
figures above are the only measurements of this checkpoint. `tools/zoo/train_dspark.py` is the recipe it was made
with."""
    r = receipt
    curve = r.get("loss_curve") or []
    at, last = curve[-1] if curve else (0, {})
    stopped = re.search(r"stopped at step (\d+) of (\d+)", log)  # a wall-time stop is in the log, not the receipt
    cut = (f", stopped at its wall time after {int(stopped[1]):,} of the {int(stopped[2]):,} steps its cosine schedule "
           "was sized for (never annealed)") if stopped else ""
    where = "this repo's 2-core dev VM (two torch threads, shared with other work)" if r["where"] == "this CPU" \
        else r["where"]
    end = (f"; at its last logged step ({at}): loss {last['loss']:.2f} (block cross entropy {last['ce']:.2f}), "
           f"{last['agree']:.0%} of block rows picking the target's token") if last else ""
    start = (f"\n- from the weights shipped before (`--init`; their training's receipt: "
             f"`tools/zoo/runs/{prefix}-first-metrics.json`), not from fresh ones") if r.get("init") else ""
    served = r.get("heldout_served")
    heldout = (f"\n- the trainer's own held-out measure (torch, blocks walked along the first {served['tokens']} greedy "
               f"tokens as a decode walks them): {served['accepted_per_block']:.2f} accepted drafts per block") \
        if served else ""
    return f"""`tools/zoo/train_dspark.py` on {where},
receipt `tools/zoo/runs/{prefix}-metrics.json`:

- objective: the DFlash block objective on the frozen target's taps: {r["anchors"]} blocks a sequence at random
  pending positions, each row attending the context rows before its block and every row of its block; row j's
  logits (the target's tied head on the final row plus the Markov term of the token at p + j) against the target's
  greedy token there, {r["alpha"]:.1f} soft cross entropy on the target's distribution and the rest hard on its
  argmax, rows weighted exp(-j / {r["gamma"]:g}); the confidence head by binary cross entropy on whether each row's
  pick is the target's (its inputs detached)
- data: sequences of {r["length"]} tokens, half random windows of the training files, half the target's greedy
  continuations of {r["gen_seqs_made"]:,} random 64-token training windows
- {r["steps"]:,} AdamW steps of {r["batch"]} sequences, peak lr {r["lr"]:g}, cosine to a tenth, seed {r["seed"]},
  {r["train_s"]:.0f} s of training{cut}{end}{start}{heldout}"""


def card(name: str, config: dict, evaluation: dict, weights: Path, receipt: dict | None, log: str = "") -> str:
    d, e, hist = config["dflash_config"], evaluation, evaluation["accepted_histogram"]
    histogram = ", ".join(f"{k}: {n}" for k, n in hist.items())
    weak = ("\n\nIt is **undertrained**: fewer than one draft of a block lands on average (figures below), so it\n"
            "tests the plumbing and exactness of DSpark serving, not what a trained DSpark drafter gains."
            if e["accepted_per_block"] < 1 else "")
    return f"""---
tags:
- tensorfold
- test-fixture
- dspark
---

# {name}

A DSpark block drafter for `{name.removesuffix("-dspark")}`, trained on the target's own taps over the Python 3.11.7 standard library
(the zoo's corpus, `docs/zoo.md`) and shipped as package data, so the DSpark drafter kind is tested and measured
offline. It is a test fixture, as its target is.{weak}

| | |
| --- | --- |
| layout | the published DFlash/DSpark one (`config.json` with `dflash_config`); no embedding or head: the target's are bound at load |
| layers | {config["num_hidden_layers"]} Qwen3-style layers: hidden {config["hidden_size"]}, {config["num_attention_heads"]} query / {config["num_key_value_heads"]} KV heads (head_dim {config["head_dim"]}) with q/k norms, SwiGLU {config["intermediate_size"]}, interleaved RoPE theta {config["rope_theta"]:g}, non-causal blocks |
| taps | layers {d["target_layer_ids"]} of the target's {d["num_target_layers"]} (post-layer residual rows), through `fc` + `hidden_norm` |
| block | {d["block_size"]} rows: the pending token, then `<|mask|>` (id {d["mask_token_id"]}); row j drafts the token after position p + j |
| heads | Markov head rank {d["markov_rank"]} (`W2 W1[previous]` added to each row's logits); confidence head on [final row; W1[previous]] |
| parameters | {parameters(weights):,} |
| weights | `model.safetensors`, {config.get("dtype", "bfloat16")}, {weights.stat().st_size / 1e6:.2f} MB (served as 8-bit MLX affine codes, packed at load) |

## Figures

Measured on the CPU through tensorfold (float32 target, the drafter's 8-bit codes), `tools/zoo/eval_dspark.py`,
receipt `tools/zoo/runs/{receipts(name)}-eval.json`: {e["prompts"]} windows of {e["prompt_len"]} tokens evenly spaced over the
held-out files, {e["tokens"]} greedy tokens each, every round holding a block of {e["depth"]} drafts (no copy
drafts, no grants):

- **{e["accepted_per_block"]:.2f} accepted drafts per block** over {e["blocks"]:,} blocks
  ({e["tokens_per_round"]:.2f} tokens a round); blocks by drafts accepted: {histogram}
- replies equal to plain greedy decoding: {e["replies_equal_plain"]}

## Training

{training(receipt, log, receipts(name))}

- tokenizer: the zoo's, byte for byte (`docs/zoo.md`)
- rebuild: `tools/zoo/README.md`; served speed: `docs/dspark.md`
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", nargs="?", default=FIRST, help=f"the drafter's dir under {MODELS.relative_to(ROOT)}")
    name = parser.parse_args().name
    dest, prefix = MODELS / name, receipts(name)
    config = json.loads((dest / "config.json").read_text())
    evaluation = json.loads((RUNS / f"{prefix}-eval.json").read_text())
    metrics = RUNS / f"{prefix}-metrics.json"
    receipt = json.loads(metrics.read_text()) if metrics.exists() else None
    log = RUNS / f"{prefix}-train.log"
    text = card(name, config, evaluation, dest / "model.safetensors", receipt, log.read_text() if log.exists() else "")
    (dest / "README.md").write_text(text)
    print(f"wrote {dest / 'README.md'}")


if __name__ == "__main__":
    main()
