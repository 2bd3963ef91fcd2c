"""The llama family's op table, and the modules that serve its row-path ops through its kernel records."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from tensorfold_core.kernels import BUILTIN, RECORDS_KIND, backend, served

from .ops import OPS


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
    """A projection (or a tied head) served by a GEMV record's implementation: one launch for all of a forward's
    rows, bf16 out (the record's served output), the weights read once per block of rows."""

    def __init__(self, inner: nn.Module, record, kind: str):
        from tensorfold_contract.serving import Prepared

        from .kernels.gemv import OUT

        super().__init__()
        self.inner = inner  # the projection's weights stay its own, under `inner`
        m = inner
        if isinstance(m, nn.QuantizedLinear):
            dims = {"n": m.weight.shape[0], "k": m.weight.shape[1] * 32 // m.bits, "group": m.group_size}
            weights = lambda: {"wq": m.weight, "scales": m.scales, "biases": m.biases}  # noqa: E731
        else:
            dims = {"n": m.weight.shape[0], "k": m.weight.shape[1]}
            weights = lambda: {"w": m.weight}  # noqa: E731
        # kept out of the module tree: a plain attribute MLX's parameter walk never enters
        object.__setattr__(self, "launch", Prepared(kind, record.implementations[kind], {**dims, "out": OUT},
                                                   weights, "x"))
        object.__setattr__(self, "biased", "bias" in inner)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.launch(x)["y"]
        return y + self.inner.bias if self.biased else y


class RecordNorm(Served):
    """An RMSNorm served by the rmsnorm record's implementation, one launch a call."""

    def __init__(self, inner: nn.RMSNorm, record, kind: str):
        from tensorfold_contract.serving import Prepared

        super().__init__()
        self.inner = inner  # the norm's weight stays its own, under `inner`
        eps = mx.array([inner.eps], mx.float32)
        implementation = record.implementations[kind]

        def prepared(dtype: mx.Dtype) -> Prepared:  # one a dtype: the record's dims name the activation dtype
            dims = {"d": inner.weight.shape[-1], "dtype": str(dtype).removeprefix("mlx.core."), "eps": inner.eps}
            return Prepared(kind, implementation, dims, lambda: {"w": inner.weight, "eps": eps}, "x")

        object.__setattr__(self, "launches", {})
        object.__setattr__(self, "prepared", prepared)

    def __call__(self, x: mx.array) -> mx.array:
        launch = self.launches.get(x.dtype)
        if launch is None:
            launch = self.launches[x.dtype] = self.prepared(x.dtype)
        return launch(x)["out"]


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
