"""SIGTERM drains a real `tensorfold serve` process: 503 for new requests, running replies end cleanly, exit 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from tensorfold_core.testing import tiny_llama_checkpoint

# undrafted replies to the end of the tiny model's context: a few seconds of rounds behind --parallel 1
LONG = {"prompt": "def add(a, b):\n", "temperature": 0, "draft": False, "stream": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("drain"))


class Serving:
    """`tensorfold serve` in a subprocess on a free loopback port."""

    def __init__(self, checkpoint, *flags: str):
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.process = subprocess.Popen([sys.executable, "-m", "tensorfold_core", "serve", str(checkpoint),
                                         "--port", "0", "--drafter", "none", *flags],
                                        stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        for line in self.process.stderr:
            self.log.append(line)
            found = re.search(r"serving .* at (http://\S+)/v1", line)
            if found:
                self.url = found.group(1)
                break
        else:
            raise AssertionError("the server never said where it listens:\n" + "".join(self.log))
        self._rest = threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True)
        self._rest.start()

    def stream(self, events: list, first: threading.Event) -> None:
        """Read one long reply's SSE events into `events`, setting `first` once the first one is in."""
        with httpx.stream("POST", self.url + "/v1/completions", json=LONG, timeout=120) as response:
            events.append(response.status_code)
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
        first.set()

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)


def _streams(server: Serving, count: int) -> tuple[list[list], list[threading.Thread]]:
    replies, threads = [], []
    for _ in range(count):
        events, first = [], threading.Event()
        thread = threading.Thread(target=server.stream, args=(events, first))
        thread.start()
        replies.append(events)
        threads.append(thread)
        first.wait(120)
    return replies, threads


def test_sigterm_refuses_new_requests_lets_running_streams_finish_and_exits_0(checkpoint):
    server = Serving(checkpoint, "--parallel", "1", "--grace-s", "120")
    replies, threads = _streams(server, 1)
    queued, queued_threads = [], []
    for _ in range(2):  # behind the running one: they are in flight too, and finish within the grace
        events = []
        queued.append(events)
        queued_threads.append(threading.Thread(target=server.stream, args=(events, threading.Event())))
        queued_threads[-1].start()
    for _ in range(10_000):  # until both wait in the host's queue (bounded: the test must end by itself)
        if httpx.get(server.url + "/health", timeout=60).json()["queued"] == 2:
            break
    server.process.send_signal(signal.SIGTERM)
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    health = httpx.get(server.url + "/health", timeout=60)
    for thread in threads + queued_threads:
        thread.join(120)
    assert server.process.wait(120) == 0, "".join(server.log)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    for events in replies + queued:
        assert events[0] == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    assert "Traceback" not in "".join(server.log)


def test_streams_still_running_after_the_grace_end_with_an_error_event_and_done(checkpoint):
    server = Serving(checkpoint, "--parallel", "2", "--grace-s", "0")
    replies, threads = _streams(server, 2)
    assert server.terminate() == 0, "".join(server.log)
    for thread in threads:
        thread.join(120)
    for events in replies:
        assert events[0] == 200 and events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == "server_shutting_down" and last["error"]["type"] == "service_unavailable"
        assert all("choices" in json.loads(e) for e in events[1:-2])
