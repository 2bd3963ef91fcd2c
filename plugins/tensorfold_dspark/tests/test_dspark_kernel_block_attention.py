"""The DSpark block attention record on the CPU: its shape is the shipped drafter's, its mlx implementation its call."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_dspark.kernels.block_attention import RECORD, TINY, mlx_block_attention
from tensorfold_dspark.lane import Lane
from tensorfold_dspark.load import load
from tensorfold_dspark.model import Block, Span
from tensorfold_dspark.plugin import MODELS

SHIPPED = MODELS / "tiny-lfm2-moe-dspark"


def test_the_record_s_tiny_shape_is_the_shipped_drafter_s_attention():
    config = Checkpoint.open(SHIPPED).config
    assert TINY == dict(heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                        head_dim=config["head_dim"], block=config["dflash_config"]["block_size"])
    assert any(shape.dims.items() >= TINY.items() for shape in RECORD.shapes)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_mlx_implementation_is_bit_equal_to_the_shipped_drafter_s_attention_on_a_block_over_its_context(dtype):
    model = load(Checkpoint.open(SHIPPED), dtype)
    args, rng = model.args, np.random.default_rng(5)
    context, stale, block, offset = 300, 7, args.block_size, 300
    tapped = mx.array(rng.standard_normal((context + stale, len(args.target_layer_ids) * args.hidden_size)), dtype)
    lane = Lane(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, context + stale + 5, dtype)
    for layer, ((keys, values),) in enumerate(model.context(model.context_rows(tapped), [Span(0, context + stale, 0)])):
        lane.write(layer, keys, values)
    lane.advance(0, context + stale)
    lane.trim(context)  # the rows past n stay in the buffer, stale: the call must not read them
    x = mx.array(rng.standard_normal((block, args.hidden_size)), dtype)
    for layer, decoder in enumerate(model.layers):
        attn = decoder.self_attn
        served = attn(x, [Block(0, block, offset, lane)], layer)
        queries = attn.q_norm(attn.q_proj(x).reshape(block, attn.n_heads, -1))
        keys, values = attn.keys_values(x)
        q, k = (attn.rope(a[None].transpose(0, 2, 1, 3), offset) for a in (queries, keys))
        out = mlx_block_attention(q[0].transpose(1, 0, 2), lane.keys[layer], lane.values[layer], lane.n, k,
                                  values[None].transpose(0, 2, 1, 3), attn.scale)
        assert out.dtype == mx.float32 and out.shape == (block, attn.n_heads, attn.head_dim)
        ours = attn.o_proj(out.astype(dtype).reshape(block, -1))
        assert np.array_equal(np.array(ours.astype(mx.float32)), np.array(served.astype(mx.float32))), layer
