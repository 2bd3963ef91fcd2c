"""Soak a real `tensorfold serve` as hostile clients would: mixed, cut, slow, bad and huge requests, then SIGTERM.

Reports 5xx, hangs, token mismatches against `"draft": false`, /health latency throughout, and whether the
ledger's stream and slot bytes came back to 0; exits 1 when any of those fails. A bare ASGI app on the same box,
polled beside /health, gives the latency the machine alone adds (a shared box's tail is mostly its own).

    python bench/soak.py --requests 1000 --concurrency 8
    python bench/soak.py --model tiny-lfm2-moe --drafter tiny-lfm2-moe-dspark --requests 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import CODE_PROMPTS, free_port  # noqa: E402

HANG_S = 120.0  # a request still unanswered after this is a hang (the longest reply here takes seconds)
HEALTH_EVERY_S = 0.05
HEALTH_LIMIT_MS = 100.0
QUICK_MS = 20.0  # a control answered this fast beside a slow /health: that stall was the server's, not the machine's
# the control: uvicorn's h11 protocol answering every request at once, with no app behind it
CONTROL = '''
import sys, uvicorn
async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"status": "ok"}'})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", http="h11", lifespan="off")
'''
KINDS = ("exact", "exact", "exact", "chat", "stream_cut", "client_timeout", "bad", "bad", "huge", "queue_burst")


class Soak:
    def __init__(self, url: str, seed: int):
        self.url = url
        self.seed = seed
        self.lock = threading.Lock()
        self.statuses: Counter = Counter()
        self.kinds: Counter = Counter()
        self.server_errors: list[str] = []
        self.hangs: list[str] = []
        self.mismatches: list[str] = []
        self.unexpected: list[str] = []
        self.compared = 0

    def record(self, kind: str, status: int | str, detail: str = "") -> None:
        with self.lock:
            self.kinds[kind] += 1
            self.statuses[status] += 1
            if isinstance(status, int) and status >= 500:
                self.server_errors.append(f"{kind}: {status} {detail[:300]}")

    def post(self, path: str, timeout: float = HANG_S, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=timeout, **kwargs)

    def one(self, index: int) -> None:
        kind = KINDS[index % len(KINDS)]
        rnd = random.Random(self.seed * 1_000_003 + index)
        try:
            {"exact": self.exact, "chat": self.chat, "stream_cut": self.stream_cut,
             "client_timeout": self.client_timeout, "bad": self.bad, "huge": self.huge,
             "queue_burst": self.queue_burst}[kind](rnd)
        except httpx.TimeoutException as exc:
            if kind != "client_timeout":
                with self.lock:
                    self.hangs.append(f"{kind} #{index}: {exc!r}")
                self.record(kind, "hang")
        except httpx.HTTPError as exc:
            self.record(kind, type(exc).__name__)
            if kind not in ("stream_cut", "client_timeout", "huge"):
                with self.lock:
                    self.unexpected.append(f"{kind} #{index}: {exc!r}")

    def _body(self, rnd: random.Random) -> dict:
        body = {"prompt": rnd.choice(CODE_PROMPTS), "max_tokens": rnd.randint(4, 48), "return_token_ids": True}
        if rnd.random() < 0.5:
            body.update(temperature=0)
        else:
            body.update(temperature=rnd.choice([0.7, 1.0]), seed=rnd.randint(0, 2 ** 31))
        return body

    def exact(self, rnd: random.Random) -> None:
        """A reply (streamed or not, drafted) against the same request served with `"draft": false`."""
        body = self._body(rnd)
        ids = self._streamed_ids("/v1/completions", body) if rnd.random() < 0.5 else self._ids("/v1/completions",
                                                                                             body)
        reference = self._ids("/v1/completions", {**body, "draft": False})
        if ids is not None and reference is not None:
            with self.lock:
                self.compared += 1
                if ids != reference:
                    self.mismatches.append(f"{json.dumps(body)[:200]}: {ids[:8]}... vs {reference[:8]}...")

    def chat(self, rnd: random.Random) -> None:
        body = {"messages": [{"role": "user", "content": rnd.choice(CODE_PROMPTS)}],
                "max_tokens": rnd.randint(4, 32), "temperature": 0, "return_token_ids": True}
        drafted = self._ids("/v1/chat/completions", body, chat=True)
        plain = self._ids("/v1/chat/completions", {**body, "draft": False}, chat=True)
        if drafted is not None and plain is not None:
            with self.lock:
                self.compared += 1
                if drafted != plain:
                    self.mismatches.append(f"chat {body['messages'][0]['content'][:40]!r}")

    def _ids(self, path: str, body: dict, chat: bool = False) -> list[int] | None:
        response = self.post(path, json=body)
        self.record("reply", response.status_code, response.text)
        if response.status_code != 200:
            if response.status_code != 429:
                with self.lock:
                    self.unexpected.append(f"{path} {response.status_code}: {response.text[:200]}")
            return None
        return response.json()["choices"][0]["token_ids"]

    def _streamed_ids(self, path: str, body: dict) -> list[int] | None:
        ids = []
        with httpx.stream("POST", self.url + path, json={**body, "stream": True}, timeout=HANG_S) as response:
            self.record("stream", response.status_code)
            if response.status_code != 200:
                response.read()
                return None
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        if events[-1:] != ["[DONE]"]:
            with self.lock:
                self.unexpected.append(f"a stream without [DONE]: {events[-2:]}")
            return None
        for event in events[:-1]:
            chunk = json.loads(event)
            if "error" in chunk:
                self.record("stream_error", chunk["error"].get("code") or "error")
                return None
            ids += chunk["choices"][0].get("token_ids") or [] if chunk["choices"] else []
        return ids

    def stream_cut(self, rnd: random.Random) -> None:
        """A client that reads a few chunks of a long reply and hangs up."""
        body = {**self._body(rnd), "max_tokens": 400, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=HANG_S) as response:
            self.record("stream_cut", response.status_code)
            for n, _ in enumerate(response.iter_lines()):
                if n >= rnd.randint(1, 6):
                    break

    def client_timeout(self, rnd: random.Random) -> None:
        """A client that gives up before the reply (no max_tokens: the rest of the context)."""
        body = {"prompt": rnd.choice(CODE_PROMPTS), "temperature": 0}
        self.post("/v1/completions", json=body, timeout=rnd.choice([0.05, 0.2, 0.5]))
        self.record("client_timeout", "finished")

    def bad(self, rnd: random.Random) -> None:
        """A malformed request: each must be a 4xx."""
        raws = ['{"prompt": "\\ud800", "max_tokens": 2}', '{"prompt": "x", "max_tokens": "10"}',
                '{"prompt": [true, false]}', '{"prompt": "x", "temperature": 1e400}', '{"prompt": ""}',
                '{"prompt": "x", "stream": "yes"}', '{"prompt": "x", "functions": []}', '{"prompt": ',
                '{"messages": [{"role": "\\udc00", "content": "x"}]}', '{"model": "nope", "prompt": "x"}',
                '{"prompt": [999999999]}', '[]', '{"prompt": "x", "max_tokens": 0}']
        raw = rnd.choice(raws)
        path = "/v1/chat/completions" if "messages" in raw else "/v1/completions"
        response = self.post(path, content=raw.encode("utf-8", "surrogatepass"),
                             headers={"Content-Type": "application/json"})
        self.record("bad", response.status_code, response.text)
        if not 400 <= response.status_code < 500:
            with self.lock:
                self.unexpected.append(f"bad {raw[:60]!r}: {response.status_code}")

    def huge(self, rnd: random.Random) -> None:
        """A 20 MiB body (past the cap), a 3 MiB text (under it, past the context), or ids past the context."""
        choice = rnd.randint(0, 2)
        if choice == 0:
            body = b'{"prompt": "' + b"a" * (20 << 20) + b'"}'
        elif choice == 1:
            body = json.dumps({"prompt": "word " * (600 << 10), "max_tokens": 2}).encode()
        else:
            body = json.dumps({"prompt": [5] * 200_000, "max_tokens": 2}).encode()
        response = self.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        self.record("huge", response.status_code, response.text)
        if response.status_code not in (400, 413):
            with self.lock:
                self.unexpected.append(f"huge #{choice}: {response.status_code} {response.text[:200]}")

    def queue_burst(self, rnd: random.Random) -> None:
        """Short requests fired together: served, or refused with 429 and Retry-After, never a 5xx."""
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: self.post("/v1/completions", json={**self._body(rnd), "max_tokens": 4}),
                                    range(4)))
        for response in replies:
            self.record("queue_burst", response.status_code, response.text)
            if response.status_code == 429 and "retry-after" not in response.headers:
                with self.lock:
                    self.unexpected.append("a 429 without Retry-After")


def watch_health(url: str, control: str, stop: threading.Event, latencies: list[float], controls: list[float],
                 failures: list[str]) -> None:
    with httpx.Client(timeout=HANG_S) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                status = client.get(url + "/health").status_code
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
                status = None
            latencies.append((time.perf_counter() - start) * 1000)
            if status not in (200, None):
                failures.append(f"/health {status}")
            start = time.perf_counter()
            try:
                client.get(control + "/health")
                controls.append((time.perf_counter() - start) * 1000)
            except httpx.HTTPError:  # the control only gives the machine's share of the latency
                controls.append(float("nan"))  # kept, so the n-th control stays beside the n-th /health
            stop.wait(HEALTH_EVERY_S)


def summary(values: list[float]) -> dict:
    values = [v for v in values if v == v]  # a control that did not answer (NaN) is no latency
    return {"count": len(values), "median": round(statistics.median(values), 1),
            "p99": round(percentile(values, 0.99), 1), "max": round(max(values), 1),
            "over_limit": sum(v >= HEALTH_LIMIT_MS for v in values)} if values else {}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--model", default=None, help="served model (default: the shipped default pair)")
    parser.add_argument("--drafter", default=None, help="the server's --drafter (default: the model's own, if any)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args()

    port = free_port()
    log = tempfile.NamedTemporaryFile(mode="w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "tensorfold_core", "serve", *([args.model] if args.model else []), "--port",
           str(port), "--parallel", "4", "--max-queued", "16", "--grace-s", "10", "--read-timeout-s", "5",
           *(["--drafter", args.drafter] if args.drafter else [])]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.25)
    else:
        server.kill()
        print(Path(log.name).read_text()[-3000:])
        return 1

    control_port = free_port()
    control = subprocess.Popen([sys.executable, "-c", CONTROL, str(control_port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    control_url = f"http://127.0.0.1:{control_port}"
    for _ in range(200):
        try:
            httpx.get(control_url, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)

    soak, stop, latencies, controls, health_failures = Soak(url, args.seed), threading.Event(), [], [], []
    watcher = threading.Thread(target=watch_health, args=(url, control_url, stop, latencies, controls,
                                                          health_failures), daemon=True)
    watcher.start()
    started = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(soak.one, range(args.requests)))
    elapsed = time.monotonic() - started

    # quiet: every stream ended, so the ledger holds no stream cache and no drafter slot
    memory = {}
    for _ in range(200):
        health = httpx.get(url + "/health", timeout=HANG_S).json()
        memory = health["memory"]["held_by_kind"]
        if health["streams"] == 0 and health["queued"] == 0 and not memory.get("stream_cache") \
                and not memory.get("drafter_slot"):
            break
        time.sleep(0.1)
    stop.set()
    watcher.join()
    control.terminate()
    control.wait()

    # SIGTERM with streams running: each must end with [DONE], and the process with 0
    ended: list[str] = []
    streaming = [threading.Event() for _ in range(4)]

    def last_event(first: threading.Event) -> None:
        body = {"prompt": CODE_PROMPTS[0], "temperature": 0, "stream": True, "draft": False}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    first.set()
        first.set()
        ended.append(events[-1] if events else f"status {response.status_code}")

    finals = [threading.Thread(target=last_event, args=(first,)) for first in streaming]
    for thread in finals:
        thread.start()
    for first in streaming:  # every one of them is streaming before the signal
        first.wait(HANG_S)
    server.send_signal(signal.SIGTERM)
    for thread in finals:
        thread.join(HANG_S)
    exit_code = server.wait(HANG_S)

    report = {
        "requests": args.requests, "concurrency": args.concurrency, "seconds": round(elapsed, 1),
        "statuses": {str(k): v for k, v in sorted(soak.statuses.items(), key=str)},
        "server_errors": len(soak.server_errors), "hangs": len(soak.hangs), "unexpected": len(soak.unexpected),
        "compared_with_draft_false": soak.compared, "mismatches": len(soak.mismatches),
        "health_ms": summary(latencies), "control_health_ms": summary(controls),
        "health_over_limit_beside_a_quick_control": sum(h >= HEALTH_LIMIT_MS and c < QUICK_MS
                                                        for h, c in zip(latencies, controls)),
        "health_failures": len(health_failures), "ledger_after": memory,
        "sigterm": {"exit_code": exit_code, "streams_ended": ended},
    }
    print(json.dumps(report, indent=2))
    for name, items in (("5xx", soak.server_errors), ("hangs", soak.hangs), ("mismatches", soak.mismatches),
                        ("unexpected", soak.unexpected), ("health", health_failures)):
        for item in items[:10]:
            print(f"{name}: {item}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = (not soak.server_errors and not soak.hangs and not soak.mismatches and not soak.unexpected
          and not health_failures and max(latencies) < HEALTH_LIMIT_MS
          and not memory.get("stream_cache") and not memory.get("drafter_slot")
          and exit_code == 0 and all(e == "data: [DONE]" for e in ended))
    print(f"soak: {'PASS' if ok else 'FAIL'} (server log: {log.name})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
