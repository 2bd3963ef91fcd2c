"""The llama family's op table: built-ins on the CPU, its kernel records where the table names them, same tokens."""

from __future__ import annotations

from types import MethodType

import mlx.core as mx
import mlx.nn as nn
import pytest

from tensorfold_core import traces
from tensorfold_core.capabilities import capabilities
from tensorfold_core.kernels import BUILTIN, KERNELS_ENV, describe, missing_records, served
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import load_model, start_drafter
from tensorfold_core.options import ServeOptions
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.specs import DrafterOptions, LoadOptions
from tensorfold_core.testing import Run, forward_alike, serial, solo
from tensorfold_llama.kernels import records
from tensorfold_llama.ops import OPS
from tensorfold_core.row_kernels.modules import COMPILE_ENV, RecordLinear, RecordNorm

PROMPTS = ["import os\nimport", "def main(argv):\n", "class Point:\n    def __init__(self"]


def test_every_record_the_table_names_exists_with_the_implementation_its_backend_runs():
    assert missing_records(OPS, records()) == []


def test_the_cpu_serves_every_op_through_mlx_built_ins_and_capabilities_show_the_table(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)  # the table's own choice, whatever the run overrides
    model, _, _ = load_model("tiny-llama")
    assert model.kernels == {op: BUILTIN for op in OPS}
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear) and model.served_head is None
    family = next(f for f in capabilities(ServeOptions())["families"] if f["name"] == "llama")
    assert family["kernels"] == describe(OPS) and family["kernels"]["table"]["projection bf16"]["cuda"] == \
        "llama gemv bf16"


def test_capabilities_call_a_record_its_switch_turns_off_unused_and_leave_the_others_as_the_table_chose(
        monkeypatch):
    from tensorfold_core.kernels import STACK_KV_ENV, STREAMS_ENV

    monkeypatch.setenv(KERNELS_ENV, "records")  # every op with a record through it, as a GPU's table does
    assert describe(OPS)["serving"]["attention streams"] == "llama window attention streams (mlx)"
    monkeypatch.setenv(STACK_KV_ENV, "0")
    serving = describe(OPS)["serving"]
    assert serving["stack kv"] == f"mlx (llama stack kv (mlx) unused: {STACK_KV_ENV}=0)"
    assert serving["attention streams"] == "llama window attention streams (mlx)"
    monkeypatch.setenv(STREAMS_ENV, "0")
    serving = describe(OPS)["serving"]
    assert serving["attention streams"] == f"mlx (llama window attention streams (mlx) unused: {STREAMS_ENV}=0)"
    assert serving["stack kv"].endswith(f"unused: {STREAMS_ENV}=0)")  # the first switch that turns it off
    assert serving["attention"] == "llama window attention (mlx)"


def test_on_cuda_the_table_serves_the_gemv_and_window_attention_records_and_mlx_s_row_invariant_rms_norm():
    chosen = served(OPS, "cuda")
    assert chosen["projection bf16"] == "llama gemv bf16" and chosen["rms_norm"] == BUILTIN
    assert chosen["attention"] == "llama window attention"


@pytest.fixture
def through_records(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "records")


def test_served_through_its_records_the_shipped_model_stays_within_bf16_rounding_of_the_built_ins(through_records,
                                                                                                  monkeypatch):
    recorded, tokenizer, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert isinstance(recorded.model.layers[0].mlp.down_proj, RecordLinear)
    assert isinstance(recorded.model.norm, RecordNorm) and isinstance(recorded.served_head, RecordLinear)
    assert recorded.model.layers[0].self_attn.attend is not None
    assert recorded.kernels["projection bf16"] == "llama gemv bf16 (mlx)"
    monkeypatch.setenv(KERNELS_ENV, "builtin")
    builtin, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    for text in PROMPTS:  # the window attention sums in its own fixed order: the last bf16 bits may differ
        ids = tokenizer.encode(text)
        ours, theirs = (m.forward([m.new_cache(64)], [ids], [len(ids)]) for m in (recorded, builtin))
        assert mx.abs(ours - theirs).max().item() <= 4 * 2.0 ** -7 * mx.abs(theirs).max().item()


@pytest.mark.parametrize("compiled", ["0", "1"])
def test_served_through_its_records_drafted_and_concurrent_replies_equal_the_plain_ones(through_records, monkeypatch,
                                                                                        compiled):
    monkeypatch.setenv(COMPILE_ENV, compiled)  # "1": each layer's cache-free parts mx.compile'd, as on a GPU
    model, tokenizer, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    drafter = start_drafter("tiny-llama-drafter", model, tokenizer, DrafterOptions(dtype="bfloat16"))
    requests = [GenerationRequest(prompt_ids=tokenizer.encode(text), max_tokens=16, sampling=sampling)
                for text in PROMPTS for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=5))]
    run = Run(model, parallel=len(requests))
    run.engine.drafter = drafter
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    run.finish()
    assert sum(run.done(sid).usage["tensorfold"]["accepted"] for sid in range(len(requests))) > 0
    for sid, request in enumerate(requests):
        assert run.tokens(sid) == solo(model, serial(request))


def test_the_drafter_serves_its_targets_records_and_mlx_s_own_ops_when_told(through_records, monkeypatch):
    from tensorfold_llama.drafter import DRAFTER_BUILTIN_ENV

    model, tokenizer, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    drafter = start_drafter("tiny-llama-drafter", model, tokenizer, DrafterOptions(dtype="bfloat16"))
    assert drafter.model.kernels == model.kernels and model.kernels["projection bf16"] == "llama gemv bf16 (mlx)"
    assert not isinstance(drafter.model.model.layers[0].mlp.down_proj, nn.Linear)
    assert drafter.model.model.layers[0].self_attn.attend is not None
    monkeypatch.setenv(DRAFTER_BUILTIN_ENV, "1")
    drafter = start_drafter("tiny-llama-drafter", model, tokenizer, DrafterOptions(dtype="bfloat16"))
    assert drafter.model.kernels == {op: BUILTIN for op in OPS}
    assert isinstance(drafter.model.model.layers[0].mlp.down_proj, nn.Linear) and drafter.model.served_head is None
    assert drafter.model.model.layers[0].self_attn.attend is None


def test_ops_listed_as_built_in_leave_their_records_and_an_unknown_op_is_named(monkeypatch):
    from tensorfold_core.errors import OptionError
    from tensorfold_core.kernels import BUILTIN_OPS_ENV

    monkeypatch.setenv(KERNELS_ENV, "records")
    monkeypatch.setenv(BUILTIN_OPS_ENV, "attention, projection bf16")
    chosen = served(OPS, "cuda")
    assert chosen["attention"] == chosen["projection bf16"] == BUILTIN
    assert chosen["rms_norm"] == "llama rmsnorm" and chosen["projection q4"] == "llama gemv q4"
    monkeypatch.setenv(BUILTIN_OPS_ENV, "attenion")
    with pytest.raises(OptionError, match=f"{BUILTIN_OPS_ENV}: no op 'attenion'"):
        served(OPS, "cuda")


def test_an_unknown_override_names_the_variable(monkeypatch):
    from tensorfold_core.errors import OptionError

    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(OptionError, match=f"{KERNELS_ENV}=fast: expected table, builtin or records"):
        served(OPS)


def test_a_prepared_record_call_is_one_launch_with_the_module_s_current_weights_and_its_dims_made_once(monkeypatch):
    from tensorfold_contract import serving
    from tensorfold_llama.kernels.gemv import BF16

    launches = []

    def kernel(inputs, **launch):  # stands in for the built cuda kernel: what one launch would be given
        launches.append((inputs, launch))
        return [mx.zeros(launch["output_shapes"][0], launch["output_dtypes"][0])]

    monkeypatch.setattr(serving, "_kernel", lambda kind, source, shared: kernel)
    weights = {"w": mx.zeros((40, 64), mx.bfloat16)}
    prepared = serving.Prepared("cuda", BF16.implementations["cuda"], {"n": 40, "k": 64, "out": "bfloat16"},
                                lambda: weights, "x")
    x = mx.ones((5, 64), mx.bfloat16)
    assert prepared(x)["y"].shape == (5, 40)
    weights["w"] = mx.ones((40, 64), mx.bfloat16)  # new weights are served at the next call
    prepared(x + 1)
    (first, launch), (second, _) = launches
    assert second[0] is not first[0] and second[1] is weights["w"] and second[2] is first[2]  # dims kept
    assert first[2].tolist() == [5, 40, 64] and launch["output_dtypes"] == [mx.bfloat16]
    assert prepared(mx.zeros((0, 64), mx.bfloat16))["y"].shape == (0, 40) and len(launches) == 2  # nothing to launch


def test_a_tied_4_bit_embedding_is_served_as_the_head_through_the_q4_record(through_records):
    # on CUDA MLX's quantized head is not row-invariant: left to it, the probe of a 4-bit target fails there
    model, _, _ = load_model("tiny-llama-drafter-4bit", LoadOptions(dtype="bfloat16"))
    embed = model.model.embed_tokens
    assert isinstance(embed, nn.QuantizedEmbedding) and isinstance(model.served_head, RecordLinear)
    assert model.kernels["projection q4"] == "llama gemv q4 (mlx)"
    rows = mx.random.normal((6, model.args.hidden_size), key=mx.random.key(1)).astype(mx.bfloat16)
    assert mx.array_equal(model.served_head(rows), embed.as_linear(rows)).item()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-drafter-4bit"])
def test_q_k_v_and_gate_up_are_each_one_launch_whose_parts_equal_their_own_launches_bit_for_bit(through_records,
                                                                                               name):
    from tensorfold_core.row_kernels.modules import RecordFused

    model, _, _ = load_model(name, LoadOptions(dtype="bfloat16"))
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(attn.qkv, RecordFused) and isinstance(mlp.gate_up, RecordFused)
    rows = mx.random.normal((5, model.args.hidden_size), key=mx.random.key(2)).astype(mx.bfloat16)
    parts = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
    together = attn.qkv(rows) + mlp.gate_up(rows)
    assert [tuple(y.shape) for y in together] == [(5, p.weight.shape[0]) for p in parts]
    for part, y in zip(parts, together):
        assert isinstance(part, RecordLinear) and mx.array_equal(part(rows), y).item()
    # each part's weights are a view of the stack, so the model holds them once
    stacked = attn.qkv.launch.fixed()
    assert sum(p.weight.nbytes for p in parts[:3]) == next(iter(stacked.values())).nbytes


def test_projections_are_launched_one_by_one_where_fusing_is_turned_off(through_records, monkeypatch):
    from tensorfold_core.row_kernels.modules import FUSED_ENV

    monkeypatch.setenv(FUSED_ENV, "0")
    monkeypatch.setenv(COMPILE_ENV, "1")
    model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv is None and layer.mlp.gate_up is None
    assert layer.self_attn.o_residual is None and layer.mlp.down_residual is None


def test_compiled_layers_add_the_residual_in_o_proj_and_down_proj_and_gate_up_s_launch_stores_swiglu(
        through_records, monkeypatch):
    from tensorfold_core.row_kernels.modules import RecordResidual, RecordSwiglu

    monkeypatch.setenv(COMPILE_ENV, "1")
    model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(attn.o_residual, RecordResidual) and isinstance(mlp.down_residual, RecordResidual)
    assert isinstance(mlp.swiglu, RecordSwiglu)
    assert model.kernels["projection bf16 swiglu"] == "llama gemv bf16 gate|up swiglu (mlx)"
    d = model.args.hidden_size
    x, h = (mx.random.normal((5, d), key=mx.random.key(k)).astype(mx.bfloat16) for k in (3, 4))
    assert mx.array_equal(attn.o_residual(x, h), h + attn.o_proj(x)).item()
    gate, up = mlp.gate_up(x)
    assert mx.array_equal(mlp.swiglu(x), nn.silu(gate) * up).item()
    assert mx.array_equal(mlp.down_residual(mlp.swiglu(x), h), h + mlp.down_proj(nn.silu(gate) * up)).item()
    monkeypatch.setenv(COMPILE_ENV, "0")  # op by op (as on the CPU by default): each op its own call
    apart, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert apart.model.layers[0].self_attn.o_residual is None and apart.model.layers[0].mlp.down_residual is None


def test_compiled_layers_read_their_norms_in_the_q_k_v_and_gate_up_launches_bit_for_bit_and_apart_when_asked(
        through_records, monkeypatch):
    from tensorfold_core.row_kernels.modules import NORM_ENV, RecordNormed

    monkeypatch.setenv(COMPILE_ENV, "1")
    model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    layer = model.model.layers[1]
    assert isinstance(layer.normed_qkv, RecordNormed) and isinstance(layer.normed_swiglu, RecordNormed)
    assert model.kernels["projection bf16 rmsnorm"] == "llama gemv bf16 rmsnorm (mlx)"
    assert model.kernels["projection bf16 rmsnorm swiglu"] == "llama gemv bf16 rmsnorm gate|up swiglu (mlx)"
    scales = mx.array([[0.01], [1.0], [30.0], [2.0], [500.0]])  # rows of every size: each its own norm
    x = (mx.random.normal((5, model.args.hidden_size), key=mx.random.key(6)) * scales).astype(mx.bfloat16)
    assert mx.array_equal(layer.normed_qkv(x), layer.self_attn.qkv.joined(layer.input_layernorm(x))).item()
    assert mx.array_equal(layer.normed_swiglu(x), layer.mlp.swiglu(layer.post_attention_layernorm(x))).item()
    monkeypatch.setenv(NORM_ENV, "0")
    apart, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert apart.model.layers[1].normed_qkv is None and apart.model.layers[1].normed_swiglu is None


def test_asked_compiled_layers_store_roped_heads_from_the_normed_q_k_v_launch_bit_for_bit_and_apart_by_default(
        through_records, monkeypatch):
    from tensorfold_llama.serving import ROPE_IN_ENV, NormedRopedQKV

    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(ROPE_IN_ENV, "1")
    model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    layer = model.model.layers[1]
    assert isinstance(layer.normed_roped_qkv, NormedRopedQKV)
    assert model.kernels["projection bf16 rmsnorm rope neox"] == "llama gemv bf16 rmsnorm rope qkv neox (mlx)"
    x = (mx.random.normal((5, model.args.hidden_size), key=mx.random.key(8)) * 4).astype(mx.bfloat16)
    positions = mx.array([3, 4, 900, 17, 0], mx.int32)
    ours = layer.normed_roped_qkv(x, positions)
    theirs = layer.self_attn.rope_qkv(layer.normed_qkv(x), positions)
    assert [a.shape for a in ours] == [b.shape for b in theirs]
    assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs))
    assert not mx.array_equal(ours[0], layer.normed_roped_qkv(x, positions + 1)[0]).item()  # each row's position
    monkeypatch.delenv(ROPE_IN_ENV)
    apart, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert apart.model.layers[1].normed_roped_qkv is None and apart.model.layers[1].normed_qkv is not None


def test_a_4_bit_model_keeps_its_norms_apart_since_only_bf16_weights_read_normed_rows(through_records, monkeypatch):
    from tensorfold_llama.serving import ROPE_IN_ENV

    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(ROPE_IN_ENV, "1")  # even asked, rope has no normed launch to be stored by
    model, _, _ = load_model("tiny-llama-drafter-4bit", LoadOptions(dtype="bfloat16"))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv is not None and layer.self_attn.rope_qkv is not None  # one launch each, q4
    assert layer.normed_qkv is None and layer.normed_swiglu is None and layer.normed_roped_qkv is None


def test_asked_to_down_proj_reads_gate_up_s_output_through_swiglu_as_before(through_records, monkeypatch):
    from tensorfold_core.row_kernels.modules import SWIGLU_ENV

    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(SWIGLU_ENV, "down")
    model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    mlp = model.model.layers[0].mlp
    assert mlp.swiglu is None
    assert model.kernels["projection bf16 swiglu residual"] == "llama gemv bf16 swiglu + residual (mlx)"
    x, h = (mx.random.normal((5, model.args.hidden_size), key=mx.random.key(k)).astype(mx.bfloat16) for k in (3, 4))
    gate, up = mlp.gate_up(x)
    assert mx.array_equal(mlp.down_residual(mlp.gate_up.joined(x), h), h + mlp.down_proj(nn.silu(gate) * up)).item()


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}])
def test_one_launch_ropes_q_and_k_into_their_heads_as_the_layer_s_own_rope_does_at_each_row_s_position(
        through_records, rope):
    from tensorfold_core.kernels import records_served
    from tensorfold_core.row_kernels.modules import fused
    from tensorfold_llama.model import Attention, ModelArgs
    from tensorfold_llama.serving import roped_qkv

    args = ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=1, intermediate_size=256,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64, rope_theta=500000.0,
                     rope_parameters=rope)
    attn = Attention(args)
    attn.set_dtype(mx.bfloat16)
    usable, kind, _ = records_served(OPS, records)
    object.__setattr__(attn, "qkv", fused([attn.q_proj, attn.k_proj, attn.v_proj], usable, kind, mx.bfloat16))
    one = roped_qkv(attn, usable, kind, mx.bfloat16)
    x = mx.random.normal((5, 128), key=mx.random.key(5)).astype(mx.bfloat16)
    positions = mx.array([3, 4, 900, 17, 0], mx.int32)  # any position a row: windows of several streams
    ours = one(attn.qkv.joined(x), positions)
    theirs = attn.project_roped(x, positions)  # rope_qkv unset: slices, reshapes and the layer's mx.fast.rope
    assert [tuple(a.shape) for a in ours] == [(5, 4, 32), (5, 2, 32), (5, 2, 32)]
    assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs))


def test_q_k_and_v_are_sliced_and_roped_op_by_op_where_the_one_launch_rope_is_turned_off(through_records,
                                                                                       monkeypatch):
    from tensorfold_llama.serving import ROPE_QKV_ENV

    monkeypatch.setenv(COMPILE_ENV, "1")
    model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert model.model.layers[0].self_attn.rope_qkv is not None
    monkeypatch.setenv(ROPE_QKV_ENV, "0")
    apart, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert apart.model.layers[0].self_attn.rope_qkv is None and apart.model.layers[0].self_attn.roped


@pytest.mark.parametrize("rope_rows", ["0", "1"])
def test_compiled_layer_parts_give_the_logits_of_op_by_op_layers_bit_for_bit_for_any_windows(through_records,
                                                                                             monkeypatch, rope_rows):
    from tensorfold_core.row_kernels.modules import ROPE_ROWS_ENV

    monkeypatch.setenv(COMPILE_ENV, "1")
    monkeypatch.setenv(ROPE_ROWS_ENV, rope_rows)
    compiled, tokenizer, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert type(compiled.model.layers[0].halves[0]) is not MethodType  # mx.compile's wrapper
    # "1": rope moved into the compiled part, one position a row, and every stream's attention one launch a layer
    assert compiled.model.layers[0].self_attn.roped == compiled.stacked == (rope_rows == "1")
    monkeypatch.setenv(COMPILE_ENV, "0")
    plain, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert plain.model.layers[0].halves is None and not plain.model.layers[0].self_attn.roped  # op by op
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    caches = {id(m): [m.new_cache(64) for _ in prompts] for m in (compiled, plain)}
    for windows in (prompts, [[7, 8, 9]] * 3, [[11]] * 3):  # three streams' windows a forward, of ragged rows
        ours, theirs = (m.forward(caches[id(m)], windows, [len(w) for w in windows]) for m in (compiled, plain))
        assert mx.array_equal(ours, theirs).item()
        for m in (compiled, plain):
            for cache, window in zip(caches[id(m)], windows):
                m.keep(cache, len(window))


def compiled_with_and_without(monkeypatch, env: str):
    """tiny-llama in bf16 with its layers compiled, as served, then again with `env` set to "0"; and its tokenizer."""
    monkeypatch.setenv(COMPILE_ENV, "1")
    served, tokenizer, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    monkeypatch.setenv(env, "0")
    apart, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    return served, apart, tokenizer


def assert_same_stacked_caches(ours: list, theirs: list) -> None:
    """Stacked caches holding the same committed keys and values, bit for bit."""
    for a, b in zip(ours, theirs):
        n = a.offset
        assert n == b.offset and mx.array_equal(a.k[:, :, :n], b.k[:, :, :n]).item()
        assert mx.array_equal(a.v[:, :, :n], b.v[:, :, :n]).item()


def test_ten_streams_attending_in_launches_of_eight_give_the_logits_and_caches_of_one_launch_a_stream(through_records,
                                                                                                    monkeypatch):
    from tensorfold_llama.cache import StackedKV
    from tensorfold_llama.serving import STREAMS_ENV

    packed, apart, tokenizer = compiled_with_and_without(monkeypatch, STREAMS_ENV)
    assert packed.stacked and isinstance(packed.new_cache(8), StackedKV) and not apart.stacked
    stacked = packed.new_cache(96)  # the ledger's price of a cache is what a stacked one holds
    assert sum(a.nbytes for a in stacked.keys + stacked.values) == packed.cache_bytes(96) == apart.cache_bytes(96)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    prompts = [prompts[i % len(prompts)][:5 + 3 * i] for i in range(10)]  # ten streams, ragged prompts
    caches = {id(m): [m.new_cache(96) for _ in prompts] for m in (packed, apart)}
    for windows in (prompts, [[7, 8, 9, 10]] * 10, [[11]] * 10, [[12, 13]] * 4):  # the last: four streams only
        forward_alike((packed, apart), caches, windows)
    for ours, theirs in zip(caches[id(packed)], caches[id(apart)]):  # each layer's committed keys and values
        n = ours.offset
        assert n == theirs.offset and all(mx.array_equal(ours.k[layer, :, :n], theirs.keys[layer][0, :, :n]).item()
                                          and mx.array_equal(ours.v[layer, :, :n], theirs.values[layer][0, :, :n])
                                          .item() for layer in range(len(theirs.keys)))


def test_the_layers_keys_stacked_by_the_table_s_record_fill_the_caches_as_mlx_s_stack_does(through_records,
                                                                                            monkeypatch):
    from tensorfold_core.row_kernels.stack import STACKS
    from tensorfold_llama.serving import STACK_KV_ENV

    served, apart, tokenizer = compiled_with_and_without(monkeypatch, STACK_KV_ENV)
    assert served.stack_kv is STACKS["mlx"] and apart.stack_kv is None
    assert served.kernels["stack kv"] == "llama stack kv (mlx)"
    assert apart.kernels["stack kv"] == f"mlx (llama stack kv (mlx) unused: {STACK_KV_ENV}=0)"
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    caches = {id(m): [m.new_cache(64) for _ in prompts] for m in (served, apart)}
    for windows in (prompts, [[7, 8]] * 3):
        for m in (served, apart):
            m.forward(caches[id(m)], windows, [len(w) for w in windows])
            for cache, window in zip(caches[id(m)], windows):
                m.keep(cache, len(window))
    assert_same_stacked_caches(caches[id(served)], caches[id(apart)])


def test_a_forward_compiled_whole_gives_the_logits_and_caches_of_its_layers_called_one_by_one(through_records,
                                                                                              monkeypatch):
    from tensorfold_llama.serving import WHOLE_ENV

    whole, apart, tokenizer = compiled_with_and_without(monkeypatch, WHOLE_ENV)
    assert whole.whole is not None and apart.whole is None and whole.whole_spans  # MLX's attention reads offsets
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    prompts = [prompts[i % len(prompts)][:4 + 2 * i] for i in range(10)]  # ten streams: two launches a layer
    caches = {id(m): [m.new_cache(64 + 8 * (i % 2)) for i in range(10)] for m in (whole, apart)}
    for windows in (prompts, [[7, 8, 9]] * 10, [[11]] * 10, [[11]] * 10, [[11]] * 10, [[12, 13]] * 3):
        forward_alike((whole, apart), caches, windows)
    # each step's spans are in its key here, so only the repeated step (its one row unkept) met its key again: traced
    # the second time, replayed the third; the three steps met once ran their layers' parts, untraced
    assert len(whole.whole.compiled) == 1 and len(whole.whole.met) == 3
    assert_same_stacked_caches(caches[id(whole)], caches[id(apart)])


def test_a_whole_forward_padded_to_a_multiple_of_eight_rows_gives_the_logits_and_caches_of_one_unpadded(
        through_records, monkeypatch):
    from tensorfold_core.row_kernels.step_arrays import PAD_ROWS_ENV
    from tensorfold_llama.serving import WHOLE_ENV

    monkeypatch.setenv(PAD_ROWS_ENV, "8")
    padded, plain, _ = compiled_with_and_without(monkeypatch, WHOLE_ENV)
    # on the CPU MLX's attention keys the trace by spans, so serving pads nothing there: padded here to prove the rows
    assert padded.pad_rows == 0 and padded.whole is not None
    padded.pad_rows = 8
    caches = {id(m): [m.new_cache(64) for _ in range(5)] for m in (padded, plain)}
    # prompts of 3 to 7 ids (25 -> 32), then windows of 1 to 5 rows (15 -> 16), then 3 x 3 (9 -> 16)
    for windows in ([list(range(20 + i, 23 + 2 * i)) for i in range(5)], [[7 + i] * (1 + i) for i in range(5)],
                    [[12, 13, 14]] * 3):
        forward_alike((padded, plain), caches, windows)
    assert_same_stacked_caches(caches[id(padded)], caches[id(plain)])
    assert sorted(key[0] for key in padded.whole.met) == [16, 16, 32]  # each key's row count: 25, 15 and 9 padded


def test_a_dropped_model_whose_forward_was_compiled_whole_frees_its_layers(through_records, monkeypatch):
    import gc
    import weakref

    monkeypatch.setenv(COMPILE_ENV, "1")
    model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    cache = model.new_cache(32)
    for kept in (0, 3):  # the same shape twice: traced the second time
        model.forward([cache], [[1, 2, 3]], [3])
        model.keep(cache, kept)
    assert len(model.whole.compiled) == 1  # a trace holds the layers' weights as its constants
    layer = weakref.ref(model.model.layers[0])
    del model, cache
    gc.collect()
    assert layer() is None  # MLX's compile cache let go of the trace, and the trace of the layers


def test_the_stack_kernels_refuse_what_they_cannot_copy_with_why():
    import mlx.core as mx

    from tensorfold_core.row_kernels.stack import MAX_LAYERS, launch

    with pytest.raises(ValueError, match="1 to 32 layers|layers: the stack kernels take 1 to"):
        launch(4, MAX_LAYERS + 1, 2, 32, mx.bfloat16)
    with pytest.raises(ValueError, match="copy 8 at a time"):
        launch(4, 2, 1, 4, mx.bfloat16)
    assert launch(3, 16, 8, 64, mx.bfloat16).output_shapes == ((3, 16, 8, 64),) * 2


def test_a_model_deeper_than_the_stack_kernel_or_a_forward_of_no_rows_stacks_with_mlx_s_ops():
    import mlx.core as mx

    from tensorfold_core.row_kernels.stack import MAX_LAYERS, STACKS

    for layers, rows in ((MAX_LAYERS + 1, 3), (4, 0)):  # neither builds a kernel (none could run on this CPU)
        keys = [mx.full((rows, 2, 8), float(j)) for j in range(layers)]
        ks, vs = STACKS["cuda"](keys, [k + 1 for k in keys])
        assert ks.shape == vs.shape == (rows, layers, 2, 8)
        assert mx.array_equal(ks, mx.stack(keys, axis=1)).item() and mx.array_equal(vs, ks + 1).item()


def test_a_shape_compiled_function_keeps_only_its_most_recently_used_traces():
    from tensorfold_core.row_kernels.modules import KeyCompiled, ShapeCompiled

    twice = ShapeCompiled(lambda x: x * 2, keep=2)
    for rows in (1, 2, 1, 3):
        assert twice(mx.ones((rows, 4))).tolist() == [[2.0] * 4] * rows
    assert list(twice.compiled) == [1, 3]  # 2, the least recently used, dropped with its trace
    made = []
    keyed = KeyCompiled(keep=2)
    for key in ("a", "b", "a", "c", "b"):
        keyed.get(key, lambda: made.append(key) or (lambda x: x + 1))
    assert made == ["a", "b", "c", "b"] and list(keyed.compiled) == ["c", "b"]  # b traced again once dropped
    second = KeyCompiled(after=1)  # a key is traced the second time it is met
    before = traces.count()
    got = [second.get(key, lambda: (lambda x: x)) for key in ("a", "b", "a", "a")]
    assert [g is None for g in got] == [True, True, False, False] and got[2] is got[3] and list(second.met) == ["b"]
    assert traces.count() == before + 1  # the one trace is counted, so the round that ran it is left untimed


def test_where_a_forward_is_compiled_whole_without_offsets_caches_come_in_four_sizes_an_octave(through_records,
                                                                                                monkeypatch):
    from tensorfold_core.families import size_class
    from tensorfold_llama.serving import WHOLE_ENV

    whole, apart, _ = compiled_with_and_without(monkeypatch, WHOLE_ENV)
    assert whole.new_cache(100).capacity == 100  # this CPU's whole forward keys on offsets: exact sizes still
    whole.whole_spans = False  # as on a GPU, where a trace is keyed by the caches' shapes
    for limit, size in ((1, 256), (100, 256), (257, 320), (1025, 1280), (1728, 1792)):
        cache = whole.new_cache(limit)
        assert cache.capacity == size == size_class(size)  # a kept state restored at its capacity keeps its size
        assert whole.cache_bytes(limit) == cache.k.nbytes + cache.v.nbytes  # the ledger charges what is held
        assert apart.new_cache(limit).capacity == limit
    assert all(t <= size_class(t) <= max(256, 1.25 * t) for t in range(1, 20000))


def test_a_group_rank_compiles_no_layer_part_since_its_layers_record_their_sums_as_they_run(through_records,
                                                                                            monkeypatch):
    monkeypatch.setenv(COMPILE_ENV, "1")
    rank, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16", shard=(1, 2)))
    assert rank.model.layers[0].halves is None  # op by op


def test_a_drafter_on_the_records_or_on_mlx_s_ops_drafts_and_its_replies_stay_the_plain_ones(through_records,
                                                                                              monkeypatch):
    from tensorfold_core.testing import Run
    from tensorfold_llama.drafter import DRAFTER_BUILTIN_ENV

    target, tokenizer = load_model("tiny-llama")[:2]
    request = GenerationRequest(prompt_ids=tokenizer.encode("def fib(n):\n    if n < 2:\n"), max_tokens=40)
    replies = {}
    for builtin in ("0", "1"):
        monkeypatch.setenv(DRAFTER_BUILTIN_ENV, builtin)
        drafter = start_drafter("tiny-llama-drafter", target, tokenizer)
        run = Run(target, 1)
        run.engine.drafter, run.engine.copy_drafts = drafter, False
        run.submit(0, request)
        run.finish()
        replies[builtin] = (run.tokens(0), run.engine.counters.accepted_tokens)
        drafter.close()
    plain = Run(target, 1)
    plain.submit(0, GenerationRequest(prompt_ids=request.prompt_ids, max_tokens=40, draft=False))
    plain.finish()
    assert replies["1"][0] == replies["0"][0] == plain.tokens(0) and len(plain.tokens(0)) == 40
    assert replies["0"][1] > 0 and replies["1"][1] > 0  # both drafters' drafts land


def test_a_forward_s_positions_and_row_maps_made_by_device_ops_hold_the_host_made_values_for_every_layout(
        monkeypatch):
    from types import SimpleNamespace

    from tensorfold_core.families import Span
    from tensorfold_core.row_kernels.attention_streams import packed
    from tensorfold_core.row_kernels.step_arrays import DEVICE_ARRAYS_ENV, row_positions, rowmap

    layouts = [[(1, 40)], [(5, 0)], [(1, 7), (1, 900)], [(2, 3), (0, 11), (4, 60)], [(1, o) for o in range(8)]]
    for layout in layouts:
        spans, start = [], 0
        for n, offset in layout:
            spans.append(Span(start, n, SimpleNamespace(offset=offset), None))
            start += n
        expected = [offset + i for n, offset in layout for i in range(n)]
        triples = [(s.start, s.n, s.cache.offset) for s in spans]
        made = {}
        for setting in ("1", "0"):
            monkeypatch.setenv(DEVICE_ARRAYS_ENV, setting)
            positions = row_positions(spans)
            made[setting] = (positions.tolist(), rowmap(triples, positions).tolist())
            assert positions.dtype == mx.int32 and positions.tolist() == expected, (layout, setting)
        assert made["1"] == made["0"] == (expected, packed(triples).rowmap.tolist()), layout
