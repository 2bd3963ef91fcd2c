"""Every stream of an LFM2 forward in one launch a layer: the attention layers through the packed-streams attention
over stacked caches, the conv layers through the streams conv over every stream's stacked tails; each stream's window
of every layer is stored once, after the last layer."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tensorfold_core.families import Span

CONV_SPANS_ENV = "TENSORFOLD_WHOLE_CONV_SPANS"  # "1": the conv spans key the whole forward's trace (a measurement)
LAYOUT_LIMIT = 4096  # conv row-map layouts kept; a drafting group meets a few hundred

_ROWMAPS: dict = {}  # the streams' (first row, rows) -> each row's (stream, its window's first row), in device memory

ConvStreams = tuple  # (every stream's conv tails stacked [streams, conv_layers, tail, dim], their spans, the row map)


def conv_streams(spans: Sequence[Span]) -> ConvStreams:
    """What each conv layer of a forward reads besides its rows: the streams' tails, spans and row map."""
    layout = tuple((start, n) for start, n, _, _ in spans)
    rowmap = _ROWMAPS.get(layout)
    if rowmap is None:
        if len(_ROWMAPS) >= LAYOUT_LIMIT:
            _ROWMAPS.clear()
        rows = [(s, start) for s, (start, n) in enumerate(layout) for _ in range(n)]
        # an abs of the host's copy: the map lives in device memory, not in the managed memory host arrays take
        rowmap = _ROWMAPS[layout] = mx.abs(mx.array(np.array(rows, np.int32).reshape(-1, 2)))
    return mx.stack([cache.conv[0] for _, _, cache, _ in spans]), layout, rowmap


def run_layers(layers: Sequence[nn.Module], slots: Sequence[int], parts: Sequence[tuple], stack_kv, h: mx.array,
               positions: mx.array, groups: Sequence, convs: ConvStreams,
               tapped: Sequence[int]) -> tuple[mx.array, mx.array, mx.array, mx.array, list[mx.array]]:
    """The layers' output rows through each layer's (before, after) parts; their new keys and values stacked
    [rows, attention_layers, kv_heads, head_dim], the tail each row leaves stacked [rows, conv_layers, tail, dim],
    and the tapped layers' rows."""
    new_keys, new_values, new_states, taps = [], [], [], []
    for i, (layer, slot, (before, after)) in enumerate(zip(layers, slots, parts)):
        if layer.is_attention_layer:
            q, k, v = before(h, positions)
            h = after(h, *layer.self_attn.mix_streams(q, k, v, groups, slot))
            new_keys.append(k)
            new_values.append(v)
        else:
            c, gated = before(h)
            convolved, states = layer.conv.streams(gated, convs, slot)
            h = after(h, c, convolved)
            new_states.append(states)
        if i in tapped:
            taps.append(h)
    if stack_kv is None:
        return h, mx.stack(new_keys, axis=1), mx.stack(new_values, axis=1), mx.stack(new_states, axis=1), taps
    keys, values = stack_kv(new_keys, new_values)
    # the tails by the same record, one launch for every conv layer (its second stack, the same bits, goes unread)
    return h, keys, values, stack_kv(new_states, new_states)[0], taps


def whole_layers(layers: Sequence[nn.Module], slots: Sequence[int], stack_kv, layout: tuple,
                 tapped: Sequence[int]) -> Callable:
    """run_layers as one function of arrays alone, for mx.compile: the groups' rows, cache counts and the streams'
    spans fixed by `layout`, the row maps, buffers and tails passed in. It holds the layers, not the model, so a
    dropped model's compiled forward makes no reference cycle."""
    from tensorfold_core.row_kernels.attention_streams import Packed

    parts = [(layer.before_roped if layer.is_attention_layer else layer.before, layer.after) for layer in layers]
    group_layout, conv_layout = layout

    def traced(h, positions, rowmaps, keys, values, tails, conv_rowmap):
        groups, at = [], 0
        for (lo, hi, spans, n), group_rowmap in zip(group_layout, rowmaps):
            groups.append((lo, hi, Packed(spans, group_rowmap), keys[at:at + n], values[at:at + n]))
            at += n
        h, keys, values, states, taps = run_layers(layers, slots, parts, stack_kv, h, positions, groups,
                                                   (tails, conv_layout, conv_rowmap), tapped)
        return [h, keys, values, states, *taps]

    return traced


def whole_key(model, rows: int, groups: Sequence, convs: ConvStreams) -> tuple[tuple, tuple]:
    """The whole forward's layout (what its trace holds as constants) and its trace's key: the row count, the groups,
    the caches' shapes, and the streams' spans only where MLX's ops read them on the host."""
    layout = (tuple((lo, hi, packed.spans if model.whole_spans else None, len(ks)) for lo, hi, packed, ks, _ in groups),
              convs[1] if model.whole_conv_spans else None)
    return layout, (rows, layout, model._tapped, tuple(tuple(k.shape) for g in groups for k in g[3]))


def forward_streams(model, h: mx.array, spans: Sequence[Span], positions: mx.array,
                    outputs: dict[int, mx.array]) -> mx.array:
    """The layers over stacked caches, each layer one launch for every stream (attention by groups of 8), reading
    the caches as they were; then each stream's window of every layer stored at once. Tapped rows go to `outputs`."""
    from tensorfold_core.row_kernels.step_arrays import padded_forward, stream_groups

    layers, tapped = model.model.layers, model._tapped
    rows = h.shape[0]
    h, padded, positions = padded_forward(h, spans, positions, model.pad_rows)
    groups, convs, traced = stream_groups(padded, positions), conv_streams(padded), None
    if model.whole is not None:  # every layer in one compiled call: one trace a shape replays every launch
        layout, key = whole_key(model, h.shape[0], groups, convs)
        traced = model.whole.get(key, lambda: whole_layers(layers, model._slots, model.stack_kv, layout, tapped))
    if traced is None:  # no whole forward, or a shape met for the first time: the layers' parts from Python
        parts = [layer.halves or (layer.before_roped if layer.is_attention_layer else layer.before, layer.after)
                 for layer in layers]
        h, keys, values, states, taps = run_layers(layers, model._slots, parts, model.stack_kv, h, positions, groups,
                                                   convs, tapped)
    else:
        h, keys, values, states, *taps = traced(h, positions, [g[2].rowmap for g in groups],
                                                [k for g in groups for k in g[3]], [v for g in groups for v in g[4]],
                                                convs[0], convs[2])
    outputs.update(zip(sorted(tapped), taps))  # padded rows past `rows` too: their readers slice by span
    # stored after the last layer's attention has read the caches, so each buffer is updated in place
    keys, values = mx.depends([keys, values], [h])
    for start, n, cache, _ in spans:
        cache.store_window(keys[start:start + n], values[start:start + n], states[start:start + n])
    return h if h.shape[0] == rows else h[:rows]

