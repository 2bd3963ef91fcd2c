"""Helpers of the lfm2 family's tests: tiny checkpoints by transformers, a keep-recording model, serial references."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tensorfold_core import testing
from tensorfold_core.testing import edit_config, seeded_weights, write_tokenizer

DRAFTS = [33, 260, 7, 140, 81, 2, 377, 64]

BASE = dict(vocab_size=384, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, layer_types=["conv", "full_attention", "conv", "full_attention"],
            norm_eps=1e-5, conv_L_cache=3, tie_word_embeddings=True, bos_token_id=1, eos_token_id=0, pad_token_id=2)
DENSE = dict(intermediate_size=192, block_multiple_of=32, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True)
MOE = dict(intermediate_size=128, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, num_dense_layers=1,
           norm_topk_prob=True, use_expert_bias=True, routed_scaling_factor=1.0)


def lfm2_config(moe: bool = False, **overrides):
    """A tiny Lfm2Config or Lfm2MoeConfig; overrides pick layer types, conv bias, experts, routing."""
    from transformers import Lfm2Config, Lfm2MoeConfig

    fields = {**BASE, **(MOE if moe else DENSE), **overrides}
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        fields["layer_types"] = [("conv", "full_attention")[i % 2] for i in range(fields["num_hidden_layers"])]
    return (Lfm2MoeConfig if moe else Lfm2Config)(**fields)


def tiny_lfm2_checkpoint(path: Path, moe: bool = False, seed: int = 0, dtype: str = "float32",
                         block_dim: bool = True, **overrides) -> Path:
    """A random Lfm2ForCausalLM (or Lfm2MoeForCausalLM) saved by transformers, with a real tokenizer beside it."""
    import torch
    from transformers import Lfm2ForCausalLM, Lfm2MoeForCausalLM

    config = lfm2_config(moe, **overrides)
    model = (Lfm2MoeForCausalLM if moe else Lfm2ForCausalLM)(config)
    # the router starts at zero in transformers: every expert would tie
    seeded_weights(model, seed, stds={"feed_forward.gate.weight": 0.25})
    rng = np.random.default_rng(seed + 1)
    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("expert_bias"):  # a bias that reorders the choice, so bias-only-to-choose is tested
                drawn = rng.random(tuple(buffer.shape), dtype=np.float32) * 0.2
                buffer.copy_(torch.from_numpy(drawn).to(buffer.dtype))
    model = model.to(getattr(torch, dtype))
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    if block_dim and not moe:  # mlx-lm's lfm2 needs it; transformers 5 no longer writes it
        edit_config(path, block_dim=config.hidden_size)
    write_tokenizer(path, vocab_size=min(config.vocab_size, 384))
    return path


class Spy:
    """The model, with every keep recorded as (rows kept, window rows)."""

    def __init__(self, model):
        self.model, self.keeps, self.windows = model, [], {}
        self.model_type, self.vocab_size, self.dtype = model.model_type, model.vocab_size, model.dtype
        self.new_cache, self.cache_bytes = model.new_cache, model.cache_bytes

    def forward(self, caches, windows, logit_rows):
        self.windows.update({id(c): len(w) for c, w in zip(caches, windows)})
        return self.model.forward(caches, windows, logit_rows)

    def keep(self, cache, rows):
        self.keeps.append((rows, self.windows.pop(id(cache))))
        self.model.keep(cache, rows)


def solo(model, request):
    """The serial reference's token ids: the request without drafts, alone on the engine."""
    return testing.solo(model, testing.serial(request))
