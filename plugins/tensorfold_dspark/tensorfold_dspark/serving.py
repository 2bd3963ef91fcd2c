"""The DSpark drafter's ops served through their kernel records, as its op table says."""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx

from tensorfold_core.kernels import BUILTIN, DRAFTER_BUILTIN_ENV, STREAMS_ENV, records_served, unused
from tensorfold_core.row_kernels.attention import SPLIT

from .kernels import records
from .model import Model, markov_pick
from .ops import OPS

Pick = Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]  # (logits rows, previous) -> (ids, NaN flags)


def serve_kernels(model: Model) -> tuple[Pick, dict[str, str]]:
    """Serve the drafter's ops as its table says on this backend: the hold's Markov step (returned) and each layer's
    block attention (set on the layers); what serves each op, for `capabilities`. An op whose record does not take
    the drafter's shapes (codes not 8-bit affine, a head_dim the attention kernels do not take) stays MLX's."""
    def mlx_pick(logits: mx.array, previous: mx.array) -> tuple[mx.array, mx.array]:
        return markov_pick(logits, model.markov_head, previous)

    if os.environ.get(DRAFTER_BUILTIN_ENV) == "1":
        return mlx_pick, {op: BUILTIN for op in OPS}
    usable, kind, labels = records_served(OPS, records)
    pick: Pick = mlx_pick
    if "markov pick" in usable:
        if _fits(model.markov_head):
            pick = _record_pick(model.markov_head, usable["markov pick"], kind)
        else:
            labels["markov pick"] = BUILTIN
    dim = model.args.head_dim
    attends = "block attention" in usable and not (dim % 32 or SPLIT % dim)
    if "block attention" in usable and not attends:
        labels["block attention"] = BUILTIN
    if attends:
        from .kernels.block_attention import BLOCK_ATTENTION

        for layer in model.layers:
            layer.self_attn.attend = BLOCK_ATTENTION[kind]
    # a hold's blocks in one launch a layer where the one-block record attends too (the same sums a row), unless
    # TENSORFOLD_STREAM_ATTENTION=0 asks a launch a block (a measurement)
    if attends and "block attention streams" in usable and os.environ.get(STREAMS_ENV, "1") != "0":
        from .kernels.block_attention_streams import BLOCK_STREAMS, rowmap

        for layer in model.layers:
            layer.self_attn.attend_streams = BLOCK_STREAMS[kind]
        object.__setattr__(model, "streams_rowmap", rowmap)
        # the cuda and metal kernels read each lane's n from the row map: a queued hold's device lengths serve there
        object.__setattr__(model, "rowmap_lengths", kind != "mlx")
    else:
        unused(labels, ("block attention streams",), STREAMS_ENV)
    return pick, labels


def _fits(head) -> bool:
    """The record reads 8-bit affine codes in 16-code chunks that lie within one group."""
    w1, w2 = head.markov_w1, head.markov_w2
    if any(getattr(m, "bits", None) != 8 or getattr(m, "mode", None) != "affine" for m in (w1, w2)):
        return False
    rank, group = w1.scales.shape[-1] * w1.group_size, w1.group_size
    return w2.group_size == group and rank % 16 == 0 and group % 16 == 0 and rank % group == 0


def _record_pick(head, record, kind: str) -> Pick:
    """The pick record's `kind` implementation bound to the head's codes: one launch a step (a plan per row count)."""
    from tensorfold_contract.serving import Prepared

    w1, w2 = head.markov_w1, head.markov_w2
    dims = {"vocab": w2.weight.shape[0], "rank": w1.scales.shape[-1] * w1.group_size, "group": w1.group_size,
            "dtype": str(w1.scales.dtype).removeprefix("mlx.core.")}

    def codes() -> dict:
        return {f"{name}_{part}": module[key] for name, module in (("w1", w1), ("w2", w2))
                for part, key in (("codes", "weight"), ("scales", "scales"), ("biases", "biases"))}

    prepared = Prepared(kind, record.implementations[kind], dims, codes, "logits")

    def pick(logits: mx.array, previous: mx.array) -> tuple[mx.array, mx.array]:
        out = prepared(logits.astype(mx.float32), previous=previous)
        return out["ids"].astype(mx.uint32), out["flags"]

    return pick
