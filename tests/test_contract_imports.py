"""The contract's modules import one another without circles, imports inside functions included."""

from __future__ import annotations

from pathlib import Path

import tensorfold_contract
from tensorfold_core.testing import import_cycles, import_graph

CONTRACT = Path(tensorfold_contract.__file__).parent


def test_the_contract_s_modules_import_one_another_without_a_circle():
    assert import_cycles(CONTRACT, "tensorfold_contract") == []


def test_the_runner_and_the_isolated_child_share_their_steps_from_a_module_that_imports_neither():
    graph = import_graph(CONTRACT, "tensorfold_contract")
    assert "tensorfold_contract.steps" in graph["tensorfold_contract.isolate"]
    assert "tensorfold_contract.steps" in graph["tensorfold_contract.runner"]
    assert not {"tensorfold_contract.runner", "tensorfold_contract.isolate"} & graph["tensorfold_contract.steps"]


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    (tmp_path / "__init__.py").write_text("from .a import f\n")
    (tmp_path / "a.py").write_text("from . import b\n\ndef f():\n    return b.g()\n")
    (tmp_path / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    (tmp_path / "sub" / "c.py").write_text("import pkg.sub.d\n")
    (tmp_path / "sub" / "d.py").write_text("from ..sub import c\nfrom .. import a\n")
    assert import_cycles(tmp_path, "pkg") == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
