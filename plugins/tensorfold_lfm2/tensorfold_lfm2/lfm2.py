"""The LFM2 architecture (short convs and attention): config, modules, sanitize, a forward over ragged windows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from tensorfold_core.errors import CheckpointError
from tensorfold_core.families import (WINDOW_SLACK, ConfigArgs, Span, check_keep, close_windows, pack_windows,
                                      packed_ids, picked_logits, size_class, swiglu)
from tensorfold_core.row_kernels.step_arrays import row_positions
from tensorfold_core.protocols import TappedRows

from .cache import HybridCache, KeptState, Shape
from .streams import forward_streams

LAYER_TYPES = ("conv", "full_attention")


@dataclass
class ModelArgs(ConfigArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int | None = None
    block_ff_dim: int | None = None  # the older name of intermediate_size
    num_key_value_heads: int | None = None
    norm_eps: float = 1e-5
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_dim: int | None = None  # transformers 5 no longer writes it: hidden_size
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float | None = 1.0
    block_auto_adjust_ff_dim: bool = True
    rope_theta: float = 1000000.0
    rope_parameters: dict | None = None
    layer_types: list[str] | None = None
    full_attn_idxs: list[int] | None = None  # older configs: which layers attend
    tie_word_embeddings: bool | None = None  # None: tied when the checkpoint has no lm_head
    tie_embedding: bool | None = None  # older configs

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.intermediate_size = self.intermediate_size or self.block_ff_dim
        self.block_dim = self.block_dim or self.hidden_size
        if self.tie_word_embeddings is None and self.tie_embedding is not None:
            self.tie_word_embeddings = self.tie_embedding
        rope = dict(self.rope_parameters or {})
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        self.rope_type = rope.get("rope_type") or rope.get("type") or "default"
        if self.layer_types is None:  # as transformers: full_attn_idxs, else every layer attends
            attends = self.full_attn_idxs if self.full_attn_idxs is not None else range(self.num_hidden_layers)
            self.layer_types = [LAYER_TYPES[i in attends] for i in range(self.num_hidden_layers)]

    def check(self, source: str) -> None:
        if self.intermediate_size is None:
            raise CheckpointError(f"{source}: missing intermediate_size (or block_ff_dim)")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown or len(self.layer_types) != self.num_hidden_layers:
            raise CheckpointError(f"{source}: layer_types must name {self.num_hidden_layers} layers, each one of "
                                  f"{', '.join(LAYER_TYPES)} (got {self.layer_types})")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"{source}: hidden_size {self.hidden_size}, {self.num_attention_heads} attention "
                                  f"heads and {self.num_key_value_heads} key/value heads do not divide")
        if self.block_dim != self.hidden_size:
            raise CheckpointError(f"{source}: block_dim {self.block_dim} differs from hidden_size {self.hidden_size}")
        if self.rope_type != "default":
            raise CheckpointError(f"{source}: rope type {self.rope_type!r} is not supported by the lfm2 family")
        if self.conv_L_cache < 1:
            raise CheckpointError(f"{source}: conv_L_cache {self.conv_L_cache} must be at least 1")

    @property
    def ff_dim(self) -> int:
        """The SwiGLU width by transformers' rule: two thirds, times the multiplier, rounded up to the multiple."""
        # mlx-lm rounds up even without a multiplier; transformers (which writes the checkpoints) does not
        dim = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            dim = int(2 * dim / 3)
            if self.block_ffn_dim_multiplier is not None:
                dim = int(self.block_ffn_dim_multiplier * dim)
                dim = self.block_multiple_of * -(-dim // self.block_multiple_of)
        return dim

    def attends(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim ** -0.5
        self.rope_theta = args.rope_theta
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_layernorm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
        self.k_layernorm = nn.RMSNorm(self.head_dim, eps=args.norm_eps)
        # a window-attention record's implementation where the table names one (serving.py): it reads the cache's
        # whole buffer, each row over its own keys in fixed splits; None: MLX's fast SDPA
        self.attend = None
        # True: q and k come roped from the layer's compiled first part, every row at its own position, one rope for
        # every stream's rows (serving.py); False: roped per stream in `mix`
        self.roped = False
        # the packed-streams record's implementation where it serves (serving.py): every stream's rows of a forward in
        # one launch a layer, over stacked caches the forward writes after its last layer (streams.py)
        self.attend_streams = None
        object.__setattr__(self, "out_residual", None)  # out_proj adding the residual in its launch (serving.py)

    def rope(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(x, self.head_dim, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def project_joined(self, qkv: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """`project` from q|k|v side by side, as one launch over the stacked weights writes them (serving.py)."""
        q_end = self.n_heads * self.head_dim
        k_end = q_end + self.n_kv_heads * self.head_dim
        return self.heads(qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:])

    def heads(self, q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        rows = q.shape[0]
        queries = self.q_layernorm(q.reshape(rows, self.n_heads, -1))  # per-head norms are row-wise
        keys = self.k_layernorm(k.reshape(rows, self.n_kv_heads, -1))
        return queries, keys, v.reshape(rows, self.n_kv_heads, -1)

    def rope_rows(self, queries: mx.array, keys: mx.array, values: mx.array,
                  positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q and k roped at each row's own position (one rope a row, as a window's rope at its offset)."""
        rows = queries.shape[0]
        queries = self.rope(queries[:, :, None], positions).reshape(rows, self.n_heads, -1)
        return queries, self.rope(keys[:, :, None], positions).reshape(rows, self.n_kv_heads, -1), values

    def mix(self, queries: mx.array, keys: mx.array, values: mx.array, spans: Sequence[Span],
            slot: int) -> tuple[mx.array]:
        outs = []
        for start, n, cache, mask in spans:  # projections are packed; attention runs per stream on its cache
            if self.roped and self.attend is not None:  # the roped rows into the cache, the record over it all
                cache.store(slot, keys[start:start + n].transpose(1, 0, 2)[None],
                            values[start:start + n].transpose(1, 0, 2)[None])
                o = self.attend(queries[start:start + n], cache.keys[slot], cache.values[slot], cache.offset,
                                self.scale, None)
                outs.append(o.reshape(n, -1))
                continue
            q, k, v = (a[start:start + n][None].transpose(0, 2, 1, 3) for a in (queries, keys, values))
            if not self.roped:
                q, k = self.rope(q, cache.offset), self.rope(k, cache.offset)
            k, v = cache.write(slot, k, v)
            if self.attend is not None:
                o = self.attend(q[0].transpose(1, 0, 2), cache.keys[slot], cache.values[slot], cache.offset,
                                self.scale, None)
                outs.append(o.reshape(n, -1))
                continue
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            outs.append(o.transpose(0, 2, 1, 3).reshape(n, -1))
        mixed = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        # the record writes float32: one cast for every stream's rows, not a launch a stream (the same bits)
        return (mixed if self.attend is None else mixed.astype(values.dtype)),

    def mix_streams(self, queries: mx.array, keys: mx.array, values: mx.array, groups: Sequence,
                    slot: int) -> tuple[mx.array]:
        """Every stream's rows over its cache before its window and the window's own rows: a launch for each group of
        up to 8 streams, the caches read as the forward found them."""
        outs = []
        for lo, hi, packed, caches_k, caches_v in groups:
            rows = slice(lo, hi)
            q, k, v = (queries, keys, values) if len(groups) == 1 else (queries[rows], keys[rows], values[rows])
            outs.append(self.attend_streams(q, k, v, caches_k, caches_v, packed, slot, self.scale, None))
        mixed = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        return mixed.reshape(queries.shape[0], -1),  # in the queries' dtype: the record rounds its fp32 result once

    def out_rows(self, mixed: mx.array) -> mx.array:
        """What out_proj reads."""
        return mixed


class ShortConv(nn.Module):
    """in_proj to B, C, x; a depthwise causal conv over the gated B·x; C gates the conv; out_proj."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        dim = args.hidden_size
        self.in_proj = nn.Linear(dim, 3 * dim, bias=args.conv_bias)
        self.conv = nn.Conv1d(dim, dim, kernel_size=args.conv_L_cache, groups=dim, bias=args.conv_bias)
        self.out_proj = nn.Linear(dim, dim, bias=args.conv_bias)
        self.served = None  # the stream conv record where the table names one (serving.py); None: nn.Conv1d
        # every stream's rows in one launch of the streams conv record, (gated, streams.ConvStreams, slot) ->
        # (convolved, the tail each row leaves), where the model's caches are stacked (serving.py)
        object.__setattr__(self, "streams", None)
        object.__setattr__(self, "out_residual", None)  # out_proj adding the residual in its launch (serving.py)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array]:
        return self.project_joined(self.in_proj(x))

    def project_joined(self, bcx: mx.array) -> tuple[mx.array, mx.array]:
        """C and the gated B·x from in_proj's output."""
        b, c, x = mx.split(bcx, 3, axis=-1)
        return c, b * x

    def mix(self, c: mx.array, gated: mx.array, spans: Sequence[Span], slot: int) -> tuple[mx.array, mx.array]:
        # per stream: the conv reads the stream's committed tail; the cache keeps the rows for keep()
        outs = []
        for start, n, cache, _ in spans:
            rows, tail = gated[start:start + n], cache.conv[slot]
            if self.served is None:
                outs.append(self.conv(cache.conv_input(slot, rows[None]))[0])  # over [tail; rows]
                continue
            convolved, states = self.served.run(tail, rows)  # and the tail each row leaves, for keep()
            cache.conv_states(slot, states)
            outs.append(convolved)
        return c, (outs[0] if len(outs) == 1 else mx.concatenate(outs))

    def out_rows(self, c: mx.array, convolved: mx.array) -> mx.array:
        """What out_proj reads: C gates the conv."""
        return c * convolved


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        # w1|w3 storing swiglu of its halves in one launch, w2 adding the residual in its launch (serving.py)
        object.__setattr__(self, "swiglu", None)
        object.__setattr__(self, "down_residual", None)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(self.swiglu(x) if self.swiglu is not None else swiglu(self.w1(x), self.w3(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, feed_forward: nn.Module):
        super().__init__()
        self.is_attention_layer = args.attends(layer)
        if self.is_attention_layer:
            self.self_attn = Attention(args)
        else:
            self.conv = ShortConv(args)
        self.feed_forward = feed_forward
        self.operator_norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)

        # the parts of a layer with no cache in them, as (before, after), mx.compile'd where records serve on a GPU;
        # None: the methods themselves (kept out of the attribute, whose bound methods would make a reference cycle
        # that keeps a dropped model's weights alive until the next garbage collection)
        object.__setattr__(self, "halves", None)
        # the operator norm read by the op's input launch (q|k|v or in_proj, its parts side by side), the ffn norm by
        # w1|w3's swiglu-storing launch: one launch each where there were two (serving.py)
        object.__setattr__(self, "normed_in", None)
        object.__setattr__(self, "normed_swiglu", None)

    @property
    def op(self) -> nn.Module:
        return self.self_attn if self.is_attention_layer else self.conv

    def before(self, x: mx.array) -> tuple[mx.array, ...]:
        if self.normed_in is not None:
            return self.op.project_joined(self.normed_in(x))
        return self.op.project(self.operator_norm(x))

    def before_roped(self, x: mx.array, positions: mx.array) -> tuple[mx.array, ...]:
        return self.self_attn.rope_rows(*self.before(x), positions)

    def after(self, x: mx.array, *mixed: mx.array) -> mx.array:
        op, ff = self.op, self.feed_forward
        rows = op.out_rows(*mixed)
        h = op.out_residual(rows, x) if op.out_residual is not None else x + op.out_proj(rows)
        if self.normed_swiglu is not None:
            return ff.down_residual(self.normed_swiglu(h), h)
        if getattr(ff, "down_residual", None) is not None:
            return ff.down_residual(ff.swiglu(self.ffn_norm(h)), h)
        return h + ff(self.ffn_norm(h))

    def __call__(self, x: mx.array, spans: Sequence[Span], slot: int, positions: mx.array | None = None) -> mx.array:
        before, after = self.halves or (self.before, self.after)
        parts = before(x, positions) if self.is_attention_layer and self.self_attn.roped else before(x)
        return after(x, *self.op.mix(*parts, spans, slot))


class Lfm2Model(nn.Module):
    def __init__(self, args: ModelArgs, feed_forwards: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i, ff) for i, ff in enumerate(feed_forwards)]
        self.embedding_norm = nn.RMSNorm(args.hidden_size, eps=args.norm_eps)


def tapped_rows(outputs: dict[int, mx.array], layers: Sequence[int]) -> mx.array:
    """The tapped layers' rows side by side: row r is layers[0]'s row r, then layers[1]'s, and so on."""
    return mx.concatenate([outputs[i] for i in layers], axis=-1)


class Model(nn.Module):
    """An LFM2 checkpoint as a tensorfold Model: ragged windows of many streams in one forward."""

    shards = 1  # ranks the heads and conv channels are split over: a group's shard (tensorfold_core.shard) sets it

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.vocab_size = args.vocab_size
        self.dtype = mx.float32  # the activation dtype; the loader sets it from the weights
        self.kernels: dict = {}  # what serves each row-path op here (serving.serve_kernels fills it at load)
        self.served_head = None  # a tied head served by a kernel record, where one serves projections
        self.reads_on_host = False  # True where served MoE blocks read their picks on the host mid-forward
        self.roped = False  # True where the attention layers rope a row at a time in their first part (serving.py)
        self.stacked = False  # caches of one buffer for all layers of a kind, written once a forward (serving.py)
        self.stack_kv = None  # the layers' new keys and values stacked by a kernel record (serving.py sets it)
        # the stacked layers mx.compile'd whole, a trace a shape (serving.py sets a KeyCompiled); whole_spans: the
        # streams' spans are in its key, where the attention reads cache offsets on the host (MLX's composed ops)
        self.whole = None
        self.whole_spans = False
        # the streams' conv spans in its key too: only the MLX conv reads them; the kernels read the row map, an input
        self.whole_conv_spans = False
        self.pad_rows = 0  # a whole forward's rows past this padded to a multiple of it, where they key its trace
        self.taps = args.num_hidden_layers  # every layer's output can be tapped for a drafter
        self.hidden_size = args.hidden_size
        self._tapped: tuple[int, ...] = ()  # the layers tapped now (features)
        self.model = Lfm2Model(args, [self.feed_forward(i) for i in range(args.num_hidden_layers)])
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # each layer's index among the layers of its kind: its slot in the cache
        kinds = [args.attends(i) for i in range(args.num_hidden_layers)]
        self._slots = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]

    def feed_forward(self, layer: int) -> nn.Module:
        return MLP(self.args.hidden_size, self.args.ff_dim)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Published names and layouts onto the modules: the conv weight from transformers' [C, 1, L] to [C, L, 1]."""
        out = {}
        for name, w in weights.items():
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.args.tie_word_embeddings):
                continue
            if name.endswith("conv.conv.weight") and w.ndim == 3 and w.shape[1] == 1 and w.shape[2] > 1:
                w = w.transpose(0, 2, 1)
            out[name] = w
        return out

    @property
    def _shape(self) -> Shape:
        a = self.args
        attention = sum(map(a.attends, range(a.num_hidden_layers)))
        return Shape(attention, a.num_key_value_heads // self.shards, a.head_dim, a.num_hidden_layers - attention,
                     a.hidden_size // self.shards, a.conv_L_cache - 1, self.dtype)

    def new_cache(self, capacity: int, marks: int = 0) -> HybridCache:
        """A cache for `capacity` tokens plus one window; `marks` > 0 keeps conv states every `marks` tokens."""
        return HybridCache(self._shape, self.capacity_for(capacity), marks, self.stacked)

    def capacity_for(self, tokens: int) -> int:
        """A cache's capacity for a stream of at most `tokens`: where a whole forward's trace is keyed by its caches'
        shapes, one of a few sizes (at most a quarter over), so that streams of near limits share their traces."""
        return size_class(tokens) if self.whole is not None and not self.whole_spans else tokens

    def cache_bytes(self, tokens: int) -> int:
        shape = self._shape
        # while layers are tapped, a cache may stage every row it commits until its drafter takes them
        taps = (tokens + WINDOW_SLACK) * len(self._tapped) * self.hidden_size * self.dtype.size
        return shape.kv_bytes(self.capacity_for(tokens) + WINDOW_SLACK) + shape.conv_bytes() + taps

    def snapshot(self, cache: HybridCache) -> KeptState:
        """A standalone copy of the cache's committed state, restorable at its offset and its chunk marks."""
        return cache.snapshot()

    def state_bytes(self, state: KeptState) -> int:
        return state.nbytes

    def restore(self, state: KeptState, capacity: int, tokens: int | None = None, marks: int = 0) -> HybridCache:
        """A new cache holding the first `tokens` tokens of a kept state (one of `state.points`; default all)."""
        return HybridCache.restored(self._shape, state, state.tokens if tokens is None else tokens,
                                    self.capacity_for(capacity), marks, self.stacked)

    def forward(self, caches: Sequence[HybridCache], windows: Sequence[Sequence[int]],
                logit_rows: Sequence[int]) -> mx.array:
        ids = packed_ids(windows, self.vocab_size)
        return self.forward_ids(caches, ids, [len(window) for window in windows], logit_rows)

    def forward_ids(self, caches: Sequence[HybridCache], ids: mx.array, lengths: Sequence[int],
                    logit_rows: Sequence[int], commit: bool = False) -> mx.array:
        """forward on ids already packed in an mx.array (a drafter's lazy argmaxes); commit keeps every row, no eval."""
        spans, pick = pack_windows(caches, ids, lengths, logit_rows)
        h, outputs = self.model.embed_tokens(ids), {}
        positions = row_positions(spans) if self.roped else None
        if self.stacked:
            h = forward_streams(self, h, spans, positions, outputs)
        else:
            for i, (layer, slot) in enumerate(zip(self.model.layers, self._slots)):
                h = layer(h, spans, slot, positions)
                if i in self._tapped:
                    outputs[i] = h
        # the rows stay lazy: a row's taps are computed only if its cache commits it; a forward no window of which
        # is tapped never asks for them, so a prompt chunk needs its last layer only for the rows it keeps
        tapping = [(start, n, cache) for start, n, cache, _ in spans
                   if cache.offset + n > cache.taps_from] if self._tapped else []
        if tapping:
            tapped = tapped_rows(outputs, self._tapped)
            for start, n, cache in tapping:
                cache.tapped = tapped[start:start + n]
        close_windows(spans, commit)
        return picked_logits(h, pick, self.model.embedding_norm, self._head(), self.vocab_size)

    def keep(self, cache: HybridCache, rows: int) -> None:
        mx.eval(self.keep_later(cache, rows))  # cut the graph: a window whose rows gave no logits is computed here

    def keep_later(self, cache: HybridCache, rows: int) -> list[mx.array]:
        """keep() without waiting: the arrays that hold the commit, for the caller to evaluate with its next step."""
        check_keep(cache, rows)
        return cache.commit(rows)

    # -- taps (a TappedModel): the layers' rows a drafter reads, and the embedding and head it is bound to --

    def features(self, layers: Sequence[int]) -> None:
        """Keep the post-layer residual rows of `layers` for every committed row from now on; `[]` stops."""
        layers = tuple(int(layer) for layer in layers)
        wrong = [layer for layer in layers if not 0 <= layer < self.taps]
        if wrong or len(set(layers)) < len(layers):
            raise ValueError(f"taps {list(layers)}: expected distinct layer ids in 0..{self.taps - 1}")
        if layers and self._tapped and layers != self._tapped:
            raise ValueError(f"layers {list(self._tapped)} are tapped already; one drafter taps a model")
        self._tapped = layers

    def take_features(self, cache: HybridCache) -> TappedRows | None:
        return cache.take_taps()

    def window_features(self, cache: HybridCache) -> mx.array | None:
        """The open window's tapped rows before its commit (lazy; None where the window is not tapped)."""
        return cache.tapped

    def tap_from(self, cache: HybridCache, position: int) -> None:
        cache.taps_from = position

    def embed(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)

    def head(self, rows: mx.array) -> mx.array:
        return self._head()(rows).astype(mx.float32)

    def _head(self):
        if self.served_head is not None:
            return self.served_head
        return self.model.embed_tokens.as_linear if self.args.tie_word_embeddings else self.lm_head
