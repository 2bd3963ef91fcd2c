"""Helpers for tests of core and plugins: real tiny checkpoints written by transformers' save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|startoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CORPUS = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
          "import os\nimport sys\nprint(os.path.join('a', 'b'))\n", "for i in range(10):\n    print(i * i)\n",
          "Hello world! The quick brown fox jumps over the lazy dog. 0123456789 éà中文 ✓\n"]


def write_tokenizer(path: Path, vocab_size: int = 384) -> None:
    """A byte-level BPE with the zoo's special tokens and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>",
        "add_bos_token": False, "chat_template": CHATML, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))


def llama_config(**overrides):
    """A tiny LlamaConfig; overrides pick GQA, bias, rope scaling, tying."""
    from transformers import LlamaConfig

    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=0)
    base.update(overrides)
    return LlamaConfig(**base)


def tiny_llama_checkpoint(path: Path, seed: int = 0, dtype: str = "float32", **overrides) -> Path:
    """A random LlamaForCausalLM saved by transformers (safetensors), with a real tokenizer beside it."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = llama_config(**overrides)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():  # random init is too flat to tell tokens apart: widen the logits
        for param in model.parameters():
            param.mul_(4.0 if param.dim() > 1 else 1.0)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path, vocab_size=min(config.vocab_size, 384))
    return path


def truncated_drafter(target: Path, path: Path, layers: int = 1, vocab_size: int = 448) -> Path:
    """A drafter cut from a target's first layers, its vocab padded wider, on the same tokenizer files."""
    import shutil

    from safetensors.numpy import load_file, save_file

    target, path = Path(target), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    old_vocab = config["vocab_size"]
    config.update(num_hidden_layers=layers, vocab_size=vocab_size)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    weights = {}
    for name, tensor in load_file(str(target / "model.safetensors")).items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            import numpy as np

            tensor = np.concatenate([tensor, np.zeros((vocab_size - old_vocab, tensor.shape[1]), tensor.dtype)])
        weights[name] = tensor
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).exists():
            shutil.copy(target / name, path / name)
    return path


def mlx_quantized_copy(source: Path, path: Path, bits: int = 4, group_size: int = 64) -> Path:
    """mlx-lm's own affine conversion of a checkpoint, with the source's tokenizer files kept byte-identical."""
    import shutil

    from mlx_lm import convert

    convert(str(source), mlx_path=str(path), quantize=True, q_bits=bits, q_group_size=group_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(source) / name, Path(path) / name)
    return Path(path)
