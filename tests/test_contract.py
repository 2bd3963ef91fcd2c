"""The kernel contract on the CPU: the llama records pass, their controls go red, and the runner's own rules hold."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

from tensorfold_contract import (Control, KernelRecord, Launch, Shape, Source, Tolerance, run_contract, shift_rows,
                                 swap, variant)
from tensorfold_contract import devices, gates
from tensorfold_contract.cli import run_cli
from tensorfold_contract.report import summary_line
from tensorfold_core import hookimpl
from tensorfold_core.plugins import new_plugin_manager

SEED = 20261130


@pytest.fixture(scope="module")
def llama_report():
    return run_contract(only=["llama"], seed=SEED)


def test_every_llama_record_passes_gates_1_to_4_on_the_cpu_mlx_implementation(llama_report):
    names = {k.name for k in llama_report.kernels}
    assert {"llama rmsnorm", "llama rope neox", "llama rope interleaved", "llama gemv bf16", "llama gemv q4",
            "llama gemv q8", "llama greedy argmax", "llama keyed draw"} <= names
    for kernel in llama_report.kernels:
        mlx = kernel.implementations["mlx"]
        assert mlx.status == "pass", (kernel.name, {g: r.detail for g, r in mlx.gates.items()})
        assert [mlx.gates[g].status for g in (1, 2, 3, 4)] == ["pass"] * 4
    summary = llama_report.summary()
    assert summary["pass"] == summary["kernels"] and summary["fail"] == 0 and summary["limit_problems"] == 0


def test_every_control_that_can_run_here_is_red_as_planted_and_each_record_has_at_least_two(llama_report):
    for kernel in llama_report.kernels:
        red = [c for c in kernel.controls if c.status == "red"]
        assert len(red) >= 2, kernel.name
        for c in kernel.controls:
            assert c.status in ("red", "not run (no CUDA device)", "not run (no Metal device)"), (kernel.name, c)
    summary = llama_report.summary()
    assert summary["missed"] == 0 and summary["red"] == summary["controls"] > 0


def test_cuda_and_metal_implementations_are_reported_not_run_never_pass(llama_report):
    for kernel in llama_report.kernels:
        for kind, why in (("cuda", "not run (no CUDA device)"), ("metal", "not run (no Metal device)")):
            if kind in kernel.implementations:
                impl = kernel.implementations[kind]
                assert impl.status == why
                assert all(impl.gates[g].status == why for g in (1, 2, 3, 4))
                assert impl.gates[5].status == "pass"  # launch limits need no device
    text = "\n".join(llama_report.lines())
    assert "cuda   not run (no CUDA device)" in text and "metal  not run (no Metal device)" in text
    assert "cuda   pass" not in text and "metal  pass" not in text


def test_the_summary_line_counts_kernels_passes_findings_controls_and_limit_problems(llama_report):
    s = llama_report.summary()
    cuda, metal = s["not_run"]["no CUDA device"], s["not_run"]["no Metal device"]
    assert llama_report.lines()[-1] == (
        f"SUMMARY {s['kernels']} kernels: {s['pass']} pass gates 1-4 where they ran ({cuda + metal} implementations "
        f"not run: {cuda} no CUDA device, {metal} no Metal device), 0 fail, 0 known findings; "
        f"{s['controls']} controls: {s['controls']} red as planted, 0 missed; 0 limit problems")


def test_a_kernel_whose_gpu_implementations_did_not_run_is_never_summed_up_as_a_plain_pass(llama_report):
    cuda = sum("cuda" in k.implementations for k in llama_report.kernels)
    metal = sum("metal" in k.implementations for k in llama_report.kernels)
    assert llama_report.summary()["not_run"] == {"no CUDA device": cuda, "no Metal device": metal}
    assert f"pass gates 1-4 where they ran ({cuda + metal} implementations not run: " in llama_report.lines()[-1]
    # one reason alone is named without a count; a report where everything ran keeps the plain words
    assert summary_line({**llama_report.summary(), "not_run": {"no Metal device": 1}}).startswith(
        f"SUMMARY {len(llama_report.kernels)} kernels: {len(llama_report.kernels)} pass gates 1-4 where they ran "
        "(1 implementation not run: no Metal device), 0 fail")
    assert summary_line({**llama_report.summary(), "not_run": {}}).startswith(
        f"SUMMARY {len(llama_report.kernels)} kernels: {len(llama_report.kernels)} pass gates 1-4, 0 fail")


def test_the_json_report_has_summary_kernels_and_device(llama_report):
    data = llama_report.as_json()
    assert set(data["summary"]) == {"kernels", "pass", "not_run", "fail", "known_findings", "controls", "red",
                                    "missed", "limit_problems"}
    kernel = next(k for k in data["kernels"] if k["name"] == "llama gemv q4")
    assert kernel["family"] == "llama" and kernel["distribution"] == "tensorfold-llama"
    assert set(kernel["implementations"]) == {"mlx", "cuda", "metal"}
    gates = kernel["implementations"]["mlx"]["gates"]
    assert set(gates) == {"1", "2", "3", "4", "5"}
    # each gate that ran says how long it took (where a record's time goes); gate 5 is a check of limits, no run
    assert all(gates[g]["seconds"] >= 0 for g in "1234") and "seconds" not in gates["5"]
    # each figure is rounded to the ms: five roundings of half a ms at most between the sum and the total
    assert sum(gates[g]["seconds"] for g in "1234") <= kernel["implementations"]["mlx"]["seconds"] + 5 * 0.5e-3
    not_run = kernel["implementations"]["cuda"]["gates"]
    assert not any("seconds" in not_run[g] for g in "1234")  # no CUDA here: nothing ran, nothing timed
    assert {"name", "implementation", "gate", "status", "detail"} <= set(kernel["controls"][0])
    assert data["device"]["backend"] == "cpu" and data["device"]["runs"] == ["mlx"]
    assert data["seed"] == SEED


# A toy kernel, registered in-process: y = 2x, with implementations good and bad.

def _double(case):
    return {"y": case.array("x") * 2}


def _toy(name="toy double", impl=_double, controls=None, more=None, **extra) -> KernelRecord:
    return KernelRecord(
        name=name, family="toy",
        make=lambda dims, rows, rng: {"x": rng.standard_normal((rows, dims["n"])).astype(np.float32)},
        reference=lambda case: {"y": 2 * case["x"].astype(np.float64)},
        implementations={"mlx": impl, **(more or {})},
        shapes=(Shape("n=8", {"n": 8}), Shape("n=33", {"n": 33}, 5)),
        edges=(Shape("1 row", {"n": 8}, 1), Shape("empty", {"n": 8}, 0)),
        tolerance=Tolerance(rtol=1e-6), row_inputs=("x",),
        controls=controls if controls is not None else (
            Control("off-by-one row", "mlx", 2, lambda impl: lambda case: shift_rows(impl(case))),
            Control("tripled", "mlx", 2, variant(lambda case: {"y": case.array("x") * 3})),
        ), **extra)


class ToyPlugin:
    def __init__(self, *records):
        self.records = list(records)

    @hookimpl
    def tensorfold_kernels(self):
        return self.records


def _manager(*records, name="toy"):
    pm = new_plugin_manager(entry_points=False)
    pm.register(ToyPlugin(*records), name=name)
    return pm


def test_a_control_that_stays_green_is_missed_and_fails_the_run():
    harmless = Control("a defect that is not one", "mlx", 2, variant(_double))
    report = run_contract(pm=_manager(_toy(controls=(harmless, harmless))), seed=1)
    (kernel,) = report.kernels
    assert kernel.status == "pass"
    assert [c.status for c in kernel.controls] == ["missed", "missed"]
    assert "gate 2 stayed green" in kernel.controls[0].detail
    assert report.summary()["missed"] == 2 and not report.ok
    assert "0 red as planted, 2 missed" in report.lines()[-1]


def test_an_implementation_off_the_reference_fails_gate_2_and_the_run():
    report = run_contract(pm=_manager(_toy(impl=lambda case: {"y": case.array("x") * 2.001})), seed=1)
    mlx = report.kernels[0].implementations["mlx"]
    assert mlx.status == "fail" and mlx.gates[2].status == "fail" and "off by" in mlx.gates[2].detail
    assert report.summary()["fail"] == 1 and not report.ok


def test_a_row_count_dependent_implementation_fails_gate_4_only():
    def wobbly(case):
        x = case.array("x")
        return {"y": x * 2 if case.rows == 1 else (x * 4 + 1e-7) / 2}

    mlx = run_contract(pm=_manager(_toy(impl=wobbly)), seed=1).kernels[0].implementations["mlx"]
    assert [mlx.gates[g].status for g in (1, 2, 3, 4)] == ["pass", "pass", "pass", "fail"]
    assert "differs from its 1-row call" in mlx.gates[4].detail


def test_a_known_finding_excuses_its_gate_and_is_counted():
    from tensorfold_contract import Finding

    bad = _toy(impl=lambda case: {"y": case.array("x") * 2.001},
               findings=(Finding("doubles a little more than twice", "mlx", 2),
                         Finding("doubles a little more than twice", "mlx", 3)))
    report = run_contract(pm=_manager(bad), seed=1)
    mlx = report.kernels[0].implementations["mlx"]
    assert mlx.status == "known findings" and mlx.gates[2].status == "known"
    assert report.summary()["known_findings"] == 2 and report.summary()["fail"] == 0 and report.ok
    cuda_only = _toy(impl=lambda case: {"y": case.array("x") * 2.001},
                     findings=(Finding("only on CUDA", "mlx", 2, backend="cuda"),))
    assert not run_contract(pm=_manager(cuda_only), seed=1).ok


def _source_record(threads: int, grid: int = 64) -> KernelRecord:
    import mlx.core as mx

    source = Source("toy_double", ("x",), ("y",), "y[0] = x[0];", inputs=lambda case: [case.array("x")],
                    launch=lambda case: Launch((grid, 1, 1), (threads, 1, 1), ((case.rows, case.dims["n"]),),
                                               (mx.float32,), static_shared=1024))
    return _toy(more={"cuda": source, "metal": source})


def test_gate_5_counts_limit_problems_against_every_recorded_device_kind():
    report = run_contract(pm=_manager(_source_record(threads=2048)), seed=1)
    kernel = report.kernels[0]
    assert kernel.implementations["cuda"].limit_problems() == {"NVIDIA sm_90"}
    assert kernel.implementations["metal"].limit_problems() == {f"Apple M{n}" for n in range(1, 6)}
    assert report.summary()["limit_problems"] == 6
    assert "2048 threads per group > 1024" in kernel.implementations["cuda"].gates[5].detail
    assert run_contract(pm=_manager(_source_record(threads=256)), seed=1).summary()["limit_problems"] == 0


def test_an_over_sized_threadgroup_control_is_red_at_gate_5_without_a_device():
    from tensorfold_contract import oversize_threadgroup

    record = _source_record(threads=256)
    record = dataclasses.replace(record, controls=record.controls + (
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("a source edit", "cuda", 2, swap("y[0] = x[0];", "y[0] = 0;"))))
    controls = run_contract(pm=_manager(record), seed=1).kernels[0].controls
    assert [c.status for c in controls[2:]] == ["red", "not run (no CUDA device)"]


def test_a_control_whose_source_text_is_gone_cannot_be_planted_and_is_missed():
    record = _source_record(threads=256)
    record = dataclasses.replace(record, controls=record.controls + (
        Control("an edit of text that moved", "cuda", 5, swap("no such text", "x")),))
    control = run_contract(pm=_manager(record), seed=1).kernels[0].controls[-1]
    assert control.status == "missed" and "could not be planted" in control.detail


def test_outputs_a_kernel_never_writes_stay_poison_and_fail_the_reference():
    import mlx.core as mx

    record = _toy()
    source = Source("never_launched", ("x",), ("y",), "", inputs=lambda case: [case.array("x")],
                    launch=lambda case: Launch((0, 1, 1), (32, 1, 1), ((case.rows, 8),), (mx.float32,)))
    case = gates.make_case(record, record.shapes[0], 3, np.random.default_rng(0))
    outs = gates.run_source("cuda", source, case)
    assert np.isnan(np.array(outs["y"])).all()
    ok, why, _ = gates.compare(record, case, outs, record.reference(case))
    assert not ok and "nan" in why.lower()


def test_a_kernel_is_named_by_its_text_so_mlx_never_reuses_a_stale_build():
    source = _source_record(256).implementations["cuda"]
    planted = swap("y[0] = x[0];", "y[0] = 0;")(source)
    assert gates._kernel_name("cuda", source) != gates._kernel_name("cuda", planted)
    assert gates._kernel_name("cuda", source) == gates._kernel_name("cuda", _source_record(512).implementations["cuda"])


def test_only_matches_kernel_family_plugin_and_distribution_names_with_globs():
    pm = _manager(_toy("toy double"), _toy("toy other"), name="toyplug")
    assert [k.name for k in run_contract(only=["toy double"], pm=pm, seed=1).kernels] == ["toy double"]
    assert len(run_contract(only=["toy"], pm=pm, seed=1).kernels) == 2  # the family
    assert len(run_contract(only=["toyplug"], pm=pm, seed=1).kernels) == 2  # the plugin
    assert [k.name for k in run_contract(only=["*other"], pm=pm, seed=1).kernels] == ["toy other"]


def test_a_plugin_hook_that_raises_is_a_failing_kernel_not_a_crash():
    class Broken:
        @hookimpl
        def tensorfold_kernels(self):
            raise RuntimeError("no kernels today")

    pm = new_plugin_manager(entry_points=False)
    pm.register(Broken(), name="broken")
    report = run_contract(pm=pm, seed=1)
    assert report.summary()["fail"] == 1 and "no kernels today" in report.kernels[0].problems[0]


def test_a_record_with_fewer_than_two_controls_fails():
    report = run_contract(pm=_manager(_toy(controls=())), seed=1)
    assert report.kernels[0].status == "fail" and "at least 2" in report.kernels[0].problems[0]


def test_the_cli_exits_0_when_all_pass_1_when_something_failed_and_2_when_only_names_nothing(monkeypatch):
    import tensorfold_contract.cli as cli

    def fake_run(pm):
        return lambda only=(), seed=None, progress=None, isolate=None, jobs=None, seconds=None: run_contract(
            only=only, seed=seed, pm=pm, progress=progress)

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(cli, "run_contract", fake_run(_manager(_toy())))
    assert run_cli(["toy"], False, 1, out, err) == 0 and "SUMMARY 1 kernels: 1 pass gates 1-4, 0" in out.getvalue()
    assert run_cli(["nothing-by-this-name"], False, 1, out, err) == 2
    assert "matches no kernel, family, plugin or distribution" in err.getvalue() and "toy" in err.getvalue()
    monkeypatch.setattr(cli, "run_contract", fake_run(_manager(_toy(impl=lambda case: {"y": case.array("x")}))))
    assert run_cli([], False, 1, out, err) == 1


def test_the_device_is_probed_as_cpu_here_and_limits_are_recorded_for_apple_and_sm90():
    device = devices.current()
    assert device.backend == "cpu" and device.runs == ("mlx",)
    assert device.reason_not_run("metal") == "not run (no Metal device)"
    names = [lim.name for lim in devices.RECORDED]
    assert names == ["Apple M1", "Apple M2", "Apple M3", "Apple M4", "Apple M5", "NVIDIA sm_90"]


def test_a_claimed_bit_equal_replacement_is_held_to_it_at_gate_4():
    same = _toy(bit_equal_to={"mlx": lambda case: {"y": case.array("x") + case.array("x")}})
    assert run_contract(pm=_manager(same), seed=1).kernels[0].implementations["mlx"].gates[4].status == "pass"
    off = _toy(bit_equal_to={"mlx": lambda case: {"y": case.array("x") * 2 + 1e-7}})
    gate = run_contract(pm=_manager(off), seed=1).kernels[0].implementations["mlx"].gates[4]
    assert gate.status == "fail" and "as claimed" in gate.detail


def test_a_zero_size_array_is_read_back_from_its_shape_alone_never_from_mlx_s_buffer():
    import mlx.core as mx

    class Untouchable:  # what MLX 0.32.4 on CUDA handed back for an empty matmul: reading it crashed the H200
        shape, size, dtype = (0, 256), 0, mx.float32

        def __array__(self, *args, **kwargs):
            raise AssertionError("read the buffer of a zero-size array")

        astype = view = __array__

    values, bits = gates.host(Untouchable())
    assert values.shape == bits.shape == (0, 256) and values.dtype == np.float64 and bits.dtype == np.uint32
    for dtype, value_type, bits_type in ((mx.bfloat16, np.float64, np.uint16), (mx.float32, np.float64, np.uint32),
                                         (mx.int32, np.int64, np.uint32), (mx.bool_, np.int64, np.uint8)):
        values, bits = gates.host(mx.zeros((0, 3), dtype))
        assert (values.shape, values.dtype, bits.shape, bits.dtype) == ((0, 3), value_type, (0, 3), bits_type)
    record = _toy()
    case = gates.make_case(record, record.edges[1], 0, np.random.default_rng(0))
    assert gates.compare(record, case, {"y": Untouchable()}, {"y": np.zeros((0, 256))})[0]


def _fake_gpu(mlx_version: str):
    """The CPU dressed as a CUDA device for composed ops: where findings with backend="cuda" apply."""
    return devices.Device("cuda", "a CUDA device (faked on the CPU)", mlx_version, ("mlx",), None)


def _fails_on(*labels):
    def impl(case):
        if case.shape.label in labels:
            raise RuntimeError("cudaGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed: invalid argument")
        return _double(case)

    return impl


def test_a_finding_excuses_only_its_case_symptom_backend_and_mlx_version():
    import mlx.core as mx

    from tensorfold_contract import Finding

    finding = Finding("MLX's empty launch", "mlx", 3, backend="cuda", case="empty", symptom="cudaGraphAddKernelNode",
                      mlx=mx.__version__)
    report = run_contract(pm=_manager(_toy(impl=_fails_on("empty"), findings=(finding,))), seed=1,
                          device=_fake_gpu(mx.__version__))
    mlx = report.kernels[0].implementations["mlx"]
    assert mlx.status == "known findings" and mlx.gates[3].status == "known" and report.ok
    assert mlx.gates[3].detail.startswith("empty: RuntimeError: cudaGraphAddKernelNode")
    assert mlx.gates[3].detail.endswith("[known finding: MLX's empty launch]")
    assert report.summary()["known_findings"] == 1 and mlx.gates[3].as_json()["failed"] == ["empty"]

    def gate_3(record, device):
        return run_contract(pm=_manager(record), seed=1, device=device).kernels[0].implementations["mlx"].gates[3]

    # another red case in the same gate is not excused, and the gate names both
    both = gate_3(_toy(impl=_fails_on("1 row", "empty"), findings=(finding,)), _fake_gpu(mx.__version__))
    assert both.status == "fail" and [label for label, _ in both.failures] == ["1 row", "empty"]
    assert both.detail.startswith("1 row: RuntimeError") and "[known finding: MLX's empty launch]" in both.detail
    # another symptom on the same case, another backend, another MLX version: red
    other = dataclasses.replace(finding, symptom="out of memory")
    assert gate_3(_toy(impl=_fails_on("empty"), findings=(other,)), _fake_gpu(mx.__version__)).status == "fail"
    assert gate_3(_toy(impl=_fails_on("empty"), findings=(finding,)), devices.current()).status == "fail"
    later = gate_3(_toy(impl=_fails_on("empty"), findings=(finding,)), _fake_gpu("9.9.9"))
    assert later.status == "fail"
    assert f"a known finding matches on mlx {mx.__version__}, not on mlx 9.9.9: re-check it there" in later.detail


def test_the_llama_findings_name_edges_of_their_records_and_apply_only_to_mlx_on_cuda():
    from tensorfold_contract.registry import discover

    records = {r.record.name: r.record for r in discover() if r.record is not None}
    named = {}
    for record in records.values():
        for finding in record.findings:
            assert finding.kind == "mlx" and finding.backend == "cuda", (record.name, finding)
            if finding.case is not None:
                assert finding.case in {s.label for s in (*record.shapes, *record.edges)}, (record.name, finding)
                assert finding.mlx == "0.32.4" and finding.symptom
                named.setdefault(record.name, set()).add((finding.gate, finding.case))
    # MLX's one-group bug also names the one served shape of one group: lfm2_moe's expert down on a group's rank
    shard = (2, "tiny-lfm2 expert down, 1 of 2 ranks 256x64")
    assert named == {f"{family} {name}": cases for family in ("llama", "lfm2") for name, cases in
                     (("rmsnorm", {(3, "empty")}),
                      ("gemv q4", {(3, "K=64, one group")} | ({shard} if family == "lfm2" else set())),
                      ("gemv q8", {(3, "K=64, one group")} | ({shard} if family == "lfm2" else set())))}


def test_isolation_finds_records_through_entry_points_so_it_takes_no_plugin_manager():
    with pytest.raises(ValueError, match="pass no pm"):
        run_contract(pm=_manager(_toy()), seed=1, isolate=True)
    assert run_contract(pm=_manager(_toy()), seed=1, device=_fake_gpu("0.32.4")).isolated is False
    assert run_contract(only=["llama rmsnorm"], seed=1).isolated is False  # the CPU runs in one process


def test_the_bf16_gemv_cuda_tail_control_edits_a_path_that_an_edge_shape_runs():
    from tensorfold_contract.registry import discover

    record = next(r.record for r in discover() if r.record is not None and r.record.name == "llama gemv bf16")
    control = next(c for c in record.controls if c.kind == "cuda" and c.name == "dropped tail element")
    # the edited element-wise loads run where rows are off the 16-byte loads: where K % 8 != 0, nowhere else
    assert "(k + 2 * e < K - 1)" in control.plant(record.implementations["cuda"]).header
    assert [s.label for s in record.edges if s.dims["k"] % 8 and s.rows] == ["K=203, not a multiple of 8"]
    assert control.gate == 3


def test_a_gate_that_one_finding_excuses_whole_stops_at_its_first_red_shape_and_a_narrow_one_names_every_shape():
    import mlx.core as mx

    from tensorfold_contract import Finding

    asked = []

    def everywhere_red(case):  # every shape of gate 3 fails, as MLX's matmul does gate 4 on CUDA
        asked.append(case.shape.label)
        return _fails_on(*{s.label for s in _toy().edges})(case)

    def gate_3(finding):
        asked.clear()
        record = _toy(impl=everywhere_red, findings=(finding,))
        return run_contract(pm=_manager(record), seed=1, device=_fake_gpu(mx.__version__)).kernels[0] \
            .implementations["mlx"].gates[3]

    blanket = gate_3(Finding("MLX's matmul on CUDA", "mlx", 3, backend="cuda"))
    assert blanket.status == "known" and [label for label, _ in blanket.failures] == [_toy().edges[0].label]
    assert _toy().edges[-1].label not in asked
    narrow = gate_3(Finding("MLX's matmul on CUDA", "mlx", 3, backend="cuda", symptom="cudaGraphAddKernelNode"))
    assert narrow.status == "known" and [label for label, _ in narrow.failures] == [s.label for s in _toy().edges]


def test_isolated_lanes_put_each_implementation_this_device_runs_beside_the_others_with_its_controls():
    from tensorfold_contract.isolate import lanes_of
    from tensorfold_contract.steps import Step

    steps = [Step("mlx"), Step("cuda"), Step("metal"), Step("mlx", 0), Step("cuda", 1), Step("metal", 2),
             Step("cuda", 3)]
    assert lanes_of(steps, ("mlx", "cuda")) == [[Step("mlx"), Step("metal"), Step("mlx", 0), Step("metal", 2)],
                                                [Step("cuda"), Step("cuda", 1), Step("cuda", 3)]]
    assert lanes_of(steps, ("mlx",)) == [steps]  # the CPU: one child walks the record in order, as before


def test_on_a_gpu_a_split_kinds_gate_3_runs_in_a_lane_of_its_own_and_its_other_gates_keep_the_controls():
    from tensorfold_contract.isolate import lanes_of
    from tensorfold_contract.steps import Step

    steps = [Step("mlx"), Step("cuda"), Step("mlx", 0), Step("cuda", 1)]
    assert lanes_of(steps, ("mlx", "cuda"), split=("mlx",)) == [[Step("mlx", None, (2, 4)), Step("mlx", 0)],
                                                                 [Step("mlx", None, (3,))],
                                                                 [Step("cuda"), Step("cuda", 1)]]
    assert lanes_of(steps, ("cuda",), split=("mlx",))[0][0] == Step("mlx")  # a kind not run here is never split


def _parts(record, device):
    from tensorfold_contract.steps import run_part

    inputs = gates.Inputs(record, 3)
    return [(wanted, run_part(record, "mlx", wanted, device, inputs)) for wanted in ((3,), (2, 4))]


@pytest.mark.parametrize("impl", [_double, lambda case: _double(case) if case.rows else {"y": case.array("x")[:1]}],
                         ids=["passing", "red in gate 3"])
def test_an_implementation_joined_from_its_parts_reports_as_the_whole_run_in_one_piece(impl):
    from tensorfold_contract.steps import join_parts, run_implementation

    record, device = _toy(impl=impl), devices.current()
    whole = run_implementation(record, "mlx", device, gates.Inputs(record, 3))
    parts = _parts(record, device)
    assert all(part.status == "part" for _, part in parts)
    joined = join_parts(record, "mlx", device, parts)
    assert joined.status == whole.status and joined.known == whole.known
    assert {g: (r.status, r.detail) for g, r in joined.gates.items()} == \
        {g: (r.status, r.detail) for g, r in whole.gates.items()}
    assert joined.seconds == max(part.seconds for _, part in parts)
