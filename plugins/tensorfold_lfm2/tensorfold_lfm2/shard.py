"""The lfm2 and lfm2_moe families' shard plan: attention heads, conv channels, MLPs and experts over a group."""

from __future__ import annotations

from tensorfold_core.shard import ShardPlan, split_modules

from .lfm2_moe import ModelArgs as MoeArgs


def plan(model) -> ShardPlan:
    """Conv channels (in_proj's B/C/x blocks alike, the depthwise conv), heads, MLP and expert widths; router whole."""
    a = model.args
    columns, blocks, rows, channels, reduce, divide, pairs = [], [], [], [], [], [], []
    for i, layer in enumerate(model.model.layers):
        at = f"model.layers.{i}"
        if layer.is_attention_layer:
            columns += split_modules([f"{at}.self_attn"], ("q_proj", "k_proj", "v_proj"))
            rows.append(f"{at}.self_attn.out_proj")
            reduce.append(f"{at}.self_attn.out_proj")
            divide += [(f"{at}.self_attn", "n_heads"), (f"{at}.self_attn", "n_kv_heads")]
        else:
            blocks.append((f"{at}.conv.in_proj", 3))
            channels.append(f"{at}.conv.conv")
            divide.append((f"{at}.conv.conv", "groups"))
            rows.append(f"{at}.conv.out_proj")
            reduce.append(f"{at}.conv.out_proj")
        ff = f"{at}.feed_forward"
        # by the config, not the module's type: the plan is read again after the kernels' swap, for its sums
        if isinstance(a, MoeArgs) and i >= a.num_dense_layers:  # one sum after the weighed experts, not one each
            # a pair: an expert's width cut in whole quantization groups where halves would cut one (4-bit, 192)
            pairs.append((split_modules([f"{ff}.switch_mlp"], ("gate_proj", "up_proj")), f"{ff}.switch_mlp.down_proj"))
            reduce.append(ff)
            continue
        up, gate, down = ("w1", "w3", "w2") if "w1" in layer.feed_forward else ("gate_proj", "up_proj", "down_proj")
        columns += split_modules([ff], (up, gate))
        rows.append(f"{ff}.{down}")
        reduce.append(f"{ff}.{down}")
    # the MLPs' widths are checked where they split, naming the module
    sizes = {"num_attention_heads": a.num_attention_heads, "num_key_value_heads": a.num_key_value_heads,
             "hidden_size": a.hidden_size}
    return ShardPlan(columns=tuple(columns), blocks=tuple(blocks), rows=tuple(rows), channels=tuple(channels),
                     reduce=tuple(reduce), divide=tuple(divide), sizes=sizes, pairs=tuple(pairs))
