"""The llama family's shard plan: attention heads and the MLP split over a group, one reduce after each."""

from __future__ import annotations

from tensorfold_core.shard import ShardPlan, split_modules


def plan(model) -> ShardPlan:
    """q/k/v and gate/up split by outputs (whole heads), o and down by inputs; embedding, norms and head kept whole."""
    a = model.args
    layers = [f"model.layers.{i}" for i in range(a.num_hidden_layers)]
    attention = [f"{layer}.self_attn" for layer in layers]
    mlp = [f"{layer}.mlp" for layer in layers]
    return ShardPlan(
        columns=split_modules(attention, ("q_proj", "k_proj", "v_proj")) + split_modules(mlp, ("gate_proj", "up_proj")),
        rows=split_modules(attention, ("o_proj",)) + split_modules(mlp, ("down_proj",)),
        reduce=split_modules(attention, ("o_proj",)) + split_modules(mlp, ("down_proj",)),
        divide=tuple((path, count) for path in attention for count in ("n_heads", "n_kv_heads")),
        sizes={"num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
               "intermediate_size": a.intermediate_size})
