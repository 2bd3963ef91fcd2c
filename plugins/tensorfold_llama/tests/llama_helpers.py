"""Helpers of the llama family's tests: a mistral checkpoint, the llama family's other kind."""

from __future__ import annotations

from pathlib import Path

from tensorfold_core.testing import seeded_weights, write_tokenizer


def mistral_checkpoint(path: Path, **overrides) -> Path:
    """A random MistralForCausalLM saved by transformers, with the test tokenizer beside it."""
    from transformers import MistralConfig, MistralForCausalLM

    base = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=0)
    model = MistralForCausalLM(MistralConfig(**{**base, **overrides}))
    seeded_weights(model, 0)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path
