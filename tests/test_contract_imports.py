"""The contract's modules import one another without circles, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import tensorfold_contract


def module_names(package_dir: Path, package_name: str) -> dict[str, Path]:
    """Every module of a package (sub-packages too), by dotted name; a package is its `__init__.py`."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package_name, *parts])] = path
    return out


def imported(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `module` imports anywhere in its text (a function's body included)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from pkg import mod` imports the module pkg.mod; `from pkg.mod import name` imports pkg.mod
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {name for name in found if name in modules and name != module}


def import_graph(package_dir: Path, package_name: str) -> dict[str, set[str]]:
    modules = module_names(package_dir, package_name)
    return {name: imported(name, path, modules) for name, path in modules.items()}


def import_cycles(package_dir: Path, package_name: str) -> list[list[str]]:
    """Each set of modules that import one another round a circle (a strongly connected component), sorted."""
    graph = import_graph(Path(package_dir), package_name)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's algorithm; a package has few enough modules for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


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
