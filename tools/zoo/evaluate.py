"""Measure the shipped zoo checkpoints on held-out stdlib files: loss, drafter agreement, greedy samples."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import DEST, QUANTIZED  # noqa: E402
from train import CONTEXT  # noqa: E402

PROMPTS = ("def ", "class ", "import ")
SAMPLE_TOKENS = 48
PAIRS = {"tiny-llama-drafter": "tiny-llama", "tiny-llama-drafter-4bit": "tiny-llama"}  # drafter -> target
VOCAB = 8192


def windows(tokens: np.ndarray, limit: int | None) -> np.ndarray:
    """Non-overlapping CONTEXT+1 windows from the start of the held-out stream, as train.py evaluates."""
    n = (tokens.size - 1) // CONTEXT
    n = min(n, limit) if limit else n
    return np.stack([tokens[i * CONTEXT : i * CONTEXT + CONTEXT + 1] for i in range(n)]).astype(np.int64)


def torch_pass(path: Path, wins: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-window summed NLL and greedy tokens, fp32 compute on the shipped bf16 weights."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    nll, greedy = [], []
    with torch.no_grad():
        for i in range(0, len(wins), batch):
            w = torch.from_numpy(wins[i : i + batch])
            logits = model(input_ids=w[:, :-1]).logits.float()
            loss = F.cross_entropy(logits.transpose(1, 2), w[:, 1:], reduction="none").sum(-1)
            nll.append(loss.numpy())
            # Ties go to the lowest id, the same rule the server's greedy draw uses.
            greedy.append(logits[..., :VOCAB].argmax(-1).numpy().astype(np.uint16))
    return np.concatenate(nll), np.concatenate(greedy)


def mlx_pass(path: Path, wins: np.ndarray, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """The same figures through mlx-lm, for the MLX-only quantized copies."""
    from mlx_lm import load

    model, _ = load(str(path))
    # fp32 scales and activations (the 4-bit codes are untouched): like the bf16 models' fp32 figures, and
    # mlx's CPU backend runs bf16 without BLAS, about 9x slower.
    model.set_dtype(mx.float32)
    nll, greedy = [], []
    for i in range(0, len(wins), batch):
        w = mx.array(wins[i : i + batch])
        logits = model(w[:, :-1]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        loss = -mx.take_along_axis(logp, w[:, 1:, None], axis=-1)[..., 0].sum(-1)
        nll.append(np.array(loss))
        greedy.append(np.array(mx.argmax(logits[..., :VOCAB], axis=-1)).astype(np.uint16))
    return np.concatenate(nll), np.concatenate(greedy)


def healed_prompt(tok, prompt: str) -> tuple[list[int], np.ndarray | None]:
    """Token healing: a trailing space is its own rare token in byte-level BPE, so fold it into the next token."""
    if not prompt.endswith(" "):
        return tok.encode(prompt, add_special_tokens=False), None
    ids = tok.encode(prompt[:-1], add_special_tokens=False)
    vocab = tok.convert_ids_to_tokens(list(range(VOCAB)))
    allowed = np.array([t.startswith("\u0120") and len(t) > 1 for t in vocab])  # Ġ is the byte-level space
    return ids, allowed


def greedy(next_logits, tok, prompt: str) -> str:
    """Greedy decode of SAMPLE_TOKENS tokens (stopping at an eos), recomputing the whole prefix each step."""
    ids, allowed = healed_prompt(tok, prompt)
    start = len(ids)
    stops = {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    for step in range(SAMPLE_TOKENS):
        logits = np.asarray(next_logits(ids), dtype=np.float32)[:VOCAB]
        if step == 0 and allowed is not None:
            logits = np.where(allowed, logits, -np.inf)
        nxt = int(np.argmax(logits))
        if nxt in stops:
            break
        ids.append(nxt)
    return prompt[:-1] + tok.decode(ids[start:]) if allowed is not None else prompt + tok.decode(ids[start:])


def samples_torch(path: Path) -> dict[str, str]:
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def next_logits(ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, -1].numpy()

    return {p: greedy(next_logits, tok, p) for p in PROMPTS}


def samples_mlx(path: Path) -> dict[str, str]:
    from mlx_lm import load

    model, _ = load(str(path))
    model.set_dtype(mx.float32)
    tok = AutoTokenizer.from_pretrained(path)  # the same tokenizer.json bytes as the bf16 dirs

    def next_logits(ids):
        return np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))

    return {p: greedy(next_logits, tok, p) for p in PROMPTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heldout", type=Path, default=Path(".zoo/data/heldout.npy"))
    ap.add_argument("--out", type=Path, default=Path(".zoo/eval.json"))
    ap.add_argument("--windows", type=int, default=None, help="limit for the bf16 models (default: all)")
    ap.add_argument("--mlx-windows", type=int, default=64, help="subset for the 4-bit copies (mlx CPU is slow)")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    tokens = np.load(args.heldout)
    results: dict[str, dict] = {}
    greedy_of: dict[str, np.ndarray] = {}
    nll_of: dict[str, np.ndarray] = {}
    for name, path in DEST.items():
        t0 = time.time()
        quantized = name in QUANTIZED
        wins = windows(tokens, args.mlx_windows if quantized else args.windows)
        nll, greedy = (mlx_pass if quantized else torch_pass)(path, wins, args.batch)
        nll_of[name], greedy_of[name] = nll, greedy
        per_window = CONTEXT
        r = {"heldout_windows": len(wins), "heldout_tokens": len(wins) * per_window,
             "heldout_loss": float(nll.sum() / (len(wins) * per_window)), "engine": "mlx-lm" if quantized else "transformers"}
        if quantized:
            src = QUANTIZED[name]
            # The bf16 source on the very same windows, so the 4-bit cost reads directly.
            r["source_loss_same_windows"] = float(nll_of[src][: len(wins)].sum() / (len(wins) * per_window))
            r["agreement_with_source"] = float((greedy == greedy_of[src][: len(wins)]).mean())
        target = PAIRS.get(name)
        if target:
            r["greedy_agreement"] = float((greedy == greedy_of[target][: len(wins)]).mean())
            r["agreement_target"] = target
            if quantized:
                src_greedy = greedy_of[QUANTIZED[name]][: len(wins)]
                r["source_agreement_same_windows"] = float((src_greedy == greedy_of[target][: len(wins)]).mean())
        r["samples"] = samples_mlx(path) if quantized else samples_torch(path)
        r["eval_s"] = round(time.time() - t0, 1)
        results[name] = r
        print(name, json.dumps({k: v for k, v in r.items() if k != "samples"}), flush=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
