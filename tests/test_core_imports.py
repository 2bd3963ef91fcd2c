"""Core's floors: no import circles, arrows point down, and loading.py alone resolves and loads checkpoints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensorfold_core
from tensorfold_core.testing import import_cycles, import_graph

CORE = Path(tensorfold_core.__file__).parent
GRAPH = import_graph(CORE, "tensorfold_core")
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"


def core(*names: str) -> set[str]:
    return {f"tensorfold_core.{name}" for name in names}


def test_core_s_modules_import_one_another_without_a_circle():
    assert import_cycles(CORE, "tensorfold_core") == []


@pytest.mark.parametrize("floor, allowed", [
    ("lanes", core("protocols", "sampling", "traces", "lanes", "lanes.ahead", "lanes.constraints", "lanes.copy", "lanes.engine",
                   "lanes.aside", "lanes.grants", "lanes.guards", "lanes.holds", "lanes.pricing", "lanes.row_costs",
                   "lanes.rows", "lanes.stream", "lanes.types")),
    ("memory", core("errors", "sequences", "memory", "memory.admission", "memory.ledger", "memory.prompt_cache")),
    ("checkpoint", core("errors", "files", "tokenizer")),
    ("families", core("errors", "protocols")),
])
def test_a_lower_floor_imports_nothing_above_it(floor, allowed):
    modules = [m for m in GRAPH if m == f"tensorfold_core.{floor}" or m.startswith(f"tensorfold_core.{floor}.")]
    assert modules
    for module in modules:
        assert GRAPH[module] <= allowed, f"{module} imports {sorted(GRAPH[module] - allowed)}"


def test_the_host_runs_the_engine_and_knows_nothing_of_loading_plugins_or_the_server():
    above = core("loading", "plugins", "checkpoint", "capabilities", "cli", "server")
    assert not GRAPH["tensorfold_core.host"] & above
    server = [m for m in GRAPH if m.startswith("tensorfold_core.server")]
    assert all(not GRAPH[m] & core("host", "loading", "lanes.engine") for m in server)


# resolving a name (the hub, shipped names, local dirs), opening a checkpoint, and finding its family to load it
RESOLVES_OR_LOADS = re.compile(r"snapshot_download|\.shipped\(|\.family_for\(|Checkpoint\.open\(|"
                               r"def (resolve_model|load_model|load_target|load_host|start_drafter)\b")


def test_only_loading_resolves_or_loads_checkpoints():
    sources = [p for p in CORE.rglob("*.py") if p.name != "loading.py"]
    sources += list(PLUGINS.glob("*/tensorfold_*/**/*.py"))
    found = [f"{p.relative_to(CORE.parent)}: {m.group(0)}" for p in sources
             for m in RESOLVES_OR_LOADS.finditer(p.read_text())]
    assert found == []


@pytest.mark.parametrize("caller, seen", [(None, "0"), ("1", "1")])
def test_importing_the_core_turns_mlx_s_cuda_graphs_off_unless_the_caller_set_them(caller, seen):
    env = {k: v for k, v in os.environ.items() if k != tensorfold_core.CUDA_GRAPHS_ENV}
    if caller is not None:
        env[tensorfold_core.CUDA_GRAPHS_ENV] = caller
    done = subprocess.run([sys.executable, "-c", "import os, tensorfold_core; "
                           "print(os.environ[tensorfold_core.CUDA_GRAPHS_ENV])"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == seen
