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


@pytest.fixture(scope="module")
def shipped(request):
    """The shipped default pair (tiny-llama drafted by tiny-llama-drafter, float32) behind a real server, untimed so
    its drafts do not depend on how busy the machine is."""
    from tensorfold_core.loading import load_host
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.server import start_in_thread

    host = load_host(None, ServeOptions(parallel=4, context=512, dtype="float32"), timed=False)
    assert host.drafter is not None
    server = start_in_thread(host)
    yield server
    server.stop()
    host.close()
