"""Helpers for benchmarks: a fresh `tensorfold serve` subprocess per cell, and the openai client."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server(model: str | None, *flags: str, env: dict | None = None, timeout: float = 300):
    """A fresh server process; yields its base URL and stops it afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "tensorfold_core", "serve", *([model] if model else []), "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError("server did not start in time")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def openblas_env() -> dict:
    """LD_PRELOAD of Debian's pthread OpenBLAS where installed, so MLX's CPU matmuls use it."""
    for path in ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
                 "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"):
        if os.path.exists(path):
            return {"LD_PRELOAD": path}
    return {}


def words(text: str) -> list[str]:
    return re.findall(r"\S+", text)
