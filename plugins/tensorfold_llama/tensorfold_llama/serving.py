"""The llama family's row-path ops served through its kernel records, as its op table says."""

from __future__ import annotations

import os

from tensorfold_core.kernels import STACK_KV_ENV, STREAMS_ENV, records_served, unused
from tensorfold_core.row_kernels.modules import (WHOLE_ENV, RecordLinear, compile_halves, compiling, fused,
                                                 normed_fused, projection_op, residual_fused, rope_by_rows, swaps,
                                                 swiglu_fused, whole_forward_traces)
from tensorfold_core.row_kernels.step_arrays import pad_rows

from .kernels import records
from .ops import OPS

# where rope runs by rows, q and k are roped (and v copied) into their heads by one launch of the rope qkv record
# straight from the q|k|v launch's rows (the default where it serves); "0" slices and ropes them op by op, to measure
ROPE_QKV_ENV = "TENSORFOLD_ROPE_QKV"
# "1": where the norm folds into q|k|v and rope qkv serves, rope is stored by that launch too (neox pairs), a launch
# fewer a layer; not the default: slower on the H200 than the two launches so far (docs/performance.md)
ROPE_IN_ENV = "TENSORFOLD_ROPE_IN"


class RopedQKV:
    """q [rows, heads, head_dim], k and v [rows, kv_heads, head_dim] from the joined q|k|v rows, q and k roped at each
    row's own position: one launch of a rope qkv record, with the frequencies of the layer's rope (llama3 or linear
    scaling folded in), made once."""

    def __init__(self, attn, record, kind: str, dtype):
        from tensorfold_contract.serving import Prepared

        freqs = attn.rope.divisors()
        dims = {"heads": attn.n_heads, "kv_heads": attn.n_kv_heads, "head_dim": attn.head_dim,
                "dtype": str(dtype).removeprefix("mlx.core.")}
        self.launch = Prepared(kind, record.implementations[kind], dims, lambda: {"freqs": freqs}, "qkv")

    def __call__(self, qkv, positions):
        out = self.launch(qkv, positions=positions)
        return out["q"], out["k"], out["v"]


def roped_qkv(attn, usable: dict, kind: str, dtype) -> RopedQKV | None:
    """The one-launch rope of a layer whose q|k|v is one launch without biases, where the table serves it; None
    elsewhere, or where TENSORFOLD_ROPE_QKV=0 asks for the ops apart (a measurement)."""
    op = f"rope qkv {'interleaved' if attn.rope.traditional else 'neox'}"
    if op not in usable or attn.qkv is None or any(b is not None for b in attn.qkv.biases):
        return None
    if os.environ.get(ROPE_QKV_ENV, "1") == "0" or attn.rope.dims != attn.head_dim:
        return None
    return RopedQKV(attn, usable[op], kind, dtype)


class NormedRopedQKV:
    """q, k and v in their heads, q and k roped, straight from a layer's input rows: the input norm, the q|k|v GEMV and
    rope in one launch of the normed rope record, over the stacked q|k|v weights and the layer's rope frequencies."""

    def __init__(self, attn, norm, record, kind: str):
        from tensorfold_contract.serving import Prepared
        from tensorfold_core.row_kernels.gemv import OUT

        stacked, freqs = attn.qkv, attn.rope.divisors()
        dims = {"n": stacked.bounds[-1], "k": stacked.dims["k"], "eps": norm.eps, "out": OUT, "heads": attn.n_heads,
                "kv_heads": attn.n_kv_heads, "head_dim": attn.head_dim, "dtype": OUT}
        self.launch = Prepared(kind, record.implementations[kind], dims,
                               lambda: {"w": stacked.arrays["w"], "nw": norm.weight, "freqs": freqs}, "x")

    def __call__(self, x, positions):
        out = self.launch(x, positions=positions)
        return out["yq"], out["yk"], out["yv"]


def normed_roped_qkv(layer, usable: dict, kind: str) -> NormedRopedQKV | None:
    """The one launch of a layer's norm, q|k|v and rope where TENSORFOLD_ROPE_IN=1 asks it, its norm already folds
    into q|k|v, its rope has neox pairs and the table serves it; None elsewhere (rope its own launch)."""
    op, attn = "projection bf16 rmsnorm rope neox", layer.self_attn
    if layer.normed_qkv is None or attn.rope_qkv is None or attn.rope.traditional or op not in usable:
        return None
    if os.environ.get(ROPE_IN_ENV, "0") != "1":
        return None
    norm = layer.input_layernorm
    return NormedRopedQKV(attn, getattr(norm, "inner", norm), usable[op], kind)


def serve_kernels(model, compiled: bool = True) -> dict:
    """Swap the model's row-path modules for the table's records on this backend; what serves each op (`compiled`:
    False on a group's rank, whose layers record their sums as they run, which a compiled replay would not)."""
    usable, kind, labels = records_served(OPS, records)
    blocks = model.model
    linear, norm = swaps(usable, kind, model.dtype)

    attend = None
    if "attention" in usable:
        from .kernels.attention import WINDOW_ATTENTION

        attend = WINDOW_ATTENTION[kind]
    for layer in blocks.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.attend = attend
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, linear(getattr(attn, name)))
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, linear(getattr(mlp, name)))
        # projections of the same rows in one launch: fewer launches, the same bits
        object.__setattr__(attn, "qkv", fused([attn.q_proj, attn.k_proj, attn.v_proj], usable, kind, model.dtype))
        object.__setattr__(mlp, "gate_up", fused([mlp.gate_proj, mlp.up_proj], usable, kind, model.dtype))
        layer.input_layernorm = norm(layer.input_layernorm)
        layer.post_attention_layernorm = norm(layer.post_attention_layernorm)
    blocks.norm = norm(blocks.norm)
    if model.args.tie_word_embeddings:
        embed = blocks.embed_tokens
        op = projection_op(embed, model.dtype)  # a quantized embedding's codes serve as a 4/8-bit head
        if op in usable:  # the embedding's weight read as a projection; kept out of the module tree (no twin)
            object.__setattr__(model, "served_head", RecordLinear(embed, usable[op], kind))
    else:
        model.lm_head = linear(model.lm_head)
    if compiled and compiling(usable, kind):
        for layer in blocks.layers:  # one machine's whole sums only: a group's rank adds the residual after its sum
            attn, mlp = layer.self_attn, layer.mlp
            object.__setattr__(attn, "o_residual", residual_fused(attn.o_proj, usable, kind, model.dtype,
                                                                  "projection bf16 residual"))
            swiglu = swiglu_fused(mlp.gate_up, usable, kind)
            down = None if swiglu is None else residual_fused(mlp.down_proj, usable, kind, model.dtype,
                                                              "projection bf16 residual")
            if down is not None:  # swiglu stored by gate|up, down_proj adding the residual
                object.__setattr__(mlp, "swiglu", swiglu)
                object.__setattr__(mlp, "down_residual", down)
            elif mlp.gate_up is not None and not any(b is not None for b in mlp.gate_up.biases):
                object.__setattr__(mlp, "down_residual", residual_fused(
                    mlp.down_proj, usable, kind, model.dtype, "projection bf16 swiglu residual"))
        # rope in the compiled first part: where the attention record serves, and on the CPU, where MLX's SDPA reads
        # the window's roped keys from the cache (one fused rope for every stream's rows instead of a rope a stream)
        if rope_by_rows(usable, kind, record_attends=attend is not None):
            for layer in blocks.layers:
                object.__setattr__(layer, "halves", (layer.before_roped, layer.after))
                layer.self_attn.roped = True
                object.__setattr__(layer.self_attn, "rope_qkv", roped_qkv(layer.self_attn, usable, kind, model.dtype))
            if "attention streams" in usable and os.environ.get(STREAMS_ENV, "1") != "0":
                from .kernels.attention import STREAMS_ATTENTION

                for layer in blocks.layers:
                    layer.self_attn.attend_streams = STREAMS_ATTENTION[kind]
                model.stacked = True
                if "stack kv" in usable and os.environ.get(STACK_KV_ENV, "1") != "0":
                    from tensorfold_core.row_kernels.stack import STACKS

                    model.stack_kv = STACKS[kind]
                if os.environ.get(WHOLE_ENV, "1") != "0":
                    model.whole = whole_forward_traces()
                    model.whole_spans = kind == "mlx"  # MLX's composed attention slices caches at their offsets
                    model.pad_rows = pad_rows(model.whole_spans)
        for layer in blocks.layers:  # each norm read by the one launch after it: a launch fewer each
            attn, mlp = layer.self_attn, layer.mlp
            if attn.rope_qkv is not None:
                object.__setattr__(layer, "normed_qkv", normed_fused(attn.qkv, layer.input_layernorm, usable, kind,
                                                                     swiglu=False))
                object.__setattr__(layer, "normed_roped_qkv", normed_roped_qkv(layer, usable, kind))
            if mlp.swiglu is not None:
                object.__setattr__(layer, "normed_swiglu", normed_fused(
                    mlp.gate_up, layer.post_attention_layernorm, usable, kind, swiglu=True))
        compile_halves(blocks.layers, usable, kind)
    if not model.stacked:
        unused(labels, ("attention streams", "stack kv"), STREAMS_ENV)
    elif model.stack_kv is None:
        unused(labels, ("stack kv",), STACK_KV_ENV)
    return labels
