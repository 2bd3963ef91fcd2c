"""The benchmarks' output checks: a reply that differs anywhere, in any way, fails before a speed is printed."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
_before = signal.getsignal(signal.SIGTERM)
import bench_cache  # noqa: E402
import bench_ceiling  # noqa: E402
import bench_decode  # noqa: E402
import bench_family  # noqa: E402
import bench_pricing  # noqa: E402
import bench_rows  # noqa: E402
from common import (BenchMismatch, check_same_ids, check_same_replies, drafts_by_source, exit_code,  # noqa: E402
                    fail_if_any)

signal.signal(signal.SIGTERM, _before)  # common's handler is for a benchmark's own process, not pytest's


def test_equal_ids_pass():
    check_same_ids("cell", [5, 6, 7], [5, 6, 7])


def test_a_shorter_reply_with_an_equal_prefix_fails_at_its_end():
    with pytest.raises(BenchMismatch, match="token 2 is past its end, the reference's is 7") as failure:
        check_same_ids("cell", [5, 6, 7], [5, 6])
    assert "lengths: 2 here, 3 in the reference" in str(failure.value)


def test_a_longer_reply_with_an_equal_prefix_fails_too():
    with pytest.raises(BenchMismatch, match="token 3 is 8, the reference's is past its end"):
        check_same_ids("cell", [5, 6, 7], [5, 6, 7, 8])


def test_one_differing_id_fails_naming_the_cell_its_position_and_both_ids():
    with pytest.raises(BenchMismatch, match=r"^drafted, rep 2: token 1 is 9, the reference's is 6"):
        check_same_ids("drafted, rep 2", [5, 6, 7], [5, 9, 7])


def test_an_empty_reply_against_a_nonempty_reference_fails():
    with pytest.raises(BenchMismatch, match="token 0"):
        check_same_ids("cell", [5], [])


def test_a_missing_reply_fails_even_when_every_reply_present_is_equal():
    with pytest.raises(BenchMismatch, match="1 replies here, 2 in the reference"):
        check_same_replies("cell", [[1, 2], [3, 4]], [[1, 2]])


def test_replies_are_checked_prompt_by_prompt():
    with pytest.raises(BenchMismatch, match="cell, prompt 1: token 1 is 5"):
        check_same_replies("cell", [[1, 2], [3, 4]], [[1, 2], [3, 5]])


def test_a_mismatch_becomes_exit_code_1_and_one_fail_line(capsys):
    def main():
        check_same_ids("cell", [1, 2], [1, 3])
        print("100.0 tok/s")
        return 0

    assert exit_code(main) == 1
    out, err = capsys.readouterr()
    assert "tok/s" not in out
    assert err.strip().splitlines() == ["FAIL cell: token 1 is 3, the reference's is 2 (lengths: 2 here, 2 in the "
                                        "reference); no speed quoted for it"]


def test_a_table_with_failed_cells_ends_in_the_first_failure_and_a_count():
    with pytest.raises(BenchMismatch, match=r"^a: why \(and 1 more failed cells above\)$"):
        fail_if_any([BenchMismatch("a: why"), BenchMismatch("b: why")])
    fail_if_any([])


def test_bench_family_quotes_no_speed_and_exits_1_when_mlx_lm_stops_early(monkeypatch, capsys):
    run = {"prompt_ids": [1, 2], "token_ids": [10, 11, 12, 13], "decode_tokens_per_s": 50.0}
    monkeypatch.setattr(bench_family, "ours", lambda model, tokens, dtype: run)
    monkeypatch.setattr(bench_family, "theirs", lambda path, ids, tokens, dtype: ([10, 11, 12], 60.0))
    monkeypatch.setattr(bench_family, "model_dir", lambda model: model)
    assert exit_code(lambda: bench_family.main(["tiny-llama", "--tokens", "4", "--reps", "1"])) == 1
    out, err = capsys.readouterr()
    assert "tok/s" not in out
    assert "tiny-llama (auto) rep 1: tensorfold against mlx-lm: token 3 is 13" in err


def test_bench_cache_refuses_a_resumed_reply_that_differs_from_the_cold_one():
    bench_cache.check_resumed("tiny-llama", [4, 5, 6], [4, 5, 6])
    with pytest.raises(BenchMismatch, match="resumed reply against the cold one: token 2"):
        bench_cache.check_resumed("tiny-llama", [4, 5, 6], [4, 5])
    with pytest.raises(BenchMismatch, match="no token ids"):
        bench_cache.check_resumed("tiny-llama", [], [])


def _decode_result(replies: list[list[int]], rate: float) -> bench_decode.Result:
    served = {"drafter": "tiny-llama-drafter", "row_invariance": {"row_invariant": True, "detail": "test"}}
    return bench_decode.Result([{"ids": ids, "finish": "length", "stats": {}} for ids in replies], rate, served)


def test_bench_decode_prints_fail_and_no_speed_for_a_cell_one_token_short(capsys):
    cells = [c for c in bench_decode.CELLS if c.name in ("serial", "drafted")]
    runs = {"serial": [_decode_result([[1, 2, 3], [4, 5]], 80.0)],
            "drafted": [_decode_result([[1, 2, 3], [4]], 123.4)]}
    failures = bench_decode.report(("auto", "bundled"), cells, runs, ["a", "b"])
    table = capsys.readouterr().out
    assert [str(f) for f in failures] == ["cell drafted (auto, BLAS bundled), rep 1, prompt 1: token 1 is past its "
                                          "end, the reference's is 5 (lengths: 1 here, 2 in the reference)"]
    assert "123.4" not in table
    assert "| 80.0" in table


def test_bench_rows_checks_each_depth_and_the_plain_decode_of_its_run():
    cell = {"ids": [1, 2, 3], "plain_ids": [1, 2, 3]}
    bench_rows.check(2, [cell], [1, 2, 3])
    with pytest.raises(BenchMismatch, match="N=2, rep 2: token 2 is 9"):
        bench_rows.check(2, [cell, {"ids": [1, 2, 9], "plain_ids": [1, 2, 3]}], [1, 2, 3])
    with pytest.raises(BenchMismatch, match="its run's own plain decode: token 3"):
        bench_rows.check(2, [{"ids": [1, 2, 3], "plain_ids": [1, 2, 3, 4]}], [1, 2, 3])


def test_bench_pricing_keeps_each_engines_first_difference_from_plain():
    failures = {}
    bench_pricing.check_against_plain("short, rep 1, prompt 0", {"plain": [1, 2], "priced": [1, 2],
                                                                 "fixed 1": [1]}, failures)
    bench_pricing.check_against_plain("short, rep 1, prompt 1", {"plain": [3, 4], "priced": [3, 4],
                                                                 "fixed 1": [3, 5]}, failures)
    assert list(failures) == ["fixed 1"]
    assert str(failures["fixed 1"]).startswith("short, rep 1, prompt 0: engine fixed 1: token 1 is past its end")


def test_the_gemv_bench_refuses_an_output_off_the_float64_reference():
    import mlx.core as mx
    import numpy as np

    from tensorfold_contract.gates import Inputs
    from tensorfold_contract.record import Shape
    from tensorfold_llama.kernels import bench

    for bits, dims in ((16, {"n": 64, "k": 256}), (4, {"n": 64, "k": 256, "group": 64})):
        record = bench.RECORDS[bits]
        full = Inputs(record, 0).case(Shape("tiny", dims, 4), 4)
        reference = record.reference(full)["y"]
        case = full.take_rows(0, 3)
        assert bench.off_reference("ours", record, case, mx.array(reference[:3].astype(np.float32)), reference) is None
        doctored = reference[:3].astype(np.float32)
        doctored[2, 5] += 0.01 * np.abs(reference[2]).max()
        assert "ours, 3 rows: tiny: y row 2 off by" in bench.off_reference("ours", record, case, mx.array(doctored),
                                                                           reference)
        assert bench.off_reference("ours", record, case, mx.array(reference[:2].astype(np.float32)), reference)


def test_the_ceiling_reads_expected_drafts_from_the_histogram_and_a_perfect_drafter_lands_its_whole_depth():
    histogram = {"0": 2, "1": 1, "2": 1}  # P(>= 1) = 1/2, P(>= 2) = 1/4
    assert bench_ceiling.expected_accepted(histogram, 1, 2) == 0.5
    assert bench_ceiling.expected_accepted(histogram, 4, 2) == 0.75  # no block lands past its trained depth
    rows = {1: 2.0, 2: 3.0, 3: 4.0}
    best = bench_ceiling.ceilings(4.0, rows, [1, 2], lambda d: bench_ceiling.expected_accepted(histogram, d, 2),
                                  lambda d: 1.0)
    assert best["perfect"] == (3 * 4.0 / 6.0, 2)  # 3 tokens in the plain round plus 2 rows
    assert best["shipped"] == (1.5 * 4.0 / 5.0, 1)
    assert best["priced"] == (1.5 * 4.0 / 6.0, 1)


def test_the_ceiling_refuses_a_window_whose_first_row_differs_from_its_one_row_forward(monkeypatch):
    import mlx.core as mx

    from tensorfold_core.loading import load_model

    model, tokenizer = load_model("tiny-lfm2")[:2]
    real = model.forward
    # a planted defect: a wider window's logits moved by 1e-3
    monkeypatch.setattr(model, "forward", lambda caches, windows, rows: real(caches, windows, rows) + (
        mx.array(1e-3) if len(windows[0]) > 1 else mx.array(0.0)))
    with pytest.raises(BenchMismatch, match="a 2-row window's first row differs"):
        bench_ceiling.rows_ms(model, tokenizer, 1, [1, 2], reps=1)


def test_the_ceiling_bench_runs_the_shipped_dspark_pair_to_exit_0():
    done = subprocess.run([sys.executable, str(BENCH / "bench_ceiling.py"), "--blas", "bundled", "--streams", "1,2",
                           "--depths", "1,2", "--reps", "1", "--tokens", "6"], capture_output=True, text=True,
                          cwd=BENCH, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "perfect drafts, free holds" in done.stdout and re.search(r"\| 2 +\| [0-9.]+x at [12]", done.stdout)


def test_bench_family_runs_the_shipped_tiny_model_to_exit_0():
    done = subprocess.run([sys.executable, str(BENCH / "bench_family.py"), "tiny-llama", "--tokens", "6", "--reps",
                           "1"], capture_output=True, text=True, cwd=BENCH, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "same greedy tokens" in done.stdout


def test_the_gpu_pair_bench_runs_the_shipped_pair_on_the_cpu_with_served_cells_and_mlx_lm_to_exit_0():
    done = subprocess.run([sys.executable, str(BENCH / "bench_gpu_pair.py"), "tiny-llama", "tiny-llama-drafter",
                           "--modes", "builtin,table", "--tokens", "8", "--prompts", "1", "--streams", "2",
                           "--mlx-lm"], capture_output=True, text=True, cwd=BENCH, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("table ") and line.rstrip().endswith("True") for line in lines)  # same ids as builtin
    assert any(line.split()[:2] == ["table", "2"] for line in lines)  # the 2-stream cell, served column included
    assert "its greedy ids those of builtin plain" in done.stdout and "8 of 8 tokens" in done.stdout


def test_the_round_time_tool_times_every_part_of_a_drafted_round_on_the_cpu():
    tool = BENCH.parent / "tools" / "device" / "round_time.py"
    done = subprocess.run([sys.executable, str(tool), "tiny-llama", "tiny-llama-drafter", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for part in ("target forward 8 rows", "drafter (MLX ops) propose depth 4", "drafter (table) propose depth 4"):
        assert part in done.stdout


def test_the_round_time_tool_times_a_shared_verify_at_each_depth_against_a_plain_round_of_the_same_streams():
    tool = BENCH.parent / "tools" / "device" / "round_time.py"
    done = subprocess.run([sys.executable, str(tool), "tiny-lfm2", "tiny-lfm2-dspark", "--repeats", "1", "--streams",
                           "3", "--depths", "0,2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "3 streams x 1 row (a plain round's forward)" in done.stdout
    for line in ("3 streams x 1 rows (verify of depth 0)", "3 streams x 3 rows (verify of depth 2)"):
        assert line in done.stdout and "plain" in done.stdout.split(line)[1].splitlines()[0]


def test_the_decode_profile_tool_profiles_plain_drafted_and_served_at_one_stream_and_several_on_the_cpu():
    tool = BENCH.parent / "tools" / "device" / "profile_decode.py"
    done = subprocess.run([sys.executable, str(tool), "tiny-llama", "--tokens", "6", "--streams", "2", "--top", "5",
                           "--census", "--drafter", "tiny-llama-drafter", "--depth", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    one, two, drafter = re.findall(r"decode step, (\d) stream\(s\): (\d+) primitives", done.stdout)
    assert one[0] == "1" and two[0] == "2" and int(two[1]) > int(one[1]) > 0  # a second stream adds its attention
    assert "the drafter's step" in done.stdout and 0 < int(drafter[1]) < int(one[1])  # 4 layers to the target's 8
    cells = re.findall(r"== (\d) stream\(s\), (plain|drafted|served): [\d.]+ tok/s unprofiled; (\d+) rounds",
                       done.stdout)
    assert [c[:2] for c in cells] == [(n, e) for n in "12" for e in ("plain", "drafted", "served")]
    assert all(int(c[2]) > 0 for c in cells) and done.stdout.count("Ordered by: internal time") == 6
    phases = re.findall(r"^chain ([\d.]+) .* read \(device wait\) ([\d.]+) .*\(ms a round", done.stdout, re.M)
    assert len(phases) == 4  # drafted and served, at 1 and 2 streams
    assert float(phases[0][0]) > 0 and float(phases[2][0]) > 0  # the drafted engine's every window ran a chain


def test_the_gpu_pair_bench_refuses_mlx_lm_without_the_builtin_mode_its_ids_are_checked_against():
    done = subprocess.run([sys.executable, "bench_gpu_pair.py", "tiny-llama", "tiny-llama-drafter", "--modes",
                           "table,table:per-stream", "--mlx-lm"], capture_output=True, text=True, cwd=BENCH, timeout=120)
    assert done.returncode != 0 and "add builtin to --modes" in done.stderr


def test_the_gpu_pair_bench_runs_its_modes_in_rotated_rounds_and_prints_each_round_s_plain_rate():
    done = subprocess.run([sys.executable, "bench_gpu_pair.py", "tiny-llama", "tiny-llama-drafter", "--modes",
                           "builtin,table", "--tokens", "4", "--prompts", "1", "--rounds", "2"],
                          capture_output=True, text=True, cwd=BENCH, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    per_round = {line.split(":")[0].strip(): line.split(":")[1].split() for line in done.stdout.splitlines()
                 if line.startswith("  ") and ":" in line}
    assert set(per_round) == {"builtin", "table"} and all(len(rates) == 2 for rates in per_round.values())


def test_the_gpu_pair_bench_serves_a_dspark_pair_at_a_fixed_depth_with_every_reply_checked():
    done = subprocess.run([sys.executable, "bench_gpu_pair.py", "tiny-lfm2", "tiny-lfm2-dspark", "--modes", "table",
                           "--tokens", "6", "--prompts", "1", "--streams", "2", "--served-depth", "2"],
                          capture_output=True, text=True, cwd=BENCH, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(line.split()[:2] == ["table", "2"] for line in done.stdout.splitlines())
    assert "every drafter window at depth 2, unpriced" in done.stdout


def test_the_gpu_pair_bench_refuses_a_mode_named_twice():
    done = subprocess.run([sys.executable, "bench_gpu_pair.py", "tiny-llama", "tiny-llama-drafter", "--modes",
                           "table,table"], capture_output=True, text=True, cwd=BENCH, timeout=120)
    assert done.returncode != 0 and "use --rounds" in done.stderr


def test_a_mode_that_cannot_run_is_named_and_left_out_while_the_others_run_every_round(capsys):
    from common import interleaved

    calls = []

    def run(mode):
        calls.append(mode)
        if mode == "table:w32":
            raise BenchMismatch("mode table:w32: the child failed: too many resources requested for launch")
        return {"mode": mode}

    counts = []
    runs, failed = interleaved(["table", "table:w32", "table:u1"], 3, run,
                               lambda so_far: counts.append(sum(len(r) for r in so_far.values())))
    assert list(runs) == ["table", "table:u1"] and all(len(r) == 3 for r in runs.values())
    assert counts == [1, 2, 3, 4, 5, 6]  # the raw results so far, kept after each run, as a cut run leaves them
    assert list(failed) == ["table:w32"] and "too many resources" in failed["table:w32"]
    assert calls.count("table:w32") == 1  # never retried
    assert calls[:3] == ["table", "table:w32", "table:u1"] and calls[3:5] == ["table:u1", "table"]  # rounds rotate
    # each run that ended is noted as it ends, with no figures, so a run cut at its cap shows how far it got
    noted = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ran ")]
    assert len(noted) == 6 and noted[0].startswith("ran table, round 1 of 3, in ") and noted[0].endswith(" s")


def test_no_mode_running_fails_the_benchmark():
    from common import interleaved

    def run(mode):
        raise BenchMismatch(f"mode {mode}: the child failed")

    with pytest.raises(BenchMismatch, match="no mode ran"):
        interleaved(["table", "builtin"], 2, run)


def test_drafts_by_source_reads_a_servers_draft_tokens_offered_and_kept_by_proposer(shipped):
    import httpx

    before = drafts_by_source(shipped.url)
    body = {"prompt": "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n", "max_tokens": 32, "temperature": 0}
    usage = httpx.post(shipped.url + "/v1/completions", json=body, timeout=120).json()["usage"]["tensorfold"]
    after = drafts_by_source(shipped.url)
    grew = {source: (offered - before.get(source, (0, 0))[0], kept - before.get(source, (0, 0))[1])
            for source, (offered, kept) in after.items()}
    assert set(grew) <= {"copy", "recall", shipped.host.drafter.name}
    assert sum(o for o, _ in grew.values()) == usage["drafted"] > 0
    assert sum(k for _, k in grew.values()) == usage["accepted"]


def test_the_concurrent_bench_serves_a_model_directory_and_a_drafter_over_http_with_every_reply_checked_first():
    from tensorfold_core.loading import resolve_model

    directory = str(resolve_model("tiny-lfm2"))  # served under its own id, which the bench asks the server for
    done = subprocess.run([sys.executable, "bench_concurrent.py", "--model", directory, "--drafter",
                           "tiny-lfm2-dspark", "--levels", "2", "--tokens", "8", "--reps", "1", "--waves", "1",
                           "--no-alone", "--dtype", "float32"], capture_output=True, text=True, cwd=BENCH, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "token ids checked (--serial) before any rate is quoted" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 2 "))
    assert row.split("|")[2].strip() == "equal"  # the lfm2 pair's replies, each as its request alone, undrafted


def test_the_concurrent_bench_marks_each_wave_that_repeats_an_earlier_request_and_passes_serve_flags_on():
    done = subprocess.run([sys.executable, "bench_concurrent.py", "--model", "tiny-llama", "--levels", "2",
                           "--tokens", "4", "--reps", "1", "--waves", "6", "--no-alone", "--dtype", "float32",
                           "--serve-flags", "--prompt-cache-gib 0"], capture_output=True, text=True, cwd=BENCH,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a fresh server per cell (--parallel = the most streams, --prompt-cache-gib 0)" in done.stdout
    assert "waves marked r repeat requests an earlier wave of the cell sent" in done.stdout
    # 11 code prompts two at a time: the sixth wave sends the last and the first again, each earlier one new prompts
    line = next(line for line in done.stdout.splitlines() if line.startswith("rep 1 code level 2: "))
    cells = re.findall(r"(plain|drafted) [\d.]+ tok/s \(waves ([^;)]+)", line)
    assert [mode for mode, _ in cells] in (["plain", "drafted"], ["drafted", "plain"])
    for _, waves in cells:
        marks = [wave.endswith("r") for wave in waves.split()]
        assert marks == [False] * 5 + [True]
