"""A DSpark drafter in torch, in the published layout tensorfold_dspark loads: the block model, its heads and export."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass
class DSparkSpec:
    """The drafter's shape and its DFlash/DSpark settings; `config()` is the config.json the loader reads."""

    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    vocab_size: int = 8192
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    block_size: int = 8
    mask_token_id: int = 5  # the zoo tokenizer's spare "<|mask|>"
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 3, 5])
    num_target_layers: int = 6
    markov_rank: int = 32  # small: the network drafts, the bigram term corrects; the zoo's weights share one upload
    eos_token_id: int | list[int] = field(default_factory=lambda: [0, 4])

    def config(self, dtype: str = "bfloat16") -> dict:
        s = asdict(self)
        dflash = dict(mask_token_id=s.pop("mask_token_id"), target_layer_ids=s.pop("target_layer_ids"),
                      block_size=self.block_size, num_target_layers=s.pop("num_target_layers"),
                      markov_rank=s.pop("markov_rank"), markov_head_type="vanilla", enable_confidence_head=True,
                      confidence_head_with_markov=True, causal=False)
        return dict(architectures=["DSparkDraftModel"], model_type="qwen3", **s, rope_is_neox_style=False,
                    attention_bias=False, hidden_act="silu", tie_word_embeddings=False, dtype=dtype,
                    dflash_config=dflash)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Interleaved RoPE (MLX's traditional): pairs (2i, 2i+1) turned by position * base^(-2i/dim); x [..., n, dim],
    positions broadcast against x's [..., n]."""
    dim = x.shape[-1]
    inv = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angle = positions.float()[..., None] * inv
    cos, sin = angle.cos(), angle.sin()
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: DSparkSpec):
        super().__init__()
        h, self.heads, self.kv, self.hd = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.theta = s.rope_theta
        self.q_proj = nn.Linear(h, self.heads * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.heads * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, s.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, s.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated normed keys and values [b, kv, n, hd] of rows x [b, n, h] at `positions` [b, n]."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv, self.hd).transpose(1, 2)
        return rope(k, positions[:, None], self.theta), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor, context_positions: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Block rows x [b, n, h] attend the context rows' keys and every block row they may see (`mask`
        [b, n, context + n], True where seen; None: everything)."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.hd)).transpose(1, 2)
        q = rope(q, positions[:, None], self.theta)
        ck, cv = self.keys_values(context, context_positions)
        bk, bv = self.keys_values(x, positions)
        k, v = torch.cat([ck, bk], dim=2), torch.cat([cv, bv], dim=2)
        groups = self.heads // self.kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                           scale=self.hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: DSparkSpec):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s.hidden_size, s.intermediate_size)
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x, positions, context, context_positions, mask):
        h = x + self.self_attn(self.input_layernorm(x), positions, context, context_positions, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, inputs: int):
        super().__init__()
        self.proj = nn.Linear(inputs, 1, bias=True)


class DSparkDrafter(nn.Module):
    """fc + hidden_norm make context rows of the tapped target rows; the layers run blocks over them; the heads read
    the final rows (the target's embedding and head are passed in, never owned)."""

    def __init__(self, s: DSparkSpec):
        super().__init__()
        self.spec = s
        self.fc = nn.Linear(len(s.target_layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList([Layer(s) for _ in range(s.num_hidden_layers)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.markov_head = MarkovHead(s.vocab_size, s.markov_rank)
        self.confidence_head = ConfidenceHead(s.hidden_size + s.markov_rank)
        self.reset()

    def reset(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.markov_head.markov_w2.weight)  # the bigram term starts silent, learned from the errors
        nn.init.zeros_(self.confidence_head.proj.bias)

    def context_rows(self, tapped: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(tapped))

    def blocks(self, x: torch.Tensor, positions: torch.Tensor, context: torch.Tensor, context_positions: torch.Tensor,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed block rows [b, n, h] from embedded block rows x at `positions`."""
        for layer in self.layers:
            x = layer(x, positions, context, context_positions, mask)
        return self.norm(x)

    def markov(self, previous: torch.Tensor) -> torch.Tensor:
        """W2 W1[previous] in float32: added to the logits of the row after each previous token."""
        return self.markov_head.markov_w2(self.markov_head.markov_w1(previous)).float()

    def confidence_logit(self, final: torch.Tensor, previous: torch.Tensor, detach: bool = False) -> torch.Tensor:
        """The confidence head's logit on [final row; W1[previous]]; `detach`: its loss trains the head alone."""
        w1 = self.markov_head.markov_w1(previous).to(final.dtype)
        features = torch.cat([final, w1], dim=-1)
        if detach:
            features = features.detach()
        return self.confidence_head.proj(features)[..., 0].float()


@torch.no_grad()
def hold(drafter: DSparkDrafter, embedding: torch.Tensor, tapped: torch.Tensor, pending: int, depth: int):
    """One stream's hold as tensorfold serves it: a block [pending, mask...] at the pending token's position after the
    tapped rows [n, taps*h]; logits row after row with the Markov term of the draft before. (logits, drafts, chances)."""
    s, n = drafter.spec, tapped.shape[0]
    c = drafter.context_rows(tapped[None])
    ids = torch.tensor([[pending] + [s.mask_token_id] * (depth - 1)])
    positions = torch.arange(n, n + depth)[None]
    final = drafter.blocks(embedding[ids], positions, c, torch.arange(n)[None])[0]
    base = final.float() @ embedding.float().T
    logits, drafts, chances, previous, running = [], [], [], pending, 1.0
    for j in range(depth):
        prev = torch.tensor([previous])
        row = base[j] + drafter.markov(prev)[0]
        running *= float(torch.sigmoid(drafter.confidence_logit(final[j][None], prev))[0])
        previous = int(row.argmax())
        logits.append(row)
        drafts.append(previous)
        chances.append(running)
    return torch.stack(logits), drafts, chances


def write_checkpoint(drafter: DSparkDrafter, out: Path, target_dir: Path | None = None,
                     dtype: torch.dtype = torch.bfloat16) -> Path:
    """The published layout: config.json, model.safetensors (no embedding, no head) and the target's tokenizer files."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype]
    (out / "config.json").write_text(json.dumps(drafter.spec.config(name), indent=2) + "\n")
    for f in TOKENIZER_FILES if target_dir is not None else ():
        if (Path(target_dir) / f).exists():
            shutil.copy(Path(target_dir) / f, out / f)
    return out


def read_checkpoint(path: Path) -> DSparkDrafter:
    """A drafter from a dir `write_checkpoint` wrote (float32)."""
    from safetensors.torch import load_file

    config = json.loads((Path(path) / "config.json").read_text())
    dflash = config["dflash_config"]
    spec = DSparkSpec(**{k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                                                "rms_norm_eps", "rope_theta", "max_position_embeddings",
                                                "block_size", "eos_token_id")},
                      **{k: dflash[k] for k in ("mask_token_id", "target_layer_ids", "num_target_layers",
                                                "markov_rank")})
    drafter = DSparkDrafter(spec)
    drafter.load_state_dict({k: v.float() for k, v in load_file(str(Path(path) / "model.safetensors")).items()})
    return drafter
