"""The OpenAPI document is the server's: the errors it answers with, and schemathesis finds nothing it breaks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tensorfold_core.options import ServeOptions
from tensorfold_core.server import Server


@pytest.fixture(scope="module")
def bounded(served):
    """A server over the shared host whose replies end within a second: generated requests may ask for the
    whole context, and the suite has no time for that."""
    server = Server(served.host, "127.0.0.1", 0, log_level="warning", options=ServeOptions(deadline_s=1.0)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def document(bounded):
    return httpx.get(bounded.url + "/openapi.json").json()


def test_the_document_names_the_openai_errors_and_never_a_422(document):
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "Retry-After" in responses["429"]["headers"]
    assert {"get", "head"} <= set(document["paths"]["/health"])
    assert "HTTPValidationError" not in document["components"]["schemas"]


def test_the_document_states_that_an_empty_prompt_is_refused(document):
    prompt = document["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    forms = prompt["anyOf"]
    assert all(form.get("minLength") == 1 or form.get("minItems") == 1 for form in forms)


def test_schemathesis_with_every_check_finds_no_failure(bounded, tmp_path):
    """The schemathesis CLI as a user runs it, every check on, a small fixed budget."""
    config = Path(__file__).parent / "schemathesis.toml"
    result = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run",
         bounded.url + "/openapi.json", "--checks", "all", "--max-examples", "15", "--seed", "1",
         "--suppress-health-check", "filter_too_much", "--no-color"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
