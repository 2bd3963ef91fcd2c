"""The DSpark drafter's architecture: config from the published layout, context from taps, block layers, two heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn

from tensorfold_core.errors import CheckpointError
from tensorfold_core.families import ConfigArgs, swiglu


@dataclass
class ModelArgs(ConfigArgs):
    model_type: str  # the backbone's (qwen3): no family serves it, which makes the checkpoint drafter-only
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    dflash_config: dict
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_parameters: dict | None = None  # transformers 5: rope_theta and the rope type in one dict
    rope_is_neox_style: bool = False  # the published LFM2 drafter rotates interleaved pairs
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None
    block_size: int | None = None  # older configs keep these beside dflash_config rather than in it
    num_target_layers: int | None = None

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        rope = dict(self.rope_parameters or {})
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        self.rope_type = rope.get("rope_type") or rope.get("type") or "default"
        dflash = self.dflash_config if isinstance(self.dflash_config, dict) else {}
        self.mask_token_id = dflash.get("mask_token_id")
        self.target_layer_ids = dflash.get("target_layer_ids")
        self.num_target_layers = dflash.get("num_target_layers", self.num_target_layers)
        self.block_size = dflash.get("block_size", self.block_size)
        self.markov_rank = dflash.get("markov_rank", 256)
        self.markov_head_type = dflash.get("markov_head_type", "vanilla")
        self.confidence = bool(dflash.get("enable_confidence_head", False))
        self.confidence_with_markov = bool(dflash.get("confidence_head_with_markov", True))
        self.causal = bool(dflash.get("causal", False))

    def check(self, source: str) -> None:
        if not isinstance(self.dflash_config, dict):
            raise CheckpointError(f"{source}: dflash_config must be an object, got {self.dflash_config!r}")
        needed = {"dflash_config.mask_token_id": self.mask_token_id,
                  "dflash_config.target_layer_ids": self.target_layer_ids,
                  "dflash_config.num_target_layers": self.num_target_layers, "block_size": self.block_size}
        missing = [key for key, value in needed.items() if value is None]
        if missing:
            raise CheckpointError(f"{source}: missing {', '.join(missing)}")
        ids, layers = self.target_layer_ids, self.num_target_layers
        if (not isinstance(ids, list) or not ids or any(not isinstance(i, int) for i in ids)
                or ids != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < layers):
            raise CheckpointError(f"{source}: dflash_config.target_layer_ids {ids!r} must be increasing layer ids "
                                  f"in 0..{layers - 1} (dflash_config.num_target_layers {layers})")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise CheckpointError(f"{source}: block_size {self.block_size!r} must be a positive count of drafts")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise CheckpointError(f"{source}: dflash_config.mask_token_id {self.mask_token_id!r} is not a token id "
                                  f"below vocab_size {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(f"{source}: {self.num_attention_heads} attention heads are not a multiple of "
                                  f"{self.num_key_value_heads} key/value heads")
        if self.hidden_act != "silu":
            raise CheckpointError(f"{source}: hidden_act {self.hidden_act!r} is not supported (DSpark uses silu)")
        if self.markov_head_type != "vanilla":
            raise CheckpointError(f"{source}: dflash_config.markov_head_type {self.markov_head_type!r} is not "
                                  "supported (vanilla: logits + W2 W1[previous token])")
        if self.causal:
            raise CheckpointError(f"{source}: dflash_config.causal is true; the DSpark block attends its rows "
                                  "both ways (non-causal)")
        if any(kind != "full_attention" for kind in self.layer_types or []):
            raise CheckpointError(f"{source}: layer_types {self.layer_types!r}: only full_attention layers are read")
        if self.rope_type != "default":
            raise CheckpointError(f"{source}: rope type {self.rope_type!r} is not supported by the dspark drafter")


class Span(NamedTuple):
    """Context rows start..start+n of a packed absorb, at absolute positions offset.. of their stream."""

    start: int
    n: int
    offset: int


class Block(NamedTuple):
    """One stream's block in the packed rows: rows start..start+n at absolute positions offset.., and its lane."""

    start: int
    n: int
    offset: int
    lane: "ContextKV"


class AheadBlock(NamedTuple):
    """A block queued before the host read its verify: its rows' positions and its context's length are device
    values; the lane's rows are read up to a host bound, past the length masked."""

    start: int
    n: int
    positions: mx.array  # [n] int32: the absolute position of each row
    lane: "ContextKV"
    length: mx.array  # the context rows the block attends (int32 scalar), at most `bound`
    bound: int


class ContextKV(Protocol):
    """What a block attends besides itself: each layer's context keys (rotated) and values, `n` rows of them."""

    keys: list[mx.array]  # per layer [1, kv_heads, >= n, head_dim]
    values: list[mx.array]
    n: int


def row_positions(spans: Sequence[Span | Block]) -> mx.array:
    """Each packed row's absolute position: a span's rows sit at offset.. of their stream."""
    return mx.array([p for _, n, offset, *_ in spans for p in range(offset, offset + n)], mx.int32)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, bias = args.hidden_size, args.attention_bias
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim ** -0.5
        self.traditional = not args.rope_is_neox_style
        self.rope_theta = args.rope_theta
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        # the block attention record's implementation where the drafter's table serves it (serving.py): q [rows,
        # heads, head_dim] over the lane's whole buffer and the block's own keys, float32 out; None: MLX's SDPA
        self.attend = None
        # the streams record's where it serves (serving.py): every block of a hold in one launch (8 a launch), its
        # rows roped by one call; None: a launch a block
        self.attend_streams = None

    def rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(x, self.head_dim, traditional=self.traditional, base=self.rope_theta, scale=1.0,
                            offset=offset)

    def rope_rows(self, x: mx.array, positions: mx.array) -> mx.array:
        """Packed rows [rows, heads, head_dim] roped each at its own position: one rope for every span's rows where
        MLX composes a rope of ~30 ops a call (the same bits as each span's rope at its offset)."""
        return self.rope(x[:, :, None], positions).reshape(x.shape)

    def keys_values(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Normed keys and values of packed rows [rows, kv_heads, head_dim] (row-wise, so packing is free)."""
        rows = x.shape[0]
        return (self.k_norm(self.k_proj(x).reshape(rows, self.n_kv_heads, -1)),
                self.v_proj(x).reshape(rows, self.n_kv_heads, -1))

    def context(self, c: mx.array, spans: Sequence[Span]) -> list[tuple[mx.array, mx.array]]:
        """Per span of packed context rows: keys rotated at its absolute positions, and values [1, kv, n, dim]."""
        keys, values = self.keys_values(c)
        if self.attend is None or self.attend_streams is not None:  # every span's keys roped in one call
            keys = self.rope_rows(keys, row_positions(spans))
        out = []
        for start, n, offset in spans:
            k, v = (a[start:start + n][None].transpose(0, 2, 1, 3) for a in (keys, values))
            out.append((k if self.attend is None or self.attend_streams is not None else self.rope(k, offset), v))
        return out

    def __call__(self, x: mx.array, blocks: Sequence[Block], layer: int,
                 streams: "HoldStreams | None" = None) -> mx.array:
        rows = x.shape[0]
        queries = self.q_norm(self.q_proj(x).reshape(rows, self.n_heads, -1))
        keys, values = self.keys_values(x)
        if streams is not None:
            return self.o_proj(self.mix_streams(queries, keys, values, streams, layer).astype(x.dtype))
        if isinstance(blocks[0], AheadBlock):
            return self.o_proj(self.masked_blocks(queries, keys, values, blocks, layer))
        if self.attend is None:  # MLX's ops: every block's rows roped in one call
            positions = row_positions(blocks)
            queries, keys = self.rope_rows(queries, positions), self.rope_rows(keys, positions)
        outs = []
        for start, n, offset, lane in blocks:  # projections are packed; attention runs per block on its context
            q, k, v = (a[start:start + n][None].transpose(0, 2, 1, 3) for a in (queries, keys, values))
            if self.attend is not None:
                q, k = self.rope(q, offset), self.rope(k, offset)
                o = self.attend(q[0].transpose(1, 0, 2), lane.keys[layer], lane.values[layer], lane.n, k, v,
                                self.scale)
                outs.append(o.reshape(n, -1).astype(x.dtype))
                continue
            o = block_attention(q, lane.keys[layer], lane.values[layer], lane.n, k, v, self.scale)
            outs.append(o.transpose(0, 2, 1, 3).reshape(n, -1))
        return self.o_proj(outs[0] if len(outs) == 1 else mx.concatenate(outs))


    def masked_blocks(self, queries: mx.array, keys: mx.array, values: mx.array, blocks: Sequence[AheadBlock],
                      layer: int) -> mx.array:
        """Queued blocks over their lanes' contexts of device lengths (MLX's ops with a mask): [rows, heads * dim]."""
        positions = blocks[0].positions if len(blocks) == 1 else mx.concatenate([b.positions for b in blocks])
        queries, keys = self.rope_rows(queries, positions), self.rope_rows(keys, positions)
        outs = []
        for b in blocks:
            q, k, v = (a[b.start:b.start + b.n][None].transpose(0, 2, 1, 3) for a in (queries, keys, values))
            o = masked_block_attention(q, b.lane.keys[layer], b.lane.values[layer], b.bound, b.length, k, v,
                                       self.scale)
            outs.append(o.transpose(0, 2, 1, 3).reshape(b.n, -1))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)

    def mix_streams(self, queries: mx.array, keys: mx.array, values: mx.array, streams: "HoldStreams",
                    layer: int) -> mx.array:
        """Every block's rows over its lane's context and its whole block, a launch for each group of up to 8
        blocks; float32 [rows, heads * head_dim]."""
        positions, groups = streams
        queries, keys = self.rope_rows(queries, positions), self.rope_rows(keys, positions)
        outs = []
        for lo, hi, spec, rowmap, lanes in groups:
            part = slice(lo, hi)
            q, k, v = (queries, keys, values) if len(groups) == 1 else (queries[part], keys[part], values[part])
            outs.append(self.attend_streams(q, [lane.keys[layer] for lane in lanes],
                                            [lane.values[layer] for lane in lanes], spec, rowmap, k, v, self.scale))
        mixed = outs[0] if len(outs) == 1 else mx.concatenate(outs)
        return mixed.reshape(queries.shape[0], -1)


HoldStreams = tuple  # (the block rows' positions, groups of (first row, row past the last, spec, row map, lanes))


def hold_streams(blocks: Sequence[Block], rowmap_of) -> HoldStreams:
    """What each layer's streams attention reads, made once a hold: the rows' positions (device ops) and the blocks
    in groups of 8, each with its spec (start, rows, context length, block size) and row map."""
    from tensorfold_core.row_kernels.attention_sources import STREAM_SLOTS
    from tensorfold_core.row_kernels.step_arrays import arange_positions

    groups = []
    for g in range(0, len(blocks), STREAM_SLOTS):
        part = blocks[g:g + STREAM_SLOTS]
        lo = part[0].start
        spec = tuple((b.start - lo, b.n, b.lane.n, b.n) for b in part)
        groups.append((lo, part[-1].start + part[-1].n, spec, rowmap_of(spec), [b.lane for b in part]))
    return arange_positions([(b.offset, b.n) for b in blocks]), groups


def ahead_streams(blocks: Sequence[AheadBlock]) -> HoldStreams:
    """`hold_streams` for queued blocks: each row map's n is its block's device length, which the streams kernels
    read from the row map (the spec's n, the host's bound, only checks that the lanes' buffers hold it)."""
    from tensorfold_core.row_kernels.attention_sources import STREAM_SLOTS

    groups = []
    for g in range(0, len(blocks), STREAM_SLOTS):
        part = blocks[g:g + STREAM_SLOTS]
        lo, rows, key = part[0].start, [], 0
        for slot, b in enumerate(part):
            row = mx.stack([mx.array(slot, mx.int32), b.length.astype(mx.int32), mx.array(key, mx.int32),
                            mx.array(b.n, mx.int32)])
            rows.append(mx.broadcast_to(row[None], (b.n, row.shape[0])))
            key += b.n
        spec = tuple((b.start - lo, b.n, b.bound, b.n) for b in part)
        groups.append((lo, part[-1].start + part[-1].n, spec, mx.concatenate(rows), [b.lane for b in part]))
    positions = blocks[0].positions if len(blocks) == 1 else mx.concatenate([b.positions for b in blocks])
    return positions, groups


def block_attention(q: mx.array, context_keys: mx.array, context_values: mx.array, n: int, block_keys: mx.array,
                    block_values: mx.array, scale: float) -> mx.array:
    """A block's rows [1, heads, B, dim] over the lane's first n context keys and the block's own keys, with no mask:
    every block row sees the whole context and every row of its block, its later rows too (the kernel record
    `dspark block attention` proves this call)."""
    k = mx.concatenate([context_keys[..., :n, :], block_keys], axis=2)
    v = mx.concatenate([context_values[..., :n, :], block_values], axis=2)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)


def masked_block_attention(q: mx.array, context_keys: mx.array, context_values: mx.array, bound: int,
                           length: mx.array, block_keys: mx.array, block_values: mx.array, scale: float) -> mx.array:
    """`block_attention` over a context whose length is a device value: the lane's first `bound` rows are read and
    those from `length` on masked, so the queue needs no host read of the verify."""
    k = mx.concatenate([context_keys[..., :bound, :], block_keys], axis=2)
    v = mx.concatenate([context_values[..., :bound, :], block_values], axis=2)
    visible = mx.concatenate([mx.arange(bound) < length, mx.ones((block_keys.shape[2],), mx.bool_)])
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=visible[None, None, None, :])


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, blocks: Sequence[Block], layer: int,
                 streams: HoldStreams | None = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), blocks, layer, streams)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """A low-rank bigram correction: each draft row's logits gain W2 W1[the token before it]."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)

    def __call__(self, previous: mx.array) -> mx.array:
        """W2 W1[previous]: float32 logits to add to the rows that follow those tokens."""
        return self.markov_w2(self.markov_w1(previous)).astype(mx.float32)


def markov_pick(logits: mx.array, head: MarkovHead, previous: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's draft after its `previous` token: the first largest of logits + W2 W1[previous] (ties to the
    lowest id, a NaN never wins), and whether the row held a NaN score (the kernel record `dspark markov pick`)."""
    scores = logits + head(previous)
    nan = mx.isnan(scores)
    return mx.argmax(mx.where(nan, -mx.inf, scores), axis=-1), mx.any(nan, axis=-1)


class ConfidenceHead(nn.Module):
    """One logit per draft row from its final row (and W1 of the token before it): sigmoid(logit + bias)."""

    def __init__(self, inputs: int):
        super().__init__()
        self.proj = nn.Linear(inputs, 1, bias=True)


class Model(nn.Module):
    """A DSpark drafter: no embedding or head of its own; the target's are bound by the drafter that runs it."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [DecoderLayer(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.markov_head = MarkovHead(args.vocab_size, args.markov_rank)
        # where every block of a hold attends in one launch a layer (serving.py): what makes a group's row map
        object.__setattr__(self, "streams_rowmap", None)
        # whether that launch reads each lane's n from the row map (cuda, metal), so a queued block's device length
        # serves there; MLX's composed call reads the host's spec, so queued blocks take the masked ops instead
        object.__setattr__(self, "rowmap_lengths", False)
        if args.confidence:
            width = args.hidden_size + (args.markov_rank if args.confidence_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Published names onto the modules: a leading `model.` dropped (some exports keep it)."""
        out = {}
        for name, w in weights.items():
            key = name.removeprefix("model.")
            if key in out:
                raise CheckpointError(f"tensors {key!r} and 'model.{key}' name one parameter twice")
            out[key] = w
        return out

    def context_rows(self, tapped: mx.array) -> mx.array:
        """fc and hidden_norm: tapped target rows [n, taps * hidden] to the context every layer reads [n, hidden]."""
        return self.hidden_norm(self.fc(tapped))

    def context(self, c: mx.array, spans: Sequence[Span]) -> list[list[tuple[mx.array, mx.array]]]:
        """Each layer's keys and values of each span of context rows (rows start.. at positions offset..)."""
        return [layer.self_attn.context(c, spans) for layer in self.layers]

    def blocks(self, h: mx.array, blocks: Sequence[Block]) -> mx.array:
        """The layers over packed block rows, each block attending its own lane's context; the final norm."""
        streams = None
        if isinstance(blocks[0], AheadBlock):  # device lengths: the streams kernels where they read them, else masked
            streams = ahead_streams(blocks) if self.streams_rowmap is not None and self.rowmap_lengths else None
        elif self.streams_rowmap is not None and len(blocks) > 1:  # where the streams record serves (serving.py); one
            # block keeps its own launch, which reads no row map made on the host
            streams = hold_streams(blocks, self.streams_rowmap)
        for i, layer in enumerate(self.layers):
            h = layer(h, blocks, i, streams)
        return self.norm(h)

    def confidence(self, rows: mx.array, previous: mx.array) -> mx.array | None:
        """sigmoid(logit + bias) per draft row: how likely the draft there is the target's (None: no head)."""
        if "confidence_head" not in self:
            return None
        if rows.size == 0:  # MLX 0.32.4's CUDA matmul of no rows dies of SIGFPE (the record's empty edge found it)
            return mx.zeros(rows.shape[:-1], mx.float32)
        features = rows
        if self.args.confidence_with_markov:
            features = mx.concatenate([rows, self.markov_head.markov_w1(previous).astype(rows.dtype)], axis=-1)
        return mx.sigmoid(self.confidence_head.proj(features)[..., 0].astype(mx.float32))
