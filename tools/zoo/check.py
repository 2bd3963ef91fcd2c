"""Load every shipped zoo checkpoint with transformers and mlx-lm, compare logits, and check the tokenizers match."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from mlx_lm import load as mlx_load
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import DEST, QUANTIZED, TOKENIZER_FILES  # noqa: E402

PROMPT = "import os\n\ndef read_lines(path):\n    with open(path) as f:\n        return"
TOLERANCE = 0.05  # bf16 weights, fp32 compute on both sides: only summation order differs


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_tokenizers() -> None:
    """Every dir ships the same tokenizer bytes, so a drafter pair shares ids by construction."""
    for f in TOKENIZER_FILES + ("generation_config.json",):
        digests = {name: digest(d / f) for name, d in DEST.items()}
        if len(set(digests.values())) != 1:
            raise SystemExit(f"{f} differs across dirs: {digests}")
        print(f"{f}: byte-identical in {len(digests)} dirs ({next(iter(digests.values()))[:12]})")


def mlx_last_row(model, ids: list[int]) -> np.ndarray:
    logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
    return np.array(logits)


def torch_last_row(path: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float().numpy()


def main() -> None:
    check_tokenizers()
    tok = AutoTokenizer.from_pretrained(DEST["tiny-llama"])
    ids = tok(PROMPT)["input_ids"]
    reference: dict[str, np.ndarray] = {}
    failed = []
    for name, path in DEST.items():
        cfg = json.loads((path / "config.json").read_text())
        model, _ = mlx_load(str(path))
        if name not in QUANTIZED:
            # Compute in fp32 on both sides so the comparison measures the loaders, not bf16 rounding.
            model.set_dtype(mx.float32)
            mine = mlx_last_row(model, ids)
            ref = torch_last_row(path, ids)
            reference[name] = ref
            diff = float(np.abs(mine - ref).max())
            what = "transformers fp32 vs mlx-lm fp32"
        else:
            mine = mlx_last_row(model, ids)
            ref = reference[QUANTIZED[name]]
            diff = float(np.abs(mine - ref).max())
            what = f"mlx-lm 4-bit vs transformers bf16 {QUANTIZED[name]} (quantization error, not a loader check)"
        same_argmax = int(mine.argmax()) == int(ref.argmax())
        print(f"{name:26s} {cfg['model_type']:9s} last-row max|diff| {diff:.2e}  argmax equal {same_argmax}  [{what}]")
        if name not in QUANTIZED and (diff > TOLERANCE or not same_argmax):
            failed.append(name)
    if failed:
        raise SystemExit(f"loader mismatch: {failed}")
    print("all checkpoints load in both and agree")


if __name__ == "__main__":
    main()
