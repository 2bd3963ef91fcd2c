"""A closed host leaves the interpreter nothing of MLX to free on its way out, so the process exits 0."""

from __future__ import annotations

import os
import subprocess
import sys

# the request fills the engine thread's compile cache (swiglu); `kept` makes the teardown long enough to meet it
SERVE_ONE_AND_LEAVE = """
import sys, threading
from tensorfold_core.lanes.types import DoneEvent, ErrorEvent, GenerationRequest
from tensorfold_core.loading import load_host
from tensorfold_core.options import ServeOptions

kept = [[i] for i in range(2_000_000)]
host = load_host(sys.argv[1], ServeOptions(parallel=1))
ended = threading.Event()
host.submit(GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=4),
            lambda event: isinstance(event, (DoneEvent, ErrorEvent)) and ended.set())
assert ended.wait(120)
host.close()
"""


def test_a_process_that_closes_its_host_and_returns_exits_0_not_sigabrt(tiny_llama_path):
    run = subprocess.run([sys.executable, "-c", SERVE_ONE_AND_LEAVE, str(tiny_llama_path)], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "terminate called" not in run.stderr
