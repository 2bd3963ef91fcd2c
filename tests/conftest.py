"""Shared fixtures: a tiny real checkpoint, and one HTTP server over it per test module."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    from tensorfold_core.testing import tiny_llama_checkpoint

    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def served(tiny_llama_path):
    """A real host (parallel=4) behind a real server on a free loopback port; `.url`, `.host`, `.stop()`."""
    from tensorfold_core.loading import load_host
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.server import start_in_thread

    host = load_host(str(tiny_llama_path), ServeOptions(parallel=4))
    server = start_in_thread(host)
    yield server
    server.stop()
    host.close()
