"""The llama architecture (llama, mistral): config, modules, sanitize, a forward over many streams' ragged windows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from tensorfold_core.errors import CheckpointError
from tensorfold_core.families import (WINDOW_SLACK, ConfigArgs, Span, check_keep, close_windows, pack_windows,
                                      packed_ids, picked_logits, size_class, swiglu)
from tensorfold_core.row_kernels.step_arrays import StreamGroup, padded_forward, row_positions, stream_groups

from .cache import KeptKV, KVCache, StackedKV


@dataclass
class ModelArgs(ConfigArgs):
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

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        rope = dict(self.rope_parameters or self.rope_scaling or {})
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        self.rope_type = rope.get("rope_type") or rope.get("type") or "default"
        self.rope = rope

    def check(self, source: str) -> None:
        if self.hidden_act not in ("silu", "swish"):
            raise CheckpointError(f"{source}: hidden_act {self.hidden_act!r} is not supported (llama uses silu)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"{source}: {self.num_attention_heads} attention heads are not a multiple of "
                                  f"{self.num_key_value_heads} key/value heads")
        if self.rope_type not in ("default", "linear", "llama3"):
            raise CheckpointError(f"{source}: rope type {self.rope_type!r} is not supported by the llama family "
                                  "(default, linear, llama3)")
        if self.rope_type != "default" and not self.rope.get("factor"):
            raise CheckpointError(f"{source}: rope type {self.rope_type!r} without a factor")


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

    def divisors(self) -> mx.array:
        """Each pair's angle as position / divisor, float32, the scaling folded in: what a rope kernel is given."""
        import numpy as np

        freqs = (np.array(self._freqs, np.float64) if self._freqs is not None
                 else self.base ** (np.arange(0, self.dims, 2, dtype=np.float64) / self.dims))
        return mx.array((freqs / self.scale).astype(np.float32))


def run_layers(layers: Sequence[nn.Module], parts: Sequence[tuple], stack_kv, h: mx.array, positions: mx.array,
               groups: Sequence[StreamGroup]) -> tuple[mx.array, mx.array, mx.array]:
    """The layers' output rows through each layer's (before, after) parts and its streams attention, and their new
    keys and values stacked [rows, layers, kv_heads, head_dim]."""
    new_keys, new_values = [], []
    for i, (layer, (before, after)) in enumerate(zip(layers, parts)):
        q, k, v = before(h, positions)
        h = after(h, layer.self_attn.mix_streams(q, k, v, groups, i))
        new_keys.append(k)
        new_values.append(v)
    keys, values = stack_kv(new_keys, new_values) if stack_kv is not None else \
        (mx.stack(new_keys, axis=1), mx.stack(new_values, axis=1))
    return h, keys, values


def whole_layers(layers: Sequence[nn.Module], stack_kv, layout: tuple) -> Callable:
    """run_layers as one function of arrays alone, for mx.compile: the groups' rows and cache counts fixed by
    `layout`, their row maps and buffers passed in (and the spans, where the attention reads cache offsets on the
    host). It holds the layers, not the model, so a dropped model's compiled forward makes no reference cycle."""
    from tensorfold_core.row_kernels.attention_streams import Packed

    parts = [(layer.before_roped, layer.after) for layer in layers]

    def traced(h, positions, rowmaps, keys, values):
        groups, at = [], 0
        for (lo, hi, spans, n), group_rowmap in zip(layout, rowmaps):
            groups.append((lo, hi, Packed(spans, group_rowmap), keys[at:at + n], values[at:at + n]))
            at += n
        return run_layers(layers, parts, stack_kv, h, positions, groups)

    return traced


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
        self.sliding_window = args.sliding_window
        # a window-attention record's implementation where the family's table names one (serving.py): it reads
        # the cache's whole buffer, each row over its own keys in fixed splits; None: MLX's fast SDPA
        self.attend = None
        object.__setattr__(self, "qkv", None)  # q, k and v in one launch where a record serves them (serving.py)
        # q and k roped, v copied, into their heads from qkv's joined rows in one launch (serving.py, roped only)
        object.__setattr__(self, "rope_qkv", None)
        # True: q and k come roped from the layer's compiled first part, every row at its own position, one launch
        # for all streams' rows (serving.py, where the window attention record serves and on the CPU); False: roped
        # per stream here
        self.roped = False
        # the packed-streams record's implementation where it serves (serving.py): every stream's rows of a forward in
        # one launch a layer, over caches the forward writes after its last layer (Model.forward_streams)
        self.attend_streams = None
        object.__setattr__(self, "o_residual", None)  # o_proj adding the residual in its launch (serving.py)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values of every packed row."""
        if self.qkv is not None:
            return tuple(self.qkv(x))
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def project_roped(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries [rows, heads, head_dim] and keys [rows, kv_heads, head_dim] roped at each row's own position (one
        rope a row, as a window's rope at its offset computes it), and values [rows, kv_heads, head_dim]."""
        if self.rope_qkv is not None:
            return self.rope_qkv(self.qkv.joined(x), positions)
        rows = x.shape[0]
        q, k, v = self.project(x)
        q = self.rope(q.reshape(rows, self.n_heads, 1, -1), positions).reshape(rows, self.n_heads, -1)
        k = self.rope(k.reshape(rows, self.n_kv_heads, 1, -1), positions).reshape(rows, self.n_kv_heads, -1)
        return q, k, v.reshape(rows, self.n_kv_heads, -1)

    def mix(self, queries: mx.array, keys: mx.array, values: mx.array, spans: Sequence[Span],
            layer: int) -> mx.array:
        """Each stream's rows attend over its own cache (the window's keys written there first); rows packed again."""
        outs = []
        for start, n, cache, mask in spans:  # projections are packed; attention runs per stream on its cache
            if self.roped and self.attend is not None:  # q and k roped: keys into the cache, the record over it all
                cache.store(layer, keys[start:start + n].transpose(1, 0, 2)[None],
                            values[start:start + n].transpose(1, 0, 2)[None])
                o = self.attend(queries[start:start + n], cache.keys[layer], cache.values[layer], cache.offset,
                                self.scale, self.sliding_window)
                outs.append(o.reshape(n, -1))  # float32, cast below
                continue
            q = queries[start:start + n].reshape(1, n, self.n_heads, -1).transpose(0, 2, 1, 3)
            k = keys[start:start + n].reshape(1, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = values[start:start + n].reshape(1, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
            if not self.roped:  # roped rows come roped from the layer's first part
                q, k = self.rope(q, cache.offset), self.rope(k, cache.offset)
            k, v = cache.write(layer, k, v)
            if self.attend is not None:
                o = self.attend(q[0].transpose(1, 0, 2), cache.keys[layer], cache.values[layer], cache.offset,
                                self.scale, self.sliding_window)
                outs.append(o.reshape(n, -1))
                continue
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            outs.append(o.transpose(0, 2, 1, 3).reshape(n, -1))
        mixed = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        # the record writes float32: one cast for every stream's rows, not a launch a stream (elementwise, so the same
        # bits either way)
        return mixed if self.attend is None else mixed.astype(queries.dtype)

    def mix_streams(self, queries: mx.array, keys: mx.array, values: mx.array, groups: Sequence[StreamGroup],
                    layer: int) -> mx.array:
        """Every stream's rows over its cache before its window and the window's own rows: a launch for each group of
        streams (one up to 8 streams), the caches read as the forward found them."""
        outs = []
        for lo, hi, packed, caches_k, caches_v in groups:
            rows = slice(lo, hi)
            q, k, v = (queries, keys, values) if len(groups) == 1 else (queries[rows], keys[rows], values[rows])
            outs.append(self.attend_streams(q, k, v, caches_k, caches_v, packed, layer, self.scale,
                                            self.sliding_window))
        mixed = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        return mixed.reshape(queries.shape[0], -1)  # in the queries' dtype: the record rounds its fp32 result once

    def __call__(self, x: mx.array, spans: Sequence[Span], layer: int) -> mx.array:
        return self.o_proj(self.mix(*self.project(x), spans, layer))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        object.__setattr__(self, "gate_up", None)  # both in one launch where a record serves them (serving.py)
        # down_proj adding the residual in its launch, reading swiglu's output or computing swiglu of gate_up's
        # joined output as it reads it; swiglu stored by gate_up's launch (serving.py)
        object.__setattr__(self, "down_residual", None)
        object.__setattr__(self, "swiglu", None)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(swiglu(gate, up))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # the parts of a layer with no cache in them, as (before, after), mx.compile'd where records serve on a GPU;
        # None: the methods themselves (kept out of the attribute, whose bound methods would make a reference cycle
        # that keeps a dropped model's weights alive until the next garbage collection)
        object.__setattr__(self, "halves", None)
        # the input norm read by the q|k|v launch (roped only), the post-attention norm by gate|up's swiglu-storing
        # launch: one launch each where there were two (serving.py)
        object.__setattr__(self, "normed_qkv", None)
        object.__setattr__(self, "normed_roped_qkv", None)  # and rope stored by that launch too (serving.py)
        object.__setattr__(self, "normed_swiglu", None)

    def before(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.self_attn.project(self.input_layernorm(x))

    def before_roped(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if self.normed_roped_qkv is not None:
            return self.normed_roped_qkv(x, positions)
        if self.normed_qkv is not None:
            return self.self_attn.rope_qkv(self.normed_qkv(x), positions)
        return self.self_attn.project_roped(self.input_layernorm(x), positions)

    def after(self, x: mx.array, mixed: mx.array) -> mx.array:
        attn, mlp = self.self_attn, self.mlp
        h = attn.o_residual(mixed, x) if attn.o_residual is not None else x + attn.o_proj(mixed)
        if self.normed_swiglu is not None:
            return mlp.down_residual(self.normed_swiglu(h), h)
        if mlp.down_residual is not None:
            normed = self.post_attention_layernorm(h)
            return mlp.down_residual(mlp.swiglu(normed) if mlp.swiglu is not None else mlp.gate_up.joined(normed), h)
        return h + mlp(self.post_attention_layernorm(h))

    def __call__(self, x: mx.array, spans: Sequence[Span], layer: int, positions: mx.array | None = None) -> mx.array:
        before, after = self.halves or (self.before, self.after)
        parts = before(x) if positions is None else before(x, positions)
        return after(x, self.self_attn.mix(*parts, spans, layer))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    """A llama checkpoint as a tensorfold Model: ragged windows of many streams in one forward."""

    taps = 0  # no layer taps: the llama family hands no drafter its hidden rows
    shards = 1  # ranks the heads are split over: a group's shard (tensorfold_core.shard) sets it

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.vocab_size = args.vocab_size
        self.dtype = mx.float32  # the activation dtype; the loader sets it from the weights
        self.kernels: dict = {}  # what serves each row-path op here (serving.serve_kernels fills it at load)
        self.served_head = None  # a tied head served by a kernel record, where one serves projections
        self.stacked = False  # caches of one buffer for all layers, written once a forward (serving.py sets it)
        self.stack_kv = None  # the layers' new keys and values stacked by a kernel record (serving.py sets it)
        # the stacked layers mx.compile'd whole, a trace a shape (serving.py sets a KeyCompiled); whole_spans: the
        # streams' spans are in its key, where the attention reads cache offsets on the host (MLX's composed ops)
        self.whole = None
        self.whole_spans = False
        self.pad_rows = 0  # a whole forward's rows past this padded to a multiple of it, where they key its trace
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "self_attn.rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    def new_cache(self, capacity: int, marks: int = 0) -> KVCache:
        a = self.args  # keys trim to any prefix, so no marks are needed
        kind = StackedKV if self.stacked else KVCache
        return kind(a.num_hidden_layers, a.num_key_value_heads // self.shards, a.head_dim,
                    self.capacity_for(capacity), self.dtype)

    def capacity_for(self, tokens: int) -> int:
        """A cache's capacity for a stream of at most `tokens`: where a whole forward's trace is keyed by its caches'
        shapes, one of a few sizes (at most a quarter over), so that streams of near limits share their traces."""
        return size_class(tokens) if self.whole is not None and not self.whole_spans else tokens

    def snapshot(self, cache: KVCache) -> KeptKV:
        """A standalone copy of the committed tokens' keys and values (a kept prompt state)."""
        return cache.snapshot()

    def restore(self, state: KeptKV, capacity: int, tokens: int | None = None, marks: int = 0) -> KVCache:
        """A new cache holding the first `tokens` of a kept state."""
        cache = self.new_cache(capacity)
        cache.restore(state, state.tokens if tokens is None else tokens)
        return cache

    def state_bytes(self, state: KeptKV) -> int:
        return state.nbytes

    def cache_bytes(self, tokens: int) -> int:
        a = self.args
        heads = a.num_key_value_heads // self.shards  # this rank's share
        return 2 * a.num_hidden_layers * heads * a.head_dim * (self.capacity_for(tokens) + WINDOW_SLACK) * \
            self.dtype.size

    def forward(self, caches: Sequence[KVCache], windows: Sequence[Sequence[int]],
                logit_rows: Sequence[int]) -> mx.array:
        ids = packed_ids(windows, self.vocab_size)
        return self.forward_ids(caches, ids, [len(window) for window in windows], logit_rows)

    def forward_ids(self, caches: Sequence[KVCache], ids: mx.array, lengths: Sequence[int],
                    logit_rows: Sequence[int], commit: bool = False) -> mx.array:
        """forward on ids already packed in an mx.array (a drafter's lazy argmaxes); commit keeps every row, no eval."""
        spans, pick = pack_windows(caches, ids, lengths, logit_rows, self.args.sliding_window)
        h = self.model.embed_tokens(ids)
        positions = row_positions(spans) if self.model.layers[0].self_attn.roped else None  # always, where stacked
        if self.stacked:
            h = self.forward_streams(h, spans, positions)
        else:
            for i, layer in enumerate(self.model.layers):
                h = layer(h, spans, i, positions)
        close_windows(spans, commit)
        head = self.served_head or (self.model.embed_tokens.as_linear if self.args.tie_word_embeddings
                                    else self.lm_head)
        return picked_logits(h, pick, self.model.norm, head, self.vocab_size)

    def forward_streams(self, h: mx.array, spans: Sequence[Span], positions: mx.array) -> mx.array:
        """The layers over stacked caches: each layer's attention one launch for up to 8 streams, reading the caches
        as they were; then each stream's window of every layer stored at once."""
        rows = h.shape[0]
        h, padded, positions = padded_forward(h, spans, positions, self.pad_rows)
        groups, traced = stream_groups(padded, positions), None
        if self.whole is not None:  # every layer in one compiled call: one trace a shape replays every launch
            layout = tuple((lo, hi, packed.spans if self.whole_spans else None, len(ks))
                           for lo, hi, packed, ks, _ in groups)
            key = (h.shape[0], layout, tuple(tuple(k.shape) for g in groups for k in g[3]))
            traced = self.whole.get(key, lambda: whole_layers(self.model.layers, self.stack_kv, layout))
        if traced is None:  # no whole forward, or a shape met for the first time: the layers' parts from Python
            parts = [layer.halves or (layer.before_roped, layer.after) for layer in self.model.layers]
            h, keys, values = run_layers(self.model.layers, parts, self.stack_kv, h, positions, groups)
        else:
            h, keys, values = traced(h, positions, [g[2].rowmap for g in groups], [k for g in groups for k in g[3]],
                                     [v for g in groups for v in g[4]])
        # stored after the last layer's attention has read the caches, so each buffer is updated in place
        keys, values = mx.depends([keys, values], [h])
        for start, n, cache, _ in spans:
            cache.store_window(keys[start:start + n], values[start:start + n])
        return h if h.shape[0] == rows else h[:rows]

    def keep(self, cache: KVCache, rows: int) -> None:
        mx.eval(self.keep_later(cache, rows))  # cut the graph: a window whose rows gave no logits is computed here

    def keep_later(self, cache: KVCache, rows: int) -> list[mx.array]:
        """keep() without waiting: the arrays that hold the commit, for the caller to evaluate with its next step."""
        check_keep(cache, rows)
        return cache.commit(rows)
