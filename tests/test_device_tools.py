"""The GPU steps' small tools run here too: the load-time tool and the decode profile, each on the tiny pair."""

from __future__ import annotations

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
    assert done.stdout.count("(ms a round,") == 4 and "function calls" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1-plain.prof", "1-served.prof", "2-plain.prof",
                                                          "2-served.prof"]
