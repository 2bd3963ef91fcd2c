"""The lfm2 families' op table: built-ins on the CPU, their kernel records where the table names them, same tokens."""

from __future__ import annotations

from types import MethodType

import mlx.core as mx
import mlx.nn as nn
import pytest

from tensorfold_core.capabilities import capabilities
from tensorfold_core.kernels import BUILTIN, KERNELS_ENV, describe, missing_records, served
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import load_model
from tensorfold_core.options import ServeOptions
from tensorfold_core.row_kernels.modules import COMPILE_ENV, RecordLinear, RecordNorm
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import Run, logits_alike, serial, solo
from tensorfold_lfm2.kernels import records
from tensorfold_lfm2.ops import OPS
from tensorfold_lfm2.serving import ServedConv, ServedMoe

PROMPTS = ["import os\nimport", "def main(argv):\n", "class Point:\n    def __init__(self"]
BF16 = LoadOptions(dtype="bfloat16")


def test_every_record_the_table_names_exists_with_the_implementation_its_backend_runs():
    assert missing_records(OPS, records()) == []
    assert {record.family for record in records()} == {"lfm2"}


def test_every_lfm2_record_passes_its_own_checks_with_controls_planted():
    assert {r.name: r.problems() for r in records()} == {r.name: [] for r in records()}


def test_on_cuda_every_row_path_op_but_mlx_s_row_invariant_rms_norm_is_served_by_an_lfm2_record():
    chosen = served(OPS, "cuda")
    assert chosen.pop("rms_norm") == BUILTIN
    assert all(name != BUILTIN and name.startswith("lfm2") for name in chosen.values()), chosen


def test_the_cpu_serves_every_op_through_mlx_built_ins_and_capabilities_show_the_table(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)  # the table's own choice, whatever the run overrides
    model, _, _ = load_model("tiny-lfm2-moe", BF16)
    assert model.kernels == {op: BUILTIN for op in OPS} and model.served_head is None
    layer = model.model.layers[0]
    assert isinstance(layer.conv.in_proj, nn.Linear) and layer.conv.served is None
    family = next(f for f in capabilities(ServeOptions())["families"] if f["name"] == "lfm2_moe")
    assert family["kernels"] == describe(OPS) and family["kernels"]["table"]["short conv"]["cuda"] == \
        "lfm2 stream conv"


@pytest.fixture
def through_records(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "records")


def _models(name: str, monkeypatch):
    recorded, tokenizer, _ = load_model(name, BF16)
    monkeypatch.setenv(KERNELS_ENV, "builtin")
    builtin, _, _ = load_model(name, BF16)
    monkeypatch.setenv(KERNELS_ENV, "records")
    return recorded, builtin, tokenizer


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2-moe"])
def test_a_load_that_asks_for_mlx_s_own_ops_serves_them_whatever_the_table_says(through_records, name):
    model, _, _ = load_model(name, LoadOptions(dtype="bfloat16", builtin_kernels=True))
    assert model.kernels == {op: BUILTIN for op in OPS} and model.served_head is None
    assert not any(isinstance(m, (RecordLinear, RecordNorm)) for _, m in model.named_modules())


def test_served_through_its_records_the_dense_model_stays_within_bf16_rounding_of_the_built_ins(through_records,
                                                                                                monkeypatch):
    recorded, builtin, tokenizer = _models("tiny-lfm2", monkeypatch)
    layers = recorded.model.layers
    conv, attention = layers[0], next(layer for layer in layers if layer.is_attention_layer)
    assert isinstance(conv.conv.in_proj, RecordLinear) and isinstance(conv.conv.served, ServedConv)
    assert isinstance(attention.self_attn.q_layernorm, RecordNorm) and attention.self_attn.attend is not None
    assert isinstance(recorded.model.embedding_norm, RecordNorm) and isinstance(recorded.served_head, RecordLinear)
    for text in PROMPTS:  # the records sum in their own fixed orders: the last bf16 bits may differ
        ids = tokenizer.encode(text)
        ours, theirs = (m.forward([m.new_cache(64)], [ids], [len(ids)]) for m in (recorded, builtin))
        assert mx.abs(ours - theirs).max().item() <= 4 * 2.0 ** -7 * mx.abs(theirs).max().item()


@pytest.mark.parametrize("name", ["tiny-lfm2-moe", "tiny-lfm2-moe-4bit"])
def test_served_through_its_records_a_moe_block_gives_the_built_in_block_s_rows_bit_for_bit(name, through_records,
                                                                                             monkeypatch):
    # a whole forward is no test here: a last-bit difference upstream (attention) may flip a router's pick
    recorded, builtin, _ = _models(name, monkeypatch)
    ours, theirs = recorded.model.layers[-1].feed_forward, builtin.model.layers[-1].feed_forward
    assert isinstance(ours, ServedMoe) and isinstance(ours.served_gate, RecordLinear)
    rows = (mx.random.normal((40, 256), key=mx.random.key(3)) * 0.5).astype(mx.bfloat16)
    assert mx.array_equal(ours(rows), theirs(rows)).item()
    assert mx.array_equal(ours(rows[7:8]), theirs(rows)[7:8]).item()


@pytest.mark.parametrize("name", ["tiny-lfm2-moe", "tiny-lfm2-moe-4bit"])
def test_in_float32_a_served_moe_blocks_experts_run_mlx_s_matmul_and_give_the_built_in_blocks_rows(name,
                                                                                                    through_records,
                                                                                                    monkeypatch):
    # no GEMV record takes float32 rows: the router's record serves, each picked expert's matrix runs MLX's matmul
    recorded, _, _ = load_model(name, LoadOptions(dtype="float32"))
    monkeypatch.setenv(KERNELS_ENV, "builtin")
    builtin, _, _ = load_model(name, LoadOptions(dtype="float32"))
    ours, theirs = recorded.model.layers[-1].feed_forward, builtin.model.layers[-1].feed_forward
    assert isinstance(ours, ServedMoe) and not isinstance(ours.served_gate, RecordLinear)
    rows = mx.random.normal((40, 256), key=mx.random.key(3)) * 0.5
    assert mx.allclose(ours(rows), theirs(rows), rtol=1e-5, atol=1e-6).item()
    assert mx.array_equal(ours(rows[7:8]), ours(rows)[7:8]).item()


@pytest.mark.parametrize("compiled", ["0", "1"])
@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2-moe"])
def test_served_through_its_records_concurrent_replies_equal_the_ones_served_alone(name, through_records, monkeypatch,
                                                                                   compiled):
    monkeypatch.setenv(COMPILE_ENV, compiled)  # "1": each layer's cache-free parts mx.compile'd, as on a GPU
    model, tokenizer, _ = load_model(name, BF16)
    requests = [GenerationRequest(prompt_ids=tokenizer.encode(text), max_tokens=12, sampling=sampling)
                for text in PROMPTS for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=5))]
    run = Run(model, parallel=len(requests))
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    run.finish()
    for sid, request in enumerate(requests):
        assert run.tokens(sid) == solo(model, serial(request))


def test_a_served_conv_call_is_one_launch_that_reads_the_tail_it_is_given_each_time(monkeypatch):
    from tensorfold_contract import serving
    from tensorfold_lfm2.kernels.conv import RECORD

    launches = []

    def kernel(inputs, **launch):  # stands in for the built cuda kernel: what one launch would be given
        launches.append(inputs)
        return [mx.zeros(shape, dtype) for shape, dtype in zip(launch["output_shapes"], launch["output_dtypes"])]

    monkeypatch.setattr(serving, "_kernel", lambda kind, source, shared: kernel)
    conv = nn.Conv1d(8, 8, kernel_size=3, groups=8, bias=False)
    conv.weight = conv.weight.astype(mx.bfloat16)
    served = ServedConv(conv, RECORD, "cuda")
    rows = mx.ones((4, 8), mx.bfloat16)
    for fill in (1, 2):
        tail = mx.full((1, 2, 8), fill, mx.bfloat16)
        convolved, states = served.run(tail, rows)
        assert convolved.shape == (4, 8) and states.shape == (4, 2, 8)
        assert mx.array_equal(launches[-1][0], tail[0]).item()  # this call's tail, not the first's
    assert launches[0][4] is launches[1][4]  # the dims array made once for 4 rows


def test_through_its_records_a_window_kept_in_part_leaves_the_conv_tails_of_one_row_steps(through_records):
    # the stream conv record's per-row states are what keep() commits: a window cut after 3 rows (drafts rejected)
    # and 3 one-row steps hold the same tails, marks included, and give the same next logits
    model, tokenizer, _ = load_model("tiny-lfm2", BF16)
    ids = tokenizer.encode(PROMPTS[2])
    window, stepped = model.new_cache(64, marks=2), model.new_cache(64, marks=2)
    model.forward([window], [ids], [len(ids)])
    model.keep(window, 3)
    for token in ids[:3]:
        model.forward([stepped], [[token]], [1])
        model.keep(stepped, 1)
    assert all(mx.array_equal(a, b).item() for a, b in zip(window.conv, stepped.conv))
    assert all(mx.array_equal(a, b).item() for a, b in zip(window.kept_conv[2], stepped.kept_conv[2]))
    after = [model.forward([cache], [ids[3:5]], [2]) for cache in (window, stepped)]
    assert mx.array_equal(*after).item()


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2-moe"])
def test_compiled_layers_fold_norms_residuals_and_swiglu_into_their_launches_with_the_logits_of_launches_apart(
        name, through_records, monkeypatch):
    from tensorfold_core.row_kernels.modules import FUSED_ENV, RecordNormed, RecordResidual, RecordSwiglu

    monkeypatch.setenv(COMPILE_ENV, "1")
    model, tokenizer, _ = load_model(name, BF16)
    dense = [layer for layer in model.model.layers if "w1" in layer.feed_forward or "gate_proj" in layer.feed_forward]
    assert dense and all(isinstance(layer.normed_in, RecordNormed) and isinstance(layer.op.out_residual, RecordResidual)
                         for layer in model.model.layers)
    assert all(isinstance(layer.normed_swiglu, RecordNormed) and isinstance(layer.feed_forward.swiglu, RecordSwiglu)
               for layer in dense)
    assert model.kernels["projection bf16 rmsnorm swiglu"] == "lfm2 gemv bf16 rmsnorm gate|up swiglu (mlx)"
    monkeypatch.setenv(FUSED_ENV, "0")
    apart, _, _ = load_model(name, BF16)
    assert not any(layer.normed_in or layer.normed_swiglu or layer.op.out_residual for layer in apart.model.layers)
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        ours, theirs = (m.forward([m.new_cache(64)], [ids], [len(ids)]) for m in (model, apart))
        assert mx.array_equal(ours, theirs).item()


def test_a_served_moe_block_runs_only_the_experts_its_rows_picked(through_records, monkeypatch):
    from tensorfold_core.row_kernels import modules

    recorded, builtin, _ = _models("tiny-lfm2-moe", monkeypatch)
    ours, theirs = recorded.model.layers[-1].feed_forward, builtin.model.layers[-1].feed_forward
    ran = []
    launch = modules.RecordLinear.__call__

    def counted(self, x):
        ran.append((id(self.inner), x.shape[0]))
        return launch(self, x)

    monkeypatch.setattr(modules.RecordLinear, "__call__", counted)
    row = (mx.random.normal((1, 256), key=mx.random.key(4)) * 0.5).astype(mx.bfloat16)
    assert mx.array_equal(ours(row), theirs(row)).item()
    # the router's gate, then gate, up and down of the two experts the row picked: not all eight
    assert len(ran) == 1 + 3 * ours.inner.top_k and all(rows == 1 for _, rows in ran)
    # a group's rank runs every expert over every row (no read of the picks mid-forward): the same bits
    object.__setattr__(ours, "gather", False)
    ran.clear()
    rows = (mx.random.normal((9, 256), key=mx.random.key(5)) * 0.5).astype(mx.bfloat16)
    assert mx.array_equal(ours(rows), theirs(rows)).item() and len(ran) == 1 + 3 * 8


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2-moe"])
def test_compiled_layer_parts_give_the_logits_of_op_by_op_layers_bit_for_bit(name, through_records, monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "1")
    compiled, tokenizer, _ = load_model(name, BF16)
    layers = compiled.model.layers
    # an MoE layer's after part reads its picks on the host: it runs op by op
    assert [type(half) is MethodType for half in layers[0].halves] == [False, isinstance(layers[0].feed_forward,
                                                                                          ServedMoe)]
    monkeypatch.setenv(COMPILE_ENV, "0")
    plain, _, _ = load_model(name, BF16)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    caches = {id(m): [m.new_cache(64) for _ in prompts] for m in (compiled, plain)}
    for windows in (prompts, [[7, 8, 9]] * 3, [[11]] * 3):  # conv and attention layers over ragged windows
        ours, theirs = (m.forward(caches[id(m)], windows, [len(w) for w in windows]) for m in (compiled, plain))
        assert mx.array_equal(ours, theirs).item()
        for m in (compiled, plain):
            for cache, window in zip(caches[id(m)], windows):
                m.keep(cache, len(window))


def test_a_group_rank_compiles_no_layer_part(through_records, monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "1")
    rank, _, _ = load_model("tiny-lfm2", LoadOptions(dtype="bfloat16", shard=(1, 2)))
    assert all(layer.halves is None for layer in rank.model.layers)  # op by op


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2-moe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_cpu_attention_layers_rope_a_row_at_a_time_in_their_compiled_part_with_the_logits_of_a_rope_a_stream(
        name, dtype, monkeypatch):
    from tensorfold_core.row_kernels.modules import ROPE_ROWS_ENV

    for env in (COMPILE_ENV, KERNELS_ENV, ROPE_ROWS_ENV):  # as shipped
        monkeypatch.delenv(env, raising=False)
    served, tokenizer, _ = load_model(name, LoadOptions(dtype=dtype))
    monkeypatch.setenv(ROPE_ROWS_ENV, "0")
    per_stream, _, _ = load_model(name, LoadOptions(dtype=dtype))
    monkeypatch.setenv(COMPILE_ENV, "0")
    op_by_op, _, _ = load_model(name, LoadOptions(dtype=dtype))
    attention = [i for i, layer in enumerate(served.model.layers) if layer.is_attention_layer]
    assert attention and all(served.model.layers[i].self_attn.roped for i in attention) and served.roped
    assert not any(m.model.layers[attention[0]].self_attn.roped or m.roped for m in (per_stream, op_by_op))
    assert logits_alike([served, per_stream, op_by_op], [tokenizer.encode(text) for text in PROMPTS])
