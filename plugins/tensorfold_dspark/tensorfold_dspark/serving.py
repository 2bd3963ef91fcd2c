"""The DSpark drafter's ops served through their kernel records, as its op table says."""

from __future__ import annotations

import os
from typing import Callable

import mlx.core as mx

from tensorfold_core.kernels import BUILTIN, records_served

from .kernels import records
from .model import Model, markov_pick
from .ops import OPS

# "1": the drafter runs MLX's own ops instead of its table (the llama drafter's knob: bench variant `:drafter-builtin`)
DRAFTER_BUILTIN_ENV = "TENSORFOLD_DRAFTER_BUILTIN"

Pick = Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]  # (logits rows, previous) -> (ids, NaN flags)


def markov_picker(model: Model) -> tuple[Pick, dict[str, str]]:
    """The hold's Markov step on this backend, and what serves each op (for `capabilities`): the pick record's
    implementation where the table names one and its inputs fit it, MLX's ops (`model.markov_pick`) otherwise."""
    builtin = ({op: BUILTIN for op in OPS}, lambda logits, previous: markov_pick(logits, model.markov_head, previous))
    if os.environ.get(DRAFTER_BUILTIN_ENV) == "1":
        return builtin[1], builtin[0]
    usable, kind, labels = records_served(OPS, records)
    head = model.markov_head
    if "markov pick" not in usable or not _fits(head):
        return builtin[1], {**labels, "markov pick": BUILTIN} if "markov pick" in usable else labels
    return _record_pick(head, usable["markov pick"], kind), labels


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
