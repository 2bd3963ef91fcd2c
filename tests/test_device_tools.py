"""The GPU steps' small tools run here too: the load-time tool, the decode profile, the guard trace, the launch
times and slots kept full, each on the tiny pair."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tensorfold_core.loading import resolve_model

TOOLS = Path(__file__).resolve().parent.parent / "tools" / "device"


def test_the_load_time_tool_loads_three_ways_and_remembers_no_pass_of_composed_ops():
    done = subprocess.run([sys.executable, str(TOOLS / "load_time.py"), str(resolve_model("tiny-llama"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("  ")[0].strip() for line in lines] == ["self-test off", "self-test on, nothing remembered",
                                                               "self-test on, passes remembered"]
    assert all(line.endswith("passes remembered 0") for line in lines)  # the CPU serves MLX's ops: nothing to keep


def test_the_decode_profile_prints_each_engine_s_rate_phases_and_profile_and_dumps_them(tmp_path):
    models = resolve_model("tiny-llama").parent
    done = subprocess.run([sys.executable, str(TOOLS / "profile_decode.py"), str(models / "tiny-llama"), "--drafter",
                           str(models / "tiny-llama-drafter"), "--tokens", "8", "--streams", "2", "--top", "3",
                           "--dump", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    heads = [line for line in done.stdout.splitlines() if line.startswith("== ")]
    assert [h.split(":")[0] for h in heads] == ["== 1 stream(s), plain", "== 1 stream(s), served",
                                                "== 2 stream(s), plain", "== 2 stream(s), served"]
    lines = done.stdout.splitlines()
    whole = [line for line in lines if line.endswith(" rounds)") and not line.startswith("  ")]
    kinds = [line.split(":")[0].strip() for line in lines if line.startswith("  ") and line.endswith(" rounds)")]
    assert len(whole) == 4 and "function calls" in done.stdout
    # a served engine's plain and drafted rounds apart, each where it ran any
    assert set(kinds) <= {"plain rounds", "drafted rounds"} and 2 <= len(kinds) <= 4
    # each served run names its lone guard's bands (the plain rate each judges drafting against)
    assert sum(line.startswith("lone guard bands:") for line in lines) == 2
    # and what its rounds told the guards, by kind (a rate, or why none)
    assert sum(line.startswith("  the guards were told: ") for line in lines) == 2
    # and its rounds named by what they carried and did for the next, the first reply's as letters
    assert sum(line == "rounds by what they carried, then what they did for the next round:" for line in lines) == 2
    trails = [line.split("): ")[1] for line in lines if line.startswith("  first reply's rounds (")]
    assert len(trails) == 2 and all(trail and set(trail) <= set("DCGgnap") for trail in trails)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1-plain.prof", "1-served.prof", "2-plain.prof",
                                                          "2-served.prof"]


def test_the_decode_profile_prints_no_rate_for_an_engine_whose_replies_are_not_plain_s(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(TOOLS))
    import profile_decode  # puts bench/ on the path, where bench_gpu_pair lives

    import bench_gpu_pair

    honest = bench_gpu_pair.together

    def planted(model, engine, requests):  # a served engine whose first reply ends one token off plain's
        ids, seconds = honest(model, engine, requests)
        if engine.drafter is not None:
            ids[0][-1] += 1
        return ids, seconds

    monkeypatch.setattr(bench_gpu_pair, "together", planted)
    models = resolve_model("tiny-llama").parent
    code = profile_decode.main([str(models / "tiny-llama"), "--drafter", str(models / "tiny-llama-drafter"),
                                "--tokens", "4", "--streams", "1", "--top", "1"])
    out, err = capsys.readouterr()
    assert code == 1 and "MISMATCH 1 stream(s), served, prompt 0: token 3" in err
    assert "plain: " in out and "served: " not in out


def test_the_guard_trace_logs_each_measured_round_and_the_verdict_that_follows_them():
    models = resolve_model("tiny-llama").parent
    done = subprocess.run([sys.executable, str(TOOLS / "guard_trace.py"), str(models / "tiny-llama"),
                           str(models / "tiny-llama-drafter"), "--streams", "2", "--passes", "2", "--tokens", "40"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[::5]] == ["pass 0", "pass 1"]
    # each pass's rounds tallied by kind: the prompts' chunks in both engines, the served one's plain measure
    tally = [{kind.strip(): int(n) for kind, n in re.findall(r"([a-z ]+) (\d+) in [\d.]+ ms", line.split(":")[1])}
             for line in lines[2:4]]
    assert lines[2].startswith("  plain rounds:") and lines[3].startswith("  served rounds:")
    assert tally[0]["prompt"] >= 1 and tally[1]["prompt"] >= 1 and tally[1]["shared plain"] >= 16
    # and the served rounds' phases: the first 8, each total the sum of its four parts
    phases = re.findall(r"#(\d+):([\d.]+)=([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+)", lines[4])
    assert [int(p[0]) for p in phases[:8]] == list(range(8))
    assert all(abs(float(p[1]) - sum(map(float, p[2:]))) < 0.3 for p in phases)
    first = lines[1].split()
    # the guard measures 16 plain rounds of the 2-stream band (the first of them uncounted), then says what runs next
    assert all(word.startswith("p2/") for word in first[:17])
    # and marks the rounds whose forward the lookahead queued a round before: greedy plain rounds after the first
    assert "^" not in first[0] and sum(word.endswith("^") for word in first[1:17]) >= 8
    assert first[17:20] == ["|2", "streams:", "plain"] and first[22:24] == ["-", "->"]
    assert first[24] in ("drafted", "plain") and first[25] in ("measure", "run")


def test_the_guard_trace_can_serve_a_warmed_up_engine_first_and_name_the_traces_its_pass_made():
    models = resolve_model("tiny-llama").parent
    done = subprocess.run([sys.executable, str(TOOLS / "guard_trace.py"), str(models / "tiny-llama"),
                           str(models / "tiny-llama-drafter"), "--streams", "1", "--passes", "1", "--tokens", "24",
                           "--warm-up", "--served-first", "--keys"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # warmed up as a server is at load (its rounds counted), then the pass, its served replies equal to plain's
    assert re.fullmatch(r"warmed up: [\d.]+ s, [1-9]\d* rounds, windows drafted: .+", lines[0])
    assert lines[1].startswith("pass 0: plain ") and lines[4].startswith("  served rounds:")
    # the lone guard's rounds logged, and the traces the served pass made that the warm-up had not
    assert re.match(r"  [lL]\d+/[\d.]+", lines[2])
    made = re.fullmatch(r"  traces the served pass made \((\d+)\):(.*)", lines[6])
    assert made and len(re.findall(r"\[[^]]+\]", made[2])) == int(made[1])


def test_the_launch_time_tool_times_a_step_s_phases_idle_and_busy_at_each_stream_count_its_ids_equal():
    done = subprocess.run([sys.executable, str(TOOLS / "launch_time.py"), "tiny-lfm2", "--streams", "1,3", "--steps",
                           "6", "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\s+(\d) +(idle|busy) +([\d. ]+?)\s+([\d.]+)$", done.stdout, re.M)
    assert [row[:2] for row in rows] == [("1", "idle"), ("1", "busy"), ("3", "idle"), ("3", "busy")]
    assert all(len(row[2].split()) == 5 and float(row[3]) > 0 for row in rows)  # every phase, then tok/s
    assert "the busy loop's equal the idle loop's" in done.stdout


def test_slots_kept_full_admit_a_request_as_a_stream_leaves_and_answer_each_as_it_would_be_answered_alone():
    sys.path.insert(0, str(TOOLS))
    from kept_full import kept_full

    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.loading import load_model

    model = load_model("tiny-llama")[0]
    # replies of different lengths, so streams leave at different rounds and the queue refills them one by one
    requests = [GenerationRequest(prompt_ids=list(range(40 + i, 52 + i)), max_tokens=6 + 3 * i) for i in range(5)]
    engine, most = Engine(model), 0
    step = engine.round

    def counted_round():
        nonlocal most
        most = max(most, len(engine.streams))
        return step()

    engine.round = counted_round
    split: dict = {}
    ids, seconds = kept_full(model, engine, requests, slots=2, split=split)
    alone = [kept_full(model, Engine(model), [request], slots=1)[0][0] for request in requests]
    assert ids == alone and [len(i) for i in ids] == [r.max_tokens for r in requests]
    assert most == 2 and seconds > 0
    # every round is counted once, by kind (recall's drafts from the prompts make some drafted), and so is every token
    assert {"prompt", "plain"} <= set(split) <= {"prompt", "plain", "drafted"}
    assert sum(made for _, _, made in split.values()) == sum(map(len, ids))
    assert sum(s for s, _, _ in split.values()) <= seconds


def test_the_kept_full_tool_with_holds_ahead_checks_a_third_engine_s_replies_and_prints_its_rate():
    done = subprocess.run([sys.executable, str(TOOLS / "kept_full.py"), "tiny-lfm2-moe", "tiny-lfm2-moe-dspark",
                           "--slots", "2", "--requests", "4", "--tokens", "12", "--passes", "1", "--hold-ahead"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[1:]] == ["pass 0", "  plain", "  served", "  ahead"]
    assert re.search(r"served [\d.]+ tok/s \([\d.]+x\).*, ahead [\d.]+ tok/s \([\d.]+x\); ahead drafted windows \d+",
                     lines[1])


def test_the_kept_full_tool_checks_the_served_replies_then_prints_both_rates_and_the_guard_s_bands():
    models = resolve_model("tiny-llama").parent
    done = subprocess.run([sys.executable, str(TOOLS / "kept_full.py"), str(models / "tiny-llama"),
                           str(models / "tiny-llama-drafter"), "--slots", "2", "--requests", "5", "--tokens", "12",
                           "--passes", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "5 requests of 12 tokens through 2 slots kept full"
    each_pass = ["pass {}", "  plain", "  served"]
    assert [line.split(":")[0] for line in lines[1:]] == [head.format(n) for n in (0, 1) for head in each_pass]
    rates = r"plain [\d.]+ tok/s, served [\d.]+ tok/s \([\d.]+x\); served drafted windows \d+; 2 streams: "
    assert all(re.search(rates, line) for line in lines[1::3])
    kinds = r"prompt \d+ rounds \d+ ms [\d.]+ tok/ms"
    assert all(re.search(kinds, line) for line in lines[2::3] + lines[3::3])
    assert all("drafted" not in line for line in lines[2::3])  # the plain engine serves as "draft": false, no copies
