"""`tensorfold contract` from the outside: a third-party plugin, the line format, JSON, exit codes, few dependencies."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

TOY = textwrap.dedent('''
    """A throwaway third-party kernel plugin: y = 2x, with planted controls."""
    import numpy as np

    from tensorfold_contract import Control, KernelRecord, Shape, Tolerance, variant
    from tensorfold_core import hookimpl


    def double(case):
        return {"y": case.array("x") * 2}


    CONTROLS = [Control("tripled", "mlx", 2, variant(lambda case: {"y": case.array("x") * 3}))]
    if CONTROLS_PLANTED > 1:
        CONTROLS.append(Control("drops the last column", "mlx", 2,
                                variant(lambda case: {"y": (case.array("x") * 2)[:, :-1]})))


    @hookimpl
    def tensorfold_kernels():
        return [KernelRecord(
            name="toy double", family="toyfam",
            make=lambda dims, rows, rng: {"x": rng.standard_normal((rows, dims["n"])).astype(np.float32)},
            reference=lambda case: {"y": 2 * case["x"].astype(np.float64)},
            implementations={"mlx": double},
            shapes=(Shape("n=64", {"n": 64}),), edges=(Shape("1 row", {"n": 3}, 1),),
            tolerance=Tolerance(rtol=1e-6), row_inputs=("x",), controls=tuple(CONTROLS))]
''')


def install_toy(site, controls: int):
    """A module plus its dist-info with the entry point: an installed distribution, as pip would leave it."""
    (site / "toy_kernels.py").write_text(f"CONTROLS_PLANTED = {controls}\n" + TOY)
    info = site / "toy_kernels-1.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-kernels\nVersion: 1.2.0\n")
    (info / "entry_points.txt").write_text("[tensorfold]\ntoy = toy_kernels\n")


def contract(*args, site=None, module=("-m", "tensorfold_core")):
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *module, "contract", *args], env=env, capture_output=True, text=True)


def test_a_third_party_distribution_is_picked_up_by_only_and_proven_with_no_change_to_core(tmp_path):
    install_toy(tmp_path, controls=2)
    done = contract("--only", "toy-kernels", "--json", "--seed", "7", site=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    (kernel,) = report["kernels"]
    assert (kernel["name"], kernel["family"], kernel["plugin"], kernel["distribution"]) == \
        ("toy double", "toyfam", "toy", "toy-kernels")
    assert kernel["implementations"]["mlx"]["status"] == "pass"
    assert [c["status"] for c in kernel["controls"]] == ["red", "red"]
    assert report["summary"] == {"kernels": 1, "pass": 1, "not_run": {}, "fail": 0, "known_findings": 0,
                                 "controls": 2, "red": 2, "missed": 0, "limit_problems": 0}


def test_a_third_party_record_with_one_planted_control_is_reported_and_fails_the_two_control_rule(tmp_path):
    install_toy(tmp_path, controls=1)
    done = contract("--only", "toyfam", site=tmp_path)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert any(line.startswith("toy double") and "mlx    pass  1:pass  2:pass  3:pass  4:pass" in line
               for line in lines), done.stdout
    assert "control [mlx] tripled -> gate 2: red as planted" in done.stdout
    assert "1 controls (a record carries at least 2 planted defects)" in done.stdout
    assert lines[-1] == ("SUMMARY 1 kernels: 0 pass gates 1-4, 1 fail, 0 known findings; 1 controls: 1 red as "
                         "planted, 0 missed; 0 limit problems")


def test_only_llama_prints_a_line_per_kernel_and_implementation_and_exits_0():
    done = contract("--only", "llama greedy argmax", "--only", "llama rmsnorm", "--seed", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("tensorfold contract on ") and "seed 3" in lines[0]
    for kernel in ("llama greedy argmax", "llama rmsnorm"):
        assert any(line.startswith(kernel) and " mlx    pass" in line for line in lines)
        assert any(line.startswith(kernel) and " cuda   not run (no CUDA device)" in line for line in lines)
        assert any(line.startswith(kernel) and " metal  not run (no Metal device)" in line for line in lines)
    assert lines[-1].startswith("SUMMARY 2 kernels: 2 pass gates 1-4 where they ran (4 implementations not run: "
                                "2 no CUDA device, 2 no Metal device), 0 fail, 0 known findings; ")


def test_only_naming_nothing_exits_2_and_names_what_is_registered():
    done = contract("--only", "no-such-family")
    assert done.returncode == 2
    assert "--only no-such-family matches no kernel, family, plugin or distribution" in done.stderr
    assert "llama" in done.stderr


def test_the_contract_runs_without_the_server_and_its_dependencies():
    blocked = textwrap.dedent('''
        import runpy, sys
        for name in ("pydantic", "fastapi", "uvicorn", "prometheus_client", "tokenizers", "jinja2", "click"):
            sys.modules[name] = None  # importing any of them now fails
        sys.argv = ["tensorfold_contract", "--only", "llama greedy argmax", "--json", "--seed", "5"]
        runpy.run_module("tensorfold_contract", run_name="__main__")
    ''')
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["summary"]["kernels"] == 1 and report["ok"] is True


CRASHY = textwrap.dedent('''
    """A third-party plugin whose implementation dies of SIGSEGV on the empty call, as MLX did on the H200."""
    import os
    import signal

    import numpy as np

    from tensorfold_contract import Control, KernelRecord, Shape, Tolerance, variant
    from tensorfold_core import hookimpl


    def double(case):
        if case.rows == 0:
            os.kill(os.getpid(), signal.SIGSEGV)
        return {"y": case.array("x") * 2}


    def crash(case):
        os.kill(os.getpid(), signal.SIGSEGV)


    def record(name, impl, controls):
        return KernelRecord(
            name=name, family="crashfam",
            make=lambda dims, rows, rng: {"x": rng.standard_normal((rows, dims["n"])).astype(np.float32)},
            reference=lambda case: {"y": 2 * case["x"].astype(np.float64)},
            implementations={"mlx": impl},
            shapes=(Shape("n=64", {"n": 64}),), edges=(Shape("1 row", {"n": 3}, 1), Shape("empty", {"n": 3}, 0)),
            tolerance=Tolerance(rtol=1e-6), row_inputs=("x",), controls=tuple(controls))


    TRIPLED = Control("tripled", "mlx", 2, variant(lambda case: {"y": case.array("x") * 3}))


    @hookimpl
    def tensorfold_kernels():
        return [record("crashy double", double, [TRIPLED, Control("crashes", "mlx", 2, variant(crash)), TRIPLED]),
                record("steady double", lambda case: {"y": case.array("x") * 2}, [TRIPLED, TRIPLED])]
''')


def crashy(site, *args):
    """The contract, isolated, over the crashy plugin installed in `site` (a dist-info with its entry point)."""
    if not (site / "crashy_kernels.py").exists():
        (site / "crashy_kernels.py").write_text(CRASHY)
        info = site / "crashy_kernels-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: crashy-kernels\nVersion: 0.1.0\n")
        (info / "entry_points.txt").write_text("[tensorfold]\ncrashy = crashy_kernels\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, "-m", "tensorfold_contract", "--only", "crashfam", "--isolate", "--seed",
                           "4", *args], env=env, capture_output=True, text=True)


def test_isolated_a_segfault_fails_its_step_and_the_rest_of_the_record_and_the_run_go_on(tmp_path):
    done = crashy(tmp_path)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith("seed 4, each record isolated")
    assert any(line.startswith("crashy double") and "mlx    fail  1:pass  2:pass  3:fail" in line for line in lines)
    assert any("gate 3: empty: crashed (signal 11, SIGSEGV) in double() at crashy_kernels.py:" in line
               for line in lines), done.stdout
    # the controls after the crash ran in a fresh child; the one that crashes proves nothing and is missed
    assert done.stdout.count("control [mlx] tripled -> gate 2: red as planted") == 4
    assert "control [mlx] crashes -> gate 2: MISSED (crashed (signal 11, SIGSEGV) in crash() at crashy_kernels.py:" \
        in done.stdout
    assert any(line.startswith("steady double") and "mlx    pass" in line for line in lines)
    assert lines[-1] == ("SUMMARY 2 kernels: 1 pass gates 1-4, 1 fail, 0 known findings; 5 controls: 4 red as "
                         "planted, 1 missed; 0 limit problems")


def test_isolated_records_run_side_by_side_and_report_as_one_at_a_time_does_with_progress_on_request(tmp_path):
    alone, together = crashy(tmp_path, "--jobs", "1", "--progress"), crashy(tmp_path, "--jobs", "2")
    assert alone.returncode == together.returncode == 1
    assert alone.stdout == together.stdout
    steps = [line for line in alone.stderr.splitlines() if line.startswith("  … ")]
    assert re.fullmatch(r"  … +\d+\.\d s  crashy double \[mlx\]", steps[0]), alone.stderr
    assert re.fullmatch(r"  … +\d+\.\d s  steady double control 'tripled'", steps[-1]), alone.stderr
    assert not [line for line in together.stderr.splitlines() if line.startswith("  … ")]  # not a terminal


def test_isolated_on_a_gpu_a_crash_in_gate_3_fails_only_that_gate_its_part_ran_beside_gates_2_and_4(tmp_path):
    crashy(tmp_path)  # installs the plugin
    script = textwrap.dedent('''
        import json
        from tensorfold_contract import devices
        from tensorfold_contract.isolate import run_record_isolated
        from tensorfold_contract.registry import discover

        found = discover()
        index = next(i for i, r in enumerate(found) if r.record and r.record.name == "crashy double")
        gpu = devices.Device("cuda", "a CUDA device (faked on the CPU)", "0.32.4", ("mlx",), None)
        steps = []
        result = run_record_isolated(found[index], index, gpu, 4, steps.append)
        print(json.dumps({"mlx": result.implementations["mlx"].as_json(), "steps": steps,
                          "controls": [c.status for c in result.controls]}))
    ''')
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=str(tmp_path)),
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    gates = {g: r["status"] for g, r in report["mlx"]["gates"].items()}
    # gate 4 ran in the other part (one piece, the crash left it "not run"); gate 5 checks sources only
    assert report["mlx"]["status"] == "fail" and gates == {"1": "pass", "2": "pass", "3": "fail", "4": "pass",
                                                           "5": "n/a"}
    assert "crashed (signal 11, SIGSEGV) in double()" in report["mlx"]["gates"]["3"]["detail"]
    assert {"crashy double [mlx] gates 2, 4", "crashy double [mlx] gate 3"} <= set(report["steps"])
    assert report["controls"] == ["red", "missed", "red"]


def test_records_run_side_by_side_only_when_isolated():
    done = subprocess.run([sys.executable, "-m", "tensorfold_contract", "--jobs", "2", "--no-isolate"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "more than 1 only where records are isolated" in done.stderr


def test_records_start_slowest_first_by_an_earlier_report_with_the_ones_it_lacks_before_them():
    from types import SimpleNamespace

    from tensorfold_contract.runner import slowest_first

    regs = [SimpleNamespace(record=SimpleNamespace(name=n)) for n in ("quick", "new", "slow", "middling")]
    started = slowest_first(regs, {"quick": 1.0, "slow": 150.0, "middling": 20.0})
    assert [r.record.name for r in started] == ["new", "slow", "middling", "quick"]


def test_an_order_from_an_earlier_report_changes_no_line_of_the_report_and_a_bad_one_is_a_flag_error(tmp_path):
    earlier = crashy(tmp_path, "--jobs", "2", "--json")
    (tmp_path / "earlier.json").write_text(earlier.stdout)
    ordered = crashy(tmp_path, "--jobs", "2", "--order-from", str(tmp_path / "earlier.json"))
    assert ordered.stdout == crashy(tmp_path, "--jobs", "2").stdout and ordered.returncode == 1
    (tmp_path / "not-a-report.json").write_text('{"summary": {}}')
    bad = crashy(tmp_path, "--jobs", "2", "--order-from", str(tmp_path / "not-a-report.json"))
    assert bad.returncode == 2 and f"--order-from {tmp_path / 'not-a-report.json'}: not a contract --json report" \
        in bad.stderr and not bad.stdout
