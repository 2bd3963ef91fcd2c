"""The tensorfold command: check mode, capabilities, families, and one-line usage errors."""

import json
import os
import subprocess
import sys

import pytest

from tensorfold_core.row_kernels.modules import COMPILE_ENV
from tensorfold_core.testing import tiny_llama_checkpoint


def tensorfold(*args, check=False, env=None):
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "tensorfold_core", *args], capture_output=True, text=True,
                          env=env, check=check, timeout=300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("cli"), seed=1)


def test_run_json_prints_text_token_ids_and_rounds_that_repeat_exactly(checkpoint):
    first = json.loads(tensorfold("run", str(checkpoint), "def add(a, b):", "--max-tokens", "12", "--json",
                                  check=True).stdout)
    again = json.loads(tensorfold("run", str(checkpoint), "def add(a, b):", "--max-tokens", "12", "--json",
                                  check=True).stdout)
    assert first["token_ids"] == again["token_ids"]
    assert len(first["token_ids"]) <= 12
    assert sum(r["tokens"] for r in first["rounds"]) == len(first["token_ids"])
    assert first["usage"]["prompt_tokens"] == len(first["prompt_ids"])


def test_run_prints_the_decoded_text(checkpoint):
    as_json = json.loads(tensorfold("run", str(checkpoint), "class P:", "--max-tokens", "8", "--json",
                                    check=True).stdout)
    plain = tensorfold("run", str(checkpoint), "class P:", "--max-tokens", "8", check=True).stdout
    assert plain == as_json["text"] + "\n"


def test_capabilities_json_shows_backend_families_row_invariance_and_serve_flags():
    info = json.loads(tensorfold("capabilities", "--json", check=True).stdout)
    assert info["backend"] in ("cpu", "gpu")
    assert "llama" in [f["name"] for f in info["families"]]
    assert isinstance(info["row_invariance"]["row_invariant"], bool)
    assert {"parallel", "context", "dtype", "port"} <= set(info["serve_flags"])


def test_capabilities_json_says_whether_the_cpu_runs_layers_compiled_or_op_by_op():
    assert json.loads(tensorfold("capabilities", "--json", check=True).stdout)["layers_compiled"] is True
    op_by_op = tensorfold("capabilities", "--json", check=True, env={COMPILE_ENV: "0"})
    assert json.loads(op_by_op.stdout)["layers_compiled"] is False


def test_the_backend_probe_leaves_quantized_matmul_unprobed_on_cuda_and_counts_it_not_invariant(monkeypatch):
    import tensorfold_core.backend as probe

    assert isinstance(probe.backend_row_invariance()["ops"]["quantized_matmul_4bit"], bool)  # probed on this CPU
    monkeypatch.setattr(probe, "backend", lambda: "cuda")  # where a first 8-row call builds a kernel for ~40 s
    on_cuda = probe.backend_row_invariance()
    assert on_cuda["ops"]["quantized_matmul_4bit"] is None
    assert on_cuda["row_invariant"] is False


@pytest.mark.parametrize("args, needle", [
    (["serve", "--parallel", "0"], "--parallel"),
    (["serve", "--dtype", "float8"], "--dtype"),
    (["run"], "MODEL"),
    (["nonsense"], "nonsense"),
])
def test_a_usage_error_exits_2_with_one_line_naming_the_flag(args, needle):
    result = tensorfold(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]


def test_a_missing_model_dir_is_one_line_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    result = tensorfold("run", str(missing), "x")
    assert result.returncode == 2
    assert "no-such-model" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_docs_flag_list_is_the_options_table():
    from pathlib import Path

    from tensorfold_core.options import flags_markdown

    docs = (Path(__file__).parent.parent / "docs" / "flags.md").read_text()
    assert flags_markdown() in docs, "regenerate docs/flags.md with `python -m tensorfold_core.options`"
