"""Every stream of an lfm2 forward in one launch a layer (streams.py): the logits, caches, kept states and taps of a
launch a stream, bit for bit."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tensorfold_core.kernels import KERNELS_ENV
from tensorfold_core.loading import load_model
from tensorfold_core.kernels import STACK_KV_ENV, STREAMS_ENV
from tensorfold_core.row_kernels.modules import COMPILE_ENV, WHOLE_ENV
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import forward_alike

PROMPTS = ["import os\nimport", "def main(argv):\n", "class Point:\n    def __init__(self"]
BF16 = LoadOptions(dtype="bfloat16")


@pytest.fixture
def through_records(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "records")
    monkeypatch.setenv(COMPILE_ENV, "1")


def with_and_without(monkeypatch, env: str, name: str = "tiny-lfm2"):
    """The model in bf16 through its records, as served, then again with `env` set to "0"; and its tokenizer."""
    served, tokenizer, _ = load_model(name, BF16)
    monkeypatch.setenv(env, "0")
    apart, _, _ = load_model(name, BF16)
    monkeypatch.delenv(env)
    return served, apart, tokenizer


def ragged(tokenizer, streams: int) -> list[list[int]]:
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    return [prompts[i % len(prompts)][:4 + 2 * i] for i in range(streams)]


def layer_arrays(cache) -> list[mx.array]:
    """A cache's committed keys, values and conv tails, a layer at a time, stacked or not."""
    n = cache.offset
    if cache.stacked:
        split = lambda a: [a[layer] for layer in range(a.shape[0])]
        return [*split(cache.keys[0][:, :, :n]), *split(cache.values[0][:, :, :n]), *split(cache.conv[0])]
    return [a[0, :, :n] for a in cache.keys + cache.values] + [a[0] for a in cache.conv]


def assert_same_caches(ours: list, theirs: list) -> None:
    for a, b in zip(ours, theirs):
        assert a.offset == b.offset
        assert all(mx.array_equal(x, y).item() for x, y in zip(layer_arrays(a), layer_arrays(b), strict=True))


def test_ten_streams_in_one_launch_a_layer_give_the_logits_and_caches_of_one_launch_a_stream(through_records,
                                                                                            monkeypatch):
    packed, apart, tokenizer = with_and_without(monkeypatch, STREAMS_ENV)
    assert packed.stacked and packed.new_cache(8).stacked and not apart.stacked
    stacked = packed.new_cache(96)  # the ledger's price of a cache is what a stacked one holds
    assert sum(a.nbytes for a in stacked.keys + stacked.values) + sum(a.nbytes for a in stacked.conv) == \
        packed.cache_bytes(96) == apart.cache_bytes(96)
    caches = {id(m): [m.new_cache(96) for _ in range(10)] for m in (packed, apart)}
    for windows in (ragged(tokenizer, 10), [[7, 8, 9, 10]] * 10, [[11]] * 10, [[12, 13]] * 4):  # last: four only
        forward_alike((packed, apart), caches, windows)
    assert_same_caches(caches[id(packed)], caches[id(apart)])


def test_a_forward_compiled_whole_gives_the_logits_and_caches_of_its_layers_called_one_by_one(through_records,
                                                                                              monkeypatch):
    whole, apart, tokenizer = with_and_without(monkeypatch, WHOLE_ENV)
    assert whole.whole is not None and apart.whole is None and whole.whole_spans and apart.stacked
    caches = {id(m): [m.new_cache(64) for _ in range(10)] for m in (whole, apart)}
    for windows in (ragged(tokenizer, 10), [[7, 8, 9]] * 10, [[11]] * 10, [[11]] * 10, [[11]] * 10):
        forward_alike((whole, apart), caches, windows)
    # the spans are in the key on the CPU, so only the repeated one-row step met its key again: traced the second
    # time, replayed the third
    assert len(whole.whole.compiled) == 1
    assert_same_caches(caches[id(whole)], caches[id(apart)])


def test_a_kernel_served_whole_forward_keys_its_trace_by_rows_not_by_each_stream_s_window_size(through_records):
    from tensorfold_core.families import Span, row_positions
    from tensorfold_core.row_kernels.step_arrays import stream_groups
    from tensorfold_lfm2.streams import conv_streams, whole_key

    model, _, _ = load_model("tiny-lfm2", BF16)
    assert model.whole_conv_spans  # on the CPU the MLX conv reads the spans on the host
    caches = [model.new_cache(64) for _ in range(3)]

    def key(sizes):
        spans = [Span(sum(sizes[:i]), n, cache, None) for i, (n, cache) in enumerate(zip(sizes, caches))]
        return whole_key(model, sum(sizes), stream_groups(spans, row_positions(spans)), conv_streams(spans))[1]

    assert key((2, 2, 2)) != key((1, 4, 1))
    # as on a GPU, where the kernels read the row maps (inputs): a drafted round's depths need no trace of their own
    model.whole_spans = model.whole_conv_spans = False
    assert key((2, 2, 2)) == key((1, 4, 1)) == key((5, 1, 0))
    assert key((2, 2, 2)) != key((2, 2, 3))


def test_the_layers_keys_and_conv_tails_stacked_by_the_table_s_record_fill_the_caches_as_mlx_s_stack_does(
        through_records, monkeypatch):
    from tensorfold_core.row_kernels.stack import STACKS

    served, apart, tokenizer = with_and_without(monkeypatch, STACK_KV_ENV)
    assert served.stack_kv is STACKS["mlx"] and apart.stack_kv is None
    assert served.kernels["stack kv"] == "lfm2 stack kv (mlx)"
    assert apart.kernels["stack kv"] == f"mlx (lfm2 stack kv (mlx) unused: {STACK_KV_ENV}=0)"
    stacked = []
    served.stack_kv = lambda first, second: stacked.append(len(first)) or STACKS["mlx"](first, second)
    served.whole = None  # the layers from Python, so every forward calls the stack
    caches = {id(m): [m.new_cache(64) for _ in PROMPTS] for m in (served, apart)}
    for windows in (ragged(tokenizer, 3), [[7, 8]] * 3):
        forward_alike((served, apart), caches, windows)
    assert_same_caches(caches[id(served)], caches[id(apart)])
    layers = served.model.layers
    attending = sum(layer.is_attention_layer for layer in layers)
    assert stacked == [attending, len(layers) - attending] * 2  # each forward: the keys and values, then the tails


def test_a_moe_model_streams_its_layers_from_python_since_its_blocks_read_their_picks(through_records, monkeypatch):
    packed, apart, tokenizer = with_and_without(monkeypatch, STREAMS_ENV, "tiny-lfm2-moe")
    assert packed.stacked and packed.whole is None and packed.reads_on_host
    assert packed.kernels["conv streams"] == "lfm2 streams conv (mlx)"
    for op in ("attention streams", "conv streams", "stack kv"):
        assert apart.kernels[op].startswith("mlx (") and apart.kernels[op].endswith(f"unused: {STREAMS_ENV}=0)")
    caches = {id(m): [m.new_cache(64) for _ in range(5)] for m in (packed, apart)}
    for windows in (ragged(tokenizer, 5), [[7, 8, 9]] * 5, [[11]] * 5):
        forward_alike((packed, apart), caches, windows)
    assert_same_caches(caches[id(packed)], caches[id(apart)])


def test_a_stacked_cache_s_kept_state_resumes_at_its_marks_and_never_in_an_unstacked_cache(through_records,
                                                                                           monkeypatch):
    packed, apart, tokenizer = with_and_without(monkeypatch, STREAMS_ENV)
    ids = tokenizer.encode(PROMPTS[2])
    caches = {}
    for m in (packed, apart):
        cache = caches[id(m)] = m.new_cache(64, marks=4)
        m.forward([cache], [ids], [1])
        m.keep(cache, len(ids) - 1)  # the window cut after all rows but the last: marks passed inside it
    state = packed.snapshot(caches[id(packed)])
    assert state.stacked and state.points[-1] == len(ids) - 1 and len(state.points) >= 2
    assert state.points == apart.snapshot(caches[id(apart)]).points
    for point in state.points:
        resumed, fresh = packed.restore(state, 64, point), apart.restore(apart.snapshot(caches[id(apart)]), 64, point)
        rest = ids[point:]
        ours, theirs = (m.forward([c], [rest], [len(rest)]) for m, c in ((packed, resumed), (apart, fresh)))
        assert mx.array_equal(ours, theirs).item()
    with pytest.raises(ValueError, match=r"\(stacked\) cannot restore into a cache of .* \(not stacked\)"):
        apart.restore(state, 64)


def test_a_stacked_model_s_taps_are_the_rows_a_launch_a_stream_taps(through_records, monkeypatch):
    packed, apart, tokenizer = with_and_without(monkeypatch, STREAMS_ENV)
    taps = {}
    for m in (packed, apart):
        m.features([1, 5])
        caches = [m.new_cache(64) for _ in range(4)]
        for windows in (ragged(tokenizer, 4), [[7, 8]] * 4):
            m.forward(caches, windows, [1] * 4)
            for cache, window in zip(caches, windows):
                m.keep(cache, len(window))
        taps[id(m)] = [m.take_features(cache) for cache in caches]
    for ours, theirs in zip(taps[id(packed)], taps[id(apart)]):
        assert ours.start == theirs.start and mx.array_equal(ours.rows, theirs.rows).item()


def test_a_whole_forward_padded_to_a_multiple_of_eight_rows_gives_the_logits_caches_and_taps_of_one_unpadded(
        through_records, monkeypatch):
    from tensorfold_core.row_kernels.step_arrays import PAD_ROWS_ENV

    monkeypatch.setenv(PAD_ROWS_ENV, "8")
    padded, tokenizer, _ = load_model("tiny-lfm2", BF16)
    plain, _, _ = load_model("tiny-lfm2", BF16)
    # on the CPU MLX's conv keys the trace by spans, so serving pads nothing there: padded here to prove the rows
    assert padded.pad_rows == 0 and padded.whole is not None
    padded.pad_rows = 8
    caches = {id(m): [m.new_cache(64) for _ in range(5)] for m in (padded, plain)}
    for m in (padded, plain):
        m.features([1, 5])
    # the ragged prompts (32 rows: no pad), then windows of 1 to 5 rows (15 -> 16), then 3 x 3 (9 -> 16)
    for windows in (ragged(tokenizer, 5), [[7 + i] * (1 + i) for i in range(5)], [[12, 13, 14]] * 3):
        forward_alike((padded, plain), caches, windows)
    assert_same_caches(caches[id(padded)], caches[id(plain)])
    for ours, theirs in zip(*(map(m.take_features, caches[id(m)]) for m in (padded, plain))):
        assert ours.start == theirs.start and mx.array_equal(ours.rows, theirs.rows).item()
    assert sorted(key[0] for key in padded.whole.met) == [16, 16, 32]  # each key's row count: 15 and 9 ran as 16


def test_only_a_forward_past_eight_rows_and_off_a_multiple_of_eight_is_padded_and_only_its_last_window():
    from tensorfold_core.families import Span
    from tensorfold_core.row_kernels.step_arrays import padded_spans

    spans = [Span(0, 3, None, None), Span(3, 7, None, None)]
    assert [s.n for s in padded_spans(spans, 8)] == [3, 13]  # 10 rows run as 16
    few, whole = spans[:1], [Span(0, 9, None, None), Span(9, 7, None, None)]
    assert padded_spans(few, 8) is few and padded_spans(whole, 8) is whole and padded_spans(spans, 0) is spans


def test_a_whole_forward_traces_a_key_at_its_second_meeting_unless_told_to_trace_at_its_first(through_records,
                                                                                             monkeypatch):
    from tensorfold_core.row_kernels.modules import TRACE_AFTER_ENV

    served, _, _ = load_model("tiny-lfm2", BF16)
    monkeypatch.setenv(TRACE_AFTER_ENV, "0")
    first, _, _ = load_model("tiny-lfm2", BF16)
    for model in (served, first):
        model.forward([model.new_cache(64) for _ in range(2)], [[7, 8], [9]], [1, 1])
    assert (len(served.whole.compiled), len(served.whole.met)) == (0, 1)  # met once, run from Python
    assert (len(first.whole.compiled), len(first.whole.met)) == (1, 0)

