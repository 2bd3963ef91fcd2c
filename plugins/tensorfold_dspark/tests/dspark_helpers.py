"""Helpers of the dspark drafter's tests: a tiny random DSpark checkpoint in the published layout, beside a target."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np

MASK_ID = 5  # "<|mask|>" in the test tokenizer's special tokens
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
SIZES = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)


def dspark_config(target: Path, *, block_size: int = 8, taps=(0, 2, 3), rank: int = 64, confidence: bool = True,
                  **overrides) -> dict:
    """A DSpark config.json for `target` in the published layout: the block and taps in dflash_config."""
    t = json.loads((Path(target) / "config.json").read_text())
    config = dict(architectures=["DSparkDraftModel"], model_type="qwen3", hidden_size=t["hidden_size"],
                  vocab_size=t["vocab_size"], rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                  rope_is_neox_style=False, eos_token_id=t["eos_token_id"], dtype="float32", **SIZES,
                  dflash_config=dict(mask_token_id=MASK_ID, target_layer_ids=list(taps), block_size=block_size,
                                     num_target_layers=t["num_hidden_layers"], markov_rank=rank,
                                     markov_head_type="vanilla", enable_confidence_head=confidence,
                                     confidence_head_with_markov=True))
    config.update(overrides)
    return config


def dspark_weights(config: dict, seed: int = 0, bigrams: dict[int, int] | None = None,
                   scale: float = 0.25) -> dict[str, np.ndarray]:
    """Random float32 tensors by the published names; `bigrams` (previous -> next) are written into the Markov
    head strongly enough to decide those drafts, so a test can make drafts land."""
    rng = np.random.default_rng(seed)
    h, heads, kv, hd, inter = (config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                   "head_dim", "intermediate_size"))
    dflash = config["dflash_config"]
    vocab, rank, taps = config["vocab_size"], dflash["markov_rank"], len(dflash["target_layer_ids"])
    dense = lambda *shape: (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    w = {"fc.weight": dense(h, taps * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({p + "self_attn.q_proj.weight": dense(heads * hd, h), p + "self_attn.k_proj.weight": dense(kv * hd, h),
                  p + "self_attn.v_proj.weight": dense(kv * hd, h), p + "self_attn.o_proj.weight": dense(h, heads * hd),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "mlp.gate_proj.weight": dense(inter, h), p + "mlp.up_proj.weight": dense(inter, h),
                  p + "mlp.down_proj.weight": dense(h, inter), p + "input_layernorm.weight": norm(h),
                  p + "post_attention_layernorm.weight": norm(h)})
    w1, w2 = dense(vocab, rank) * 0.1, dense(vocab, rank) * 0.1
    for k, (previous, following) in enumerate(list((bigrams or {}).items())[:rank]):
        w1[previous, k] += 8.0
        w2[following, k] += 8.0
    w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"] = w1, w2
    if dflash["enable_confidence_head"]:
        w["confidence_head.proj.weight"] = dense(1, h + rank)
        w["confidence_head.proj.bias"] = np.array([1.5], np.float32)
    return w


def write_dspark(path: Path, target: Path, config: dict, weights: dict[str, np.ndarray]) -> Path:
    """The checkpoint dir: config.json, model.safetensors and the target's tokenizer files, byte for byte."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (Path(target) / name).exists():
            shutil.copy(Path(target) / name, path / name)
    return path


def tiny_dspark_checkpoint(path: Path, target: Path, *, seed: int = 0, bigrams: dict[int, int] | None = None,
                           **config) -> Path:
    """A random DSpark drafter for `target`, in the published layout (no embedding or head of its own)."""
    cfg = dspark_config(target, **config)
    return write_dspark(path, target, cfg, dspark_weights(cfg, seed, bigrams))


def bigrams_of(sequences) -> dict[int, int]:
    """previous -> next token pairs in the order first seen (the first pair for a token wins)."""
    out: dict[int, int] = {}
    for seq in sequences:
        for previous, following in zip(seq, seq[1:]):
            out.setdefault(previous, following)
    return out


# ---- the shipped pair (tiny-lfm2-moe drafted by tiny-lfm2-moe-dspark): its prompts and its plain replies ----

NAME, TARGET = "tiny-lfm2-moe-dspark", "tiny-lfm2-moe"
PROMPTS = ["def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,", "while True:\n",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "print('hello')\n"]


@contextmanager
def shipped_pair(**env: str):
    """The shipped pair loaded under `env` (read at start), the target in float32 (mlx's CPU backend has no bf16
    gather_mm for its experts); the drafter closed after."""
    import pytest

    from tensorfold_core.loading import load_target, start_drafter
    from tensorfold_core.options import ServeOptions

    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        target = load_target(TARGET, ServeOptions(dtype="float32"))
        drafter = start_drafter(NAME, target.model, target.tokenizer)
    try:
        yield target, drafter
    finally:
        drafter.close()


def requests(target, seeded: bool, tokens: int = 40):
    """The prompts as requests, greedy or seeded (temperature 0.8, a seed each)."""
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.sampling import SamplingParams

    return [GenerationRequest(prompt_ids=target.tokenizer.encode(p), max_tokens=tokens,
                              sampling=SamplingParams(temperature=0.8, seed=11 + i) if seeded else SamplingParams())
            for i, p in enumerate(PROMPTS)]


def plain_replies(target) -> dict:
    """Each prompt decoded alone and plain, greedy (False) and seeded (True): what every drafted run must equal."""
    from tensorfold_core.testing import drive, serial

    return {seeded: drive(target.model, None, [serial(r) for r in requests(target, seeded)], 8, timed=False)
            for seeded in (False, True)}
