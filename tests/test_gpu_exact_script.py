"""tools/device/gpu_exact.py, the H200's exactness script, runs here too: a small configuration is exact in both
kernel table modes, every case counted, and a differing token is reported where it differs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "device"))

import gpu_exact  # noqa: E402
from exact_cases import VICTIM_ID, Check, Served  # noqa: E402

SMALL = ["--families", "llama,lfm2", "--tokens", "6", "--prompts", "2", "--streams", "4", "--builtin-seconds", "0"]


def test_the_gpu_exactness_script_finds_every_case_exact_on_the_cpu_in_both_kernel_modes(tmp_path):
    done = subprocess.run([sys.executable, gpu_exact.__file__, "--out", str(tmp_path), *SMALL],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_exact.json").read_text())
    assert report["verdict"] == "PASS"
    reports = report["reports"]
    assert [(r["family"], r["mode"]) for r in reports] == [("llama", "builtin"), ("llama", "records"),
                                                           ("lfm2", "builtin"), ("lfm2", "records")]
    for r in reports:
        # greedy and seeded per prompt: drafted alone, plain and drafted at 4 streams, two resumed runs of two passes
        assert r["cases"] == r["expected cases"] == 2 * 2 * (1 + 2 + 4) == gpu_exact.expected_cases(2, [4], True)
        assert r["mismatches"] == [] and r["cut"] == 0 and r["probe"]["row_invariant"]
        runs = r["runs"]
        assert runs["drafted 4 together"]["accepted"] > 0  # drafts were offered and some landed
        assert runs["plain 4 together"]["cancelled"] == runs["plain 4 together"]["neighbours"] == 1
        assert runs["resumed drafted 4 together, pass 2"]["cached_tokens"] > 0
    assert reports[2]["drafter"].startswith("dspark")
    assert "PASS" in done.stdout.splitlines()[-1]


def test_a_reply_that_differs_is_a_mismatch_naming_the_case_and_its_first_differing_token():
    check = Check([[5, 6, 7, 8], [9, 9]])
    check.compare("drafted 4 together", {0: Served(tokens=[5, 6, 2, 8], finish="length"),
                                         1: Served(tokens=[9, 9], finish="length"),
                                         VICTIM_ID: Served(tokens=[1], finish="cancelled")})
    assert check.mismatches == ["drafted 4 together prompt 0 greedy: first difference at token 2 of 4 "
                                "(reference 7, got 2)"]
    assert check.runs["drafted 4 together"] == {"cases": 2, "mismatches": 1, "drafted": 0, "accepted": 0,
                                               "cached_tokens": 0, "cancelled": 1, "neighbours": 1, "cut": 0}


def test_a_records_or_table_mismatch_fails_the_run_and_a_builtin_one_is_only_reported():
    clean = {"mismatches": [], "cases": 10, "expected cases": 10}
    assert not gpu_exact.failed({"mode": "records", **clean})
    assert gpu_exact.failed({"mode": "records", **clean, "mismatches": ["x"]})
    assert gpu_exact.failed({"mode": "records", **clean, "cases": 9})
    assert gpu_exact.failed({"mode": "records", "error": "crashed", "expected cases": 10})
    assert gpu_exact.failed({"mode": "table", **clean, "mismatches": ["x"]})
    assert not gpu_exact.failed({"mode": "builtin", **clean, "mismatches": ["x"]})


def test_the_exactness_server_runs_its_rounds_off_the_loading_thread_and_raises_what_failed_there():
    import threading

    from exact_cases import Job, Server

    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.loading import load_model

    model = load_model("tiny-llama")[0]
    server, threads = Server(model), set()
    step = server.engine.round

    def noted_round():
        threads.add(threading.current_thread().name)
        return step()

    server.engine.round = noted_round
    served = server.serve([Job(0, GenerationRequest(prompt_ids=list(range(40, 52)), max_tokens=5))], 1)
    assert len(served[0].tokens) == 5 and threads == {"exact-engine"}  # as the server's engine thread, not this one

    def failing_round():
        raise ValueError("a round failed")

    server.engine.round = failing_round
    with pytest.raises(ValueError, match="a round failed"):
        server.serve([Job(1, GenerationRequest(prompt_ids=list(range(40, 52)), max_tokens=5))], 1)
