"""The llama family's op table, and the modules that serve its row-path ops through its kernel records."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from tensorfold_core.kernels import BUILTIN, RECORDS_KIND, backend, served

from .ops import OPS

GEMV_ROWS = 16  # the most rows one call of the GEMV records takes: wider calls go in blocks of 16 rows


def _records() -> dict:
    from .kernels import records

    return {record.name: record for record in records()}


def projection_op(module: nn.Module, activations: mx.Dtype) -> str | None:
    """The table's op for a projection (None: no record serves it): the GEMV records take bf16 activations, and
    bf16 weights or 4/8-bit affine codes with bf16 scales."""
    if activations != mx.bfloat16:
        return None
    if isinstance(module, nn.QuantizedLinear):
        affine = module.bits in (4, 8) and module.mode == "affine" and module.scales.dtype == mx.bfloat16
        return f"projection q{module.bits}" if affine else None
    return "projection bf16" if module.weight.dtype == mx.bfloat16 else None


class Served(nn.Module):
    """A module whose call a kernel record serves; its weights, and what else it is asked, stay the inner one's."""

    def __getattr__(self, key: str):
        try:
            return super().__getattr__(key)
        except AttributeError:
            inner = self.get("inner")  # None while the module itself is being built
            if inner is None:
                raise
            return getattr(inner, key)


class RecordLinear(Served):
    """A projection (or a tied head) served by a GEMV record's implementation, in blocks of at most 16 rows."""

    def __init__(self, inner: nn.Module, record, kind: str):
        super().__init__()
        self.inner, self.kind = inner, kind  # the projection's weights stay its own, under `inner`
        self.implementation = record.implementations[kind]

    def _arrays(self) -> tuple[dict, dict]:
        m = self.inner
        if isinstance(m, nn.QuantizedLinear):
            return ({"wq": m.weight, "scales": m.scales, "biases": m.biases},
                    {"n": m.weight.shape[0], "k": m.weight.shape[1] * 32 // m.bits, "group": m.group_size})
        return {"w": m.weight}, {"n": m.weight.shape[0], "k": m.weight.shape[1]}

    def __call__(self, x: mx.array) -> mx.array:
        from tensorfold_contract.serving import ServedCall, call

        weights, dims = self._arrays()
        blocks = [call(self.kind, self.implementation, ServedCall(len(range(s, min(s + GEMV_ROWS, x.shape[0]))),
                                                                  dims, {"x": x[s:s + GEMV_ROWS], **weights}))["y"]
                  for s in range(0, x.shape[0], GEMV_ROWS)] or [mx.zeros((0, dims["n"]), mx.float32)]
        y = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks)
        bias = getattr(self.inner, "bias", None) if "bias" in self.inner else None
        return (y + bias if bias is not None else y).astype(x.dtype)


class RecordNorm(Served):
    """An RMSNorm served by the rmsnorm record's implementation."""

    def __init__(self, inner: nn.RMSNorm, record, kind: str):
        super().__init__()
        self.inner, self.kind = inner, kind  # the norm's weight stays its own, under `inner`
        self.implementation = record.implementations[kind]

    def __call__(self, x: mx.array) -> mx.array:
        from tensorfold_contract.serving import ServedCall, call

        dtype = str(x.dtype).removeprefix("mlx.core.")
        served_call = ServedCall(x.shape[0], {"d": x.shape[-1], "dtype": dtype, "eps": self.inner.eps},
                                 {"x": x, "w": self.inner.weight, "eps": mx.array([self.inner.eps], mx.float32)})
        return call(self.kind, self.implementation, served_call)["out"]


def serve_kernels(model) -> dict:
    """Swap the model's row-path modules for the table's records on this backend; what serves each op."""
    here = backend()
    choice, kind = served(OPS), RECORDS_KIND[here]
    records = _records() if any(name != BUILTIN for name in choice.values()) else {}
    usable = {op: records[name] for op, name in choice.items()
              if name != BUILTIN and kind in records[name].implementations}
    blocks = model.model

    def linear(module):
        op = projection_op(module, model.dtype)
        return RecordLinear(module, usable[op], kind) if op in usable else module

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
        if "rms_norm" in usable:
            layer.input_layernorm = RecordNorm(layer.input_layernorm, usable["rms_norm"], kind)
            layer.post_attention_layernorm = RecordNorm(layer.post_attention_layernorm, usable["rms_norm"], kind)
    if "rms_norm" in usable:
        blocks.norm = RecordNorm(blocks.norm, usable["rms_norm"], kind)
    if model.args.tie_word_embeddings:
        embed = blocks.embed_tokens
        op = projection_op(embed, model.dtype) if not isinstance(embed, nn.QuantizedEmbedding) else None
        if op in usable:  # the embedding's weight read as a projection; kept out of the module tree (no twin)
            object.__setattr__(model, "served_head", RecordLinear(embed, usable[op], kind))
    else:
        model.lm_head = linear(model.lm_head)
    return {op: (f"{name} ({kind})" if op in usable else BUILTIN) for op, name in choice.items()}
