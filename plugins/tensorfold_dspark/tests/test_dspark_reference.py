"""A hold's drafts and chances against a float64 host reference of the published DSpark architecture."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.loading import start_drafter
from tensorfold_core.protocols import DraftAsk
from tensorfold_core.testing import PROMPT
from tensorfold_lfm2.load import load


def weight(module: nn.Module) -> np.ndarray:
    """A module's weight in float64, unpacked where the drafter packed it (the codes it really serves)."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        w = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
    else:
        w = module.weight
    return np.array(w.astype(mx.float32), dtype=np.float64)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.array(w, np.float64)


def rope(x, start, base):
    """Interleaved RoPE: pairs (2i, 2i + 1) turned by position * base^(-2i / dim); x [heads, rows, dim]."""
    dim = x.shape[-1]
    angle = (start + np.arange(x.shape[1]))[:, None] * base ** (-np.arange(0, dim, 2) / dim)
    cos, sin = np.cos(angle), np.sin(angle)
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


def reference_hold(model, embedding, tapped, pending, depth, mask_id):
    """The published architecture in float64: context keys and values from fc + hidden_norm of the tapped rows, a
    non-causal block [pending, mask...] after them, the tied head, then the Markov head row after row."""
    args, eps = model.args, model.args.rms_norm_eps
    heads, kv, hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    n = tapped.shape[0]
    c = rms(tapped @ weight(model.fc).T, model.hidden_norm.weight, eps)
    h = embedding[[pending] + [mask_id] * (depth - 1)]
    for layer in model.layers:
        a = layer.self_attn
        split = lambda x, k: x.reshape(x.shape[0], k, hd).transpose(1, 0, 2)
        ck = rope(rms(split(c @ weight(a.k_proj).T, kv), a.k_norm.weight, eps), 0, args.rope_theta)
        cv = split(c @ weight(a.v_proj).T, kv)
        x = rms(h, layer.input_layernorm.weight, eps)
        q = rope(rms(split(x @ weight(a.q_proj).T, heads), a.q_norm.weight, eps), n, args.rope_theta)
        k = np.concatenate([ck, rope(rms(split(x @ weight(a.k_proj).T, kv), a.k_norm.weight, eps), n,
                                     args.rope_theta)], axis=1)
        v = np.concatenate([cv, split(x @ weight(a.v_proj).T, kv)], axis=1)
        k, v = np.repeat(k, heads // kv, axis=0), np.repeat(v, heads // kv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)  # no mask: every row sees every key
        p = np.exp(scores - scores.max(-1, keepdims=True))
        o = (p / p.sum(-1, keepdims=True)) @ v
        h = h + o.transpose(1, 0, 2).reshape(depth, -1) @ weight(a.o_proj).T
        m, x = layer.mlp, rms(h, layer.post_attention_layernorm.weight, eps)
        gate = x @ weight(m.gate_proj).T
        h = h + (gate / (1 + np.exp(-gate)) * (x @ weight(m.up_proj).T)) @ weight(m.down_proj).T
    final = rms(h, model.norm.weight, eps)
    base = final @ embedding.T
    w1, w2 = weight(model.markov_head.markov_w1), weight(model.markov_head.markov_w2)
    proj = model.confidence_head.proj
    conf_w, conf_b = weight(proj)[0], float(np.array(proj.bias)[0])
    drafts, chances, previous, running = [], [], pending, 1.0
    for j in range(depth):
        token = int(np.argmax(base[j] + w2 @ w1[previous]))
        running *= 1 / (1 + np.exp(-(conf_w @ np.concatenate([final[j], w1[previous]]) + conf_b)))
        drafts.append(token)
        chances.append(running)
        previous = token
    return drafts, chances


def committed(target):
    """A target cache holding PROMPT, its tapped rows staged."""
    cache = target.new_cache(64)
    target.forward([cache], [PROMPT], [0])
    target.keep(cache, len(PROMPT))
    return cache


@pytest.mark.parametrize("depth", [1, 5, 8])
def test_a_holds_drafts_and_chances_are_the_float64_reference_of_the_published_architecture(target_dir, dspark_dir,
                                                                                            depth):
    target = load(Checkpoint.open(target_dir))
    drafter = start_drafter(str(dspark_dir), target, Checkpoint.open(target_dir).tokenizer())
    try:
        tapped = np.array(target.take_features(committed(target)).rows, dtype=np.float64)
        drafter.eos_ids = frozenset()  # the reference does not stop at an eos
        drafts = drafter.propose([DraftAsk(0, PROMPT + [9], depth, cache=committed(target))])[0]
        embedding = np.array(target.model.embed_tokens.weight, dtype=np.float64)
        want, chances = reference_hold(drafter.model, embedding, tapped, 9, depth, drafter.mask_id)
        assert drafts == want
        assert np.allclose(drafter.chances(0), chances, rtol=1e-4, atol=1e-6)
    finally:
        drafter.close()
