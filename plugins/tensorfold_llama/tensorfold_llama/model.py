"""The llama architecture (llama, mistral): config, modules, sanitize, a forward over many streams' ragged windows."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from functools import partial
from typing import NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn

from tensorfold_core.errors import CheckpointError

WINDOW_SLACK = 16  # rows a cache holds beyond its capacity, for the window that is not kept yet
GROW_STEP = 256


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    head_dim: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict | None = None  # configs before transformers 5
    rope_parameters: dict | None = None  # transformers 5: rope_theta and the scaling in one dict
    tie_word_embeddings: bool | None = None  # None: tied when the checkpoint has no lm_head
    sliding_window: int | None = None  # mistral

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> "ModelArgs":
        missing = [f.name for f in fields(cls) if f.default is MISSING and config.get(f.name) is None]
        if missing:
            raise CheckpointError(f"{source}: missing {', '.join(missing)}")
        args = cls(**{k: v for k, v in config.items() if k in {f.name for f in fields(cls)}})
        if args.hidden_act not in ("silu", "swish"):
            raise CheckpointError(f"{source}: hidden_act {args.hidden_act!r} is not supported (llama uses silu)")
        if args.num_attention_heads % args.num_key_value_heads:
            raise CheckpointError(f"{source}: {args.num_attention_heads} attention heads are not a multiple of "
                                  f"{args.num_key_value_heads} key/value heads")
        if args.rope_type not in ("default", "linear", "llama3"):
            raise CheckpointError(f"{source}: rope type {args.rope_type!r} is not supported by the llama family "
                                  "(default, linear, llama3)")
        if args.rope_type != "default" and not args.rope.get("factor"):
            raise CheckpointError(f"{source}: rope type {args.rope_type!r} without a factor")
        return args

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        rope = dict(self.rope_parameters or self.rope_scaling or {})
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        self.rope_type = rope.get("rope_type") or rope.get("type") or "default"
        self.rope = rope


@partial(mx.compile, shapeless=True)
def swiglu(gate, x):
    return nn.silu(gate) * x


class RoPE(nn.Module):
    """Rotary embedding at absolute positions offset.., with llama3 and linear frequency scaling."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.dims = args.head_dim
        self.traditional = args.rope_traditional
        self.base, self.scale, self._freqs = args.rope_theta, 1.0, None
        kind, rope = args.rope_type, args.rope
        if kind == "linear":
            self.scale = 1 / rope["factor"]
        elif kind == "llama3":
            self.base, self._freqs = None, llama3_freqs(self.dims, args.rope_theta, rope)

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
                            offset=offset, freqs=self._freqs)


def llama3_freqs(dims: int, base: float, rope: dict) -> mx.array:
    """Llama 3.1 wavelengths: long ones stretched by `factor`, short ones kept, a smooth ramp between."""
    factor = rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > context / low, freqs * factor, freqs)
    medium = (wavelens > context / high) & (wavelens < context / low)
    smooth = (context / wavelens - low) / (high - low)
    return mx.where(medium, freqs / ((1 - smooth) / factor + smooth), freqs)


class Span(NamedTuple):
    """One stream's rows in the packed matrix: rows start..start+n run on `cache` at its offset."""

    start: int
    n: int
    cache: "KVCache"
    mask: mx.array | None


def attention_mask(offset: int, n: int, window: int | None) -> mx.array | None:
    """Causal within the window (and within the sliding window); None where every key is visible."""
    if n == 1 and (window is None or offset < window):
        return None
    rows = mx.arange(offset, offset + n)[:, None]
    cols = mx.arange(offset + n)[None]
    mask = cols <= rows
    return mask & (cols > rows - window) if window else mask


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, bias = args.hidden_size, args.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim ** -0.5
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.rope = RoPE(args)

    def __call__(self, x: mx.array, spans: Sequence[Span], layer: int) -> mx.array:
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        outs = []
        for start, n, cache, mask in spans:  # projections are packed; attention runs per stream on its cache
            q = queries[start:start + n].reshape(1, n, self.n_heads, -1).transpose(0, 2, 1, 3)
            k = keys[start:start + n].reshape(1, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = values[start:start + n].reshape(1, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q, k = self.rope(q, cache.offset), self.rope(k, cache.offset)
            k, v = cache.write(layer, k, v)
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            outs.append(o.transpose(0, 2, 1, 3).reshape(n, -1))
        return self.o_proj(outs[0] if len(outs) == 1 else mx.concatenate(outs))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, spans: Sequence[Span], layer: int) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), spans, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class KVCache:
    """One stream's keys and values per layer, preallocated for `capacity` tokens plus one window."""

    def __init__(self, args: ModelArgs, capacity: int, dtype: mx.Dtype):
        self.offset = 0
        self.capacity = capacity
        self.window: int | None = None  # rows of the last forward, until kept
        shape = (1, args.num_key_value_heads, capacity + WINDOW_SLACK, args.head_dim)
        self.keys = [mx.zeros(shape, dtype) for _ in range(args.num_hidden_layers)]
        self.values = [mx.zeros(shape, dtype) for _ in range(args.num_hidden_layers)]

    def reserve(self, n: int) -> None:
        """Grow the storage when a window reaches past it (a long prefill chunk near capacity)."""
        size = self.keys[0].shape[2]
        if self.offset + n <= size:
            return
        extra = -(-(self.offset + n - size) // GROW_STEP) * GROW_STEP
        pad = lambda a: mx.concatenate([a, mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)], axis=2)
        self.keys, self.values = [pad(a) for a in self.keys], [pad(a) for a in self.values]

    def trim(self, tokens: int) -> None:
        """Keep only the first `tokens` committed tokens (a drafter slot cut back to its context's prefix)."""
        if not 0 <= tokens <= self.offset or self.window is not None:
            raise ValueError(f"cannot trim a cache of {self.offset} tokens (window {self.window}) to {tokens}")
        self.offset = tokens

    def write(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store the window's keys and values at offset..; return every key and value up to its last row."""
        end = self.offset + k.shape[2]
        self.keys[layer][..., self.offset:end, :] = k
        self.values[layer][..., self.offset:end, :] = v
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]


class KeptKV:
    """Keys and values of `tokens` committed tokens, restorable at any prefix of them."""

    def __init__(self, tokens: int, keys: list, values: list):
        self.tokens, self.keys, self.values = tokens, keys, values

    def resume_point(self, limit: int) -> int:
        return max(0, min(limit, self.tokens))


class Model(nn.Module):
    """A llama checkpoint as a tensorfold Model: ragged windows of many streams in one forward."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.vocab_size = args.vocab_size
        self.dtype = mx.float32  # the activation dtype; the loader sets it from the weights
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "self_attn.rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def new_cache(self, capacity: int, marks: int = 0) -> KVCache:
        return KVCache(self.args, capacity, self.dtype)  # keys trim to any prefix, so no marks are needed

    def snapshot(self, cache: KVCache) -> "KeptKV":
        """A standalone copy of the committed tokens' keys and values (a kept prompt state)."""
        n = cache.offset
        keys = [mx.contiguous(k[..., :n, :]) for k in cache.keys]
        values = [mx.contiguous(v[..., :n, :]) for v in cache.values]
        mx.eval(keys, values)
        return KeptKV(n, keys, values)

    def restore(self, state: "KeptKV", capacity: int, tokens: int | None = None, marks: int = 0) -> KVCache:
        """A new cache holding the first `tokens` of a kept state."""
        n = state.tokens if tokens is None else tokens
        if not 0 <= n <= min(state.tokens, capacity):
            raise ValueError(f"cannot restore {n} tokens of a state of {state.tokens} into capacity {capacity}")
        cache = self.new_cache(capacity)
        for layer in range(len(cache.keys)):
            cache.keys[layer][..., :n, :] = state.keys[layer][..., :n, :]
            cache.values[layer][..., :n, :] = state.values[layer][..., :n, :]
        cache.offset = n
        mx.eval(cache.keys, cache.values)
        return cache

    def state_bytes(self, state: "KeptKV") -> int:
        return sum(a.nbytes for a in state.keys + state.values)

    def cache_bytes(self, tokens: int) -> int:
        a = self.args
        return 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * (tokens + WINDOW_SLACK) * self.dtype.size

    def forward(self, caches: Sequence[KVCache], windows: Sequence[Sequence[int]],
                logit_rows: Sequence[int]) -> mx.array:
        if not len(caches) == len(windows) == len(logit_rows):
            raise ValueError(f"{len(caches)} caches, {len(windows)} windows, {len(logit_rows)} logit_rows")
        for window, rows in zip(windows, logit_rows):
            if len(window) == 0 or not 0 <= rows <= len(window):
                raise ValueError(f"a window of {len(window)} rows cannot give {rows} logit rows")
        tokens = [token for window in windows for token in window]
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"token ids must lie in 0..{self.vocab_size - 1}, got {min(tokens)}..{max(tokens)}")
        return self.forward_ids(caches, mx.array(tokens, dtype=mx.uint32), [len(w) for w in windows], logit_rows)

    def forward_ids(self, caches: Sequence[KVCache], ids: mx.array, lengths: Sequence[int],
                     logit_rows: Sequence[int], commit: bool = False) -> mx.array:
        """forward on ids already packed in an mx.array (a drafter's lazy argmaxes); commit keeps every row, no eval."""
        if len({id(cache) for cache in caches}) < len(caches):
            raise ValueError("a cache appears twice in one forward")
        spans, pick, start = [], [], 0
        for cache, n, rows in zip(caches, lengths, logit_rows):
            if cache.window is not None:
                raise ValueError("keep() the cache's last window before its next forward")
            cache.reserve(n)
            spans.append(Span(start, n, cache, attention_mask(cache.offset, n, self.args.sliding_window)))
            pick.extend(range(start + n - rows, start + n))
            start += n
        h = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, spans, i)
        for span in spans:  # offsets were read while the graph was built, so they may move now
            if commit:
                span.cache.offset += span.n
            else:
                span.cache.window = span.n
        if not pick:
            return mx.zeros((0, self.vocab_size), mx.float32)
        h = self.model.norm(h[mx.array(pick)] if len(pick) < start else h)  # row-wise: select rows first
        out = self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)
        return out.astype(mx.float32)

    def keep(self, cache: KVCache, rows: int) -> None:
        if cache.window is None:
            raise ValueError("keep() without a forward on this cache")
        if not 0 <= rows <= cache.window:
            raise ValueError(f"cannot keep {rows} rows of a window of {cache.window}")
        if cache.offset + rows > cache.capacity:
            raise ValueError(f"a cache of capacity {cache.capacity} cannot hold {cache.offset + rows} tokens")
        cache.offset += rows
        cache.window = None
        mx.eval(cache.keys, cache.values)  # cut the graph: a window whose rows gave no logits is computed here

