"""The GPU steps' small tools run here too: the load-time tool times each way of loading in a fresh process."""

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
