"""The lfm2 families' row-path ops served through their kernel records, as their op table says."""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tensorfold_contract.helpers import kept_array

from tensorfold_core.families import swiglu
from tensorfold_core.kernels import STACK_KV_ENV, STREAMS_ENV, records_served, unused
from tensorfold_core.row_kernels.modules import (WHOLE_ENV, RecordLinear, Served, compile_halves, compiling, fused,
                                                 normed_fused, projection_op, residual_fused, rope_by_rows, swap_tree,
                                                 swaps, swiglu_fused, whole_forward_traces)

from .kernels import records
from .streams import CONV_SPANS_ENV
from .ops import OPS


class ExpertMatrix(nn.Module):
    """One expert's matrix of a stacked switch projection (a view: no copy), served as a projection of its own."""

    def __init__(self, stacked: nn.Module, expert: int):
        super().__init__()
        for name in ("weight", "scales", "biases"):
            if name in stacked:
                setattr(self, name, stacked[name][expert])
        if "scales" in stacked:
            self.bits, self.group_size, self.mode = stacked.bits, stacked.group_size, stacked.mode
        # made now, on the loading thread's stream: a lazy view first met by the engine's thread (an expert first
        # picked there) has no stream in that thread
        mx.eval(self.parameters())

    def __call__(self, x: mx.array) -> mx.array:
        """x @ W.T by MLX's own ops: where no record serves this projection's op (float32 rows on the CPU)."""
        if "scales" in self:
            return mx.quantized_matmul(x, self["weight"], self["scales"], self.get("biases"), transpose=True,
                                       group_size=self.group_size, bits=self.bits, mode=self.mode)
        return x @ self["weight"].T


class ServedConv:
    """The short conv's window through the stream conv record: each row from its stream's committed tail, and the
    tail each row leaves (what keep() commits). One prepared launch per dtype: a call is the kernel's launch alone."""

    def __init__(self, conv: nn.Conv1d, record, kind: str):
        from tensorfold_contract.serving import Prepared

        channels, taps, _ = conv.weight.shape
        dims = {"channels": channels, "L": taps, "bias": "bias" in conv}
        fixed = lambda: {"w": conv.weight.reshape(channels, taps), **({"bias": conv.bias} if dims["bias"] else {})}
        launches: dict = {}  # rows' dtype -> its prepared launch

        def run(tail: mx.array, rows: mx.array) -> tuple[mx.array, mx.array]:
            """(y, states) of the window's rows after `tail` [1, L-1, channels]."""
            launch = launches.get(rows.dtype)
            if launch is None:
                dtype = str(rows.dtype).removeprefix("mlx.core.")
                launch = launches[rows.dtype] = Prepared(kind, record.implementations[kind], {**dims, "dtype": dtype},
                                                         fixed, "bx", per_call=("tails",))
            out = launch(rows, tails=tail[0])
            return out["y"], out["states"]

        self.run = run


class ServedMoe(Served):
    """A sparse MoE block through the records: the router's gate as a projection, the router record's top-k, each
    picked expert's matrices as projections over the rows that picked it, then each row's picks weighed and added
    best first. The GEMV records are row-invariant, so an expert's output for a row is the same bits whichever
    rows share its call; an expert no row picked is never read (a row reads top_k of the experts' weights). A rank of
    a group runs every expert over every row instead (`gather=False`): reading the picks would evaluate the
    forward's sums mid-graph, where the group evaluates them one collective at a time, in order."""

    def __init__(self, inner: nn.Module, record, kind: str, projection, gather: bool = True):
        from tensorfold_contract.serving import ServedCall, call

        super().__init__()
        self.inner = inner
        switch = inner.switch_mlp
        experts = switch.gate_proj.weight.shape[0]
        served = {name: [projection(ExpertMatrix(getattr(switch, name), e)) for e in range(experts)]
                  for name in ("gate_proj", "up_proj", "down_proj")}
        dims = {"experts": experts, "top_k": inner.top_k, "norm": inner.norm_topk_prob,
                "scale": inner.routed_scaling_factor, "bias": "expert_bias" in inner}
        scale = kept_array([inner.routed_scaling_factor], "float32")

        def route(logits: mx.array) -> tuple[mx.array, mx.array]:
            arrays = {"logits": logits, "scale": scale}
            if dims["bias"]:
                arrays["bias"] = inner.expert_bias
            d = {**dims, "dtype": str(logits.dtype).removeprefix("mlx.core.")}
            out = call(kind, record.implementations[kind], ServedCall(logits.shape[0], d, arrays))
            return out["indices"], out["weights"]

        object.__setattr__(self, "served_gate", projection(inner.gate))
        object.__setattr__(self, "served_experts", served)
        object.__setattr__(self, "route", route)
        object.__setattr__(self, "gather", gather)

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[0] == 0:
            return mx.zeros_like(x)
        experts, weights = self.route(self.served_gate(x))
        each, at = self._gathered(x, experts) if self.gather else self._every_expert(x, experts)
        out = None
        for j in range(weights.shape[-1]):  # best first, one add a pick: a fixed order for every row
            term = each[at[:, j]] * weights[:, j:j + 1]
            out = term if out is None else out + term
        return out

    def _expert(self, e: int, x: mx.array) -> mx.array:
        p = self.served_experts
        return p["down_proj"][e](swiglu(p["gate_proj"][e](x), p["up_proj"][e](x)))

    def _gathered(self, x: mx.array, experts: mx.array) -> tuple[mx.array, mx.array]:
        """Each picked expert over the rows that picked it: (their outputs, stacked; where each (row, pick) finds
        its own among them)."""
        picks = np.array(experts)  # the host learns which experts to run: the one sync of the block
        outs, at, start = [], np.zeros(picks.shape, np.int32), 0
        for e in np.unique(picks):
            rows = np.flatnonzero((picks == e).any(axis=1))
            outs.append(self._expert(int(e), x[mx.array(rows)] if len(rows) < x.shape[0] else x))
            hit = picks == e
            at[hit] = start + np.searchsorted(rows, np.nonzero(hit)[0])
            start += len(rows)
        return (outs[0] if len(outs) == 1 else mx.concatenate(outs)), mx.array(at)

    def _every_expert(self, x: mx.array, experts: mx.array) -> tuple[mx.array, mx.array]:
        """Every expert over every row, with no host read: (their outputs, expert-major; where each (row, pick)
        finds its own)."""
        rows = x.shape[0]
        each = mx.concatenate([self._expert(e, x) for e in range(len(self.served_experts["down_proj"]))])
        return each, experts.astype(mx.int32) * rows + mx.arange(rows, dtype=mx.int32)[:, None]


def serve_kernels(model, gather: bool = True) -> dict:
    """Swap the model's row-path modules for the table's records on this backend; what serves each op (`gather`:
    MoE experts over the rows that picked them; False on a group's rank, see ServedMoe, whose layers record their sums
    as they run, so nothing there is compiled)."""
    from .lfm2_moe import SparseMoeBlock

    usable, kind, labels = records_served(OPS, records)
    projection, norm = swaps(usable, kind, model.dtype)
    if "attention" in usable:
        from tensorfold_core.row_kernels.attention import WINDOW_ATTENTION

        attend = WINDOW_ATTENTION[kind]
    for layer in model.model.layers:
        if layer.is_attention_layer and "attention" in usable:
            layer.self_attn.attend = attend
        if not layer.is_attention_layer and "short conv" in usable:
            layer.conv.served = ServedConv(layer.conv.conv, usable["short conv"], kind)
        if isinstance(layer.feed_forward, SparseMoeBlock) and "moe router" in usable:
            layer.feed_forward = ServedMoe(layer.feed_forward, usable["moe router"], kind, projection, gather)
            # its forward waits on the host mid-graph, so no round runs ahead of the host (lanes/ahead.py)
            model.reads_on_host = gather
    swap_tree(model, projection, norm)
    if model.args.tie_word_embeddings:
        embed = model.model.embed_tokens
        op = projection_op(embed, model.dtype)
        if op in usable:  # the embedding's weight read as a projection; kept out of the module tree (no twin)
            object.__setattr__(model, "served_head", RecordLinear(embed, usable[op], kind))
    if gather:  # an MoE block reads its picks on the host: the part of a layer that holds one runs op by op
        if compiling(usable, kind):  # one machine's whole sums only: a group's rank adds the residual after its sum
            fuse_launches(model, usable, kind)
        if rope_by_rows(usable, kind, record_attends="attention" in usable):  # the CPU, and where the record attends
            rope_rows(model)
            if "attention" in usable:
                serve_streams(model, usable, kind)
        compile_halves(model.model.layers, usable, kind,
                       lambda layer: (True, not isinstance(layer.feed_forward, (ServedMoe, SparseMoeBlock))))
    if not model.stacked:
        unused(labels, ("attention streams", "conv streams", "stack kv"), STREAMS_ENV)
    elif model.stack_kv is None:
        unused(labels, ("stack kv",), STACK_KV_ENV)
    return labels


def fuse_launches(model, usable: dict, kind: str) -> None:
    """Each layer's launches joined where the table serves the fused records (bf16, no biases): the operator norm
    read by in_proj or q|k|v in one launch, out_proj and the MLP's down projection adding the residual, the ffn norm
    read by gate|up storing swiglu; each a launch or two fewer, every row's sums in the plain GEMV's order."""
    residual = lambda projection: residual_fused(projection, usable, kind, model.dtype, "projection bf16 residual")
    for layer in model.model.layers:
        op = layer.op
        object.__setattr__(op, "out_residual", residual(op.out_proj))
        parts = [op.q_proj, op.k_proj, op.v_proj] if layer.is_attention_layer else [op.in_proj]
        stacked = fused(parts, usable, kind, model.dtype)
        object.__setattr__(layer, "normed_in", normed_fused(stacked, layer.operator_norm, usable, kind, swiglu=False))
        ff = layer.feed_forward
        names = next((n for n in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")) if n[0] in ff), None)
        if names is None:  # an MoE block: its experts are served apart (ServedMoe)
            continue
        gate_up = fused([ff[names[0]], ff[names[1]]], usable, kind, model.dtype)
        swiglu = swiglu_fused(gate_up, usable, kind)
        down = None if swiglu is None else residual(ff[names[2]])
        if down is not None:  # swiglu stored by gate|up, the down projection adding the residual
            object.__setattr__(ff, "swiglu", swiglu)
            object.__setattr__(ff, "down_residual", down)
            object.__setattr__(layer, "normed_swiglu", normed_fused(gate_up, layer.ffn_norm, usable, kind,
                                                                    swiglu=True))


def serve_streams(model, usable: dict, kind: str) -> None:
    """Every stream of a forward in one launch a layer where the streams records serve (streams.py): the caches
    stacked, their windows stored after the last layer, and the layers compiled whole where no block reads on the host
    mid-forward. As llama's switches say: TENSORFOLD_STREAM_ATTENTION=0 a stream a launch, TENSORFOLD_STACK_KV=0 the
    keys stacked by MLX's ops, TENSORFOLD_WHOLE_FORWARD=0 the layers called from Python, TENSORFOLD_WHOLE_CONV_SPANS=1
    a trace for each mix of the streams' window sizes, not only for each row count (measurements)."""
    layers = model.model.layers
    kinds = {layer.is_attention_layer for layer in layers}
    wanted = {"attention streams", "conv streams"} <= usable.keys() and os.environ.get(STREAMS_ENV, "1") != "0"
    if not wanted or kinds != {True, False}:
        return
    from tensorfold_core.row_kernels.attention_streams import STREAMS_ATTENTION
    from tensorfold_core.row_kernels.stack import STACKS
    from tensorfold_core.row_kernels.step_arrays import pad_rows

    from .kernels.conv_streams import STREAMS_CONV

    for layer in layers:
        if layer.is_attention_layer:
            layer.self_attn.attend_streams = STREAMS_ATTENTION[kind]
        else:
            object.__setattr__(layer.conv, "streams", streams_conv(layer.conv.conv, STREAMS_CONV[kind]))
    model.stacked = True
    if "stack kv" in usable and os.environ.get(STACK_KV_ENV, "1") != "0":
        model.stack_kv = STACKS[kind]
    if not model.reads_on_host and os.environ.get(WHOLE_ENV, "1") != "0":
        model.whole = whole_forward_traces()
        model.whole_spans = kind == "mlx"  # MLX's composed attention slices caches at their offsets
        # a key of every stream's window sizes met each drafted round's depths anew, so the round ran untraced
        model.whole_conv_spans = model.whole_spans or os.environ.get(CONV_SPANS_ENV, "0") == "1"
        model.pad_rows = pad_rows(model.whole_conv_spans)


def streams_conv(conv: nn.Conv1d, launch):
    """A conv layer's call of the streams conv record: (gated rows, the forward's ConvStreams, the layer's slot) ->
    (convolved rows, the tail each row leaves), over the layer's current weights."""
    channels, taps, _ = conv.weight.shape

    def run(gated: mx.array, convs, slot: int) -> tuple[mx.array, mx.array]:
        tails, spans, rowmap = convs
        return launch(gated, tails, slot, spans, rowmap, conv.weight.reshape(channels, taps),
                      conv.bias if "bias" in conv else None)

    return run


def rope_rows(model) -> None:
    """q and k roped in each attention layer's compiled first part, a position a row: one fused rope for every
    stream's rows where a rope a stream cost two launches a layer a stream (on the CPU MLX's composed rope, some 30
    ops), the same bits; the window attention record then reads the roped keys from the cache as it did."""
    model.roped = True
    for layer in model.model.layers:
        if layer.is_attention_layer:
            layer.self_attn.roped = True
            object.__setattr__(layer, "halves", (layer.before_roped, layer.after))
