"""Helpers of the llama family's tests: reference logits, windowed runs, config edits, a mistral checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from tensorfold_core.testing import write_tokenizer

PROMPT = [5, 77, 301, 12, 190, 44, 9, 256, 3, 120, 66, 350, 21, 8, 143, 99, 270, 31, 7, 200]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is ...]:
        config.pop(key)
    (path / "config.json").write_text(json.dumps(config, indent=1))


def transformers_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Every row's logits from transformers in float32 (torch, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def mlx_lm_logits(path: Path, tokens: list[int], dtype: mx.Dtype | None = None) -> mx.array:
    """Every row's logits from mlx-lm's own loader and model, as float32."""
    import mlx_lm

    model, _ = mlx_lm.load(str(path))
    if dtype is not None:
        model.set_dtype(dtype)
    return model(mx.array([tokens]))[0].astype(mx.float32)


def run(model, tokens: list[int], windows: list[int] | None = None, capacity: int = 64) -> mx.array:
    """Every row's logits of `tokens` run on one fresh cache as consecutive windows (one window by default)."""
    cache, rows, at = model.new_cache(capacity), [], 0
    for size in windows or [len(tokens)]:
        rows.append(model.forward([cache], [tokens[at:at + size]], [size]))
        model.keep(cache, size)
        at += size
    return mx.concatenate(rows)


def mistral_checkpoint(path: Path, **overrides) -> Path:
    """A random MistralForCausalLM saved by transformers, with the test tokenizer beside it."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=0)
    model = MistralForCausalLM(MistralConfig(**{**base, **overrides}))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path
