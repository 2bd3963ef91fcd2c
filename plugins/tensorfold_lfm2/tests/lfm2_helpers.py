"""Helpers of the lfm2 family's tests: tiny checkpoints by transformers, reference logits, windowed and engine runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from tensorfold_core.lanes.engine import Engine
from tensorfold_core.lanes.stream import Stream
from tensorfold_core.lanes.types import DoneEvent, GenerationRequest, TokenEvent
from tensorfold_core.testing import write_tokenizer

PROMPT = [5, 77, 301, 12, 190, 44, 9, 256, 3, 120, 66, 350, 21, 8, 143, 99, 270, 31, 7, 200]
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

    torch.manual_seed(seed)
    config = lfm2_config(moe, **overrides)
    model = (Lfm2MoeForCausalLM if moe else Lfm2ForCausalLM)(config)
    with torch.no_grad():  # random init is too flat to tell tokens apart: widen the logits
        for name, param in model.named_parameters():
            if name.endswith("feed_forward.gate.weight"):  # the router starts at zero: every expert would tie
                param.copy_(torch.randn_like(param) * 0.25)
            elif param.dim() > 1:
                param.mul_(4.0)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # a bias that reorders the choice, so bias-only-to-choose is tested
                buffer.copy_(torch.rand_like(buffer) * 0.2)
    model = model.to(getattr(torch, dtype))
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    if block_dim and not moe:  # mlx-lm's lfm2 needs it; transformers 5 no longer writes it
        edit_config(path, block_dim=config.hidden_size)
    write_tokenizer(path, vocab_size=min(config.vocab_size, 384))
    return path


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    """Change config.json keys; a value of ... removes the key."""
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
        return model(torch.tensor([tokens]), use_cache=False).logits[0].float().numpy()


def mlx_lm_logits(path: Path, tokens: list[int], steps: bool = False) -> mx.array:
    """Every row's logits from mlx-lm's own loader and model, as float32: one call, or one token a step."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(str(path))
    if not steps:
        return model(mx.array([tokens]))[0].astype(mx.float32)
    cache = make_prompt_cache(model)
    return mx.concatenate([model(mx.array([[t]]), cache=cache)[0] for t in tokens]).astype(mx.float32)


def run(model, tokens: list[int], windows: list[int] | None = None, capacity: int = 64) -> mx.array:
    """Every row's logits of `tokens` run on one fresh cache as consecutive windows (one window by default)."""
    cache, rows, at = model.new_cache(capacity), [], 0
    for size in windows or [len(tokens)]:
        rows.append(model.forward([cache], [tokens[at:at + size]], [size]))
        model.keep(cache, size)
        at += size
    return mx.concatenate(rows)


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


class Run:
    """Drives an engine round by round: arrivals join between rounds up to `parallel` streams."""

    def __init__(self, model, parallel, chunk=8):
        self.model, self.parallel = model, parallel
        self.engine = Engine(model, prefill_chunk=chunk)
        self.events: dict[int, list] = {}
        self.waiting = []
        self.round_rows = []

    def submit(self, sid, request):
        self.events[sid] = []
        self.waiting.append((sid, request))

    def step(self):
        while self.waiting and len(self.engine.streams) < self.parallel:
            sid, request = self.waiting.pop(0)
            limit = len(request.prompt_ids) + request.max_tokens
            self.engine.add(Stream(id=sid, request=request, cache=self.model.new_cache(limit),
                                   on_event=self.events[sid].append, limit=limit))
        self.round_rows.append([len(t.window) for t in self.engine.plan()])
        return self.engine.round()

    def finish(self):
        while self.waiting or not self.engine.idle():
            self.step()

    def tokens(self, sid):
        return [t for e in self.events[sid] if isinstance(e, TokenEvent) for t in e.token_ids]

    def done(self, sid):
        return next(e for e in self.events[sid] if isinstance(e, DoneEvent))


def serial(request):
    """The same request as the serial reference: one token a round, no drafts."""
    return GenerationRequest(prompt_ids=request.prompt_ids, max_tokens=request.max_tokens,
                             sampling=request.sampling, stop_token_ids=request.stop_token_ids, draft=False)


def solo(model, request):
    """The serial reference's token ids, the request alone on the engine."""
    run = Run(model, parallel=1)
    run.submit(0, serial(request))
    run.finish()
    assert run.done(0).usage["tensorfold"]["drafted"] == 0
    return run.tokens(0)
