"""The house's layers, as the README's "How it works" says them: nothing in ``autoshard/cost/`` or
``autoshard/rules/`` imports from ``autoshard/passes/`` or ``autoshard/planner/`` at module level
(a function may, when called; a type checker's import is no import)."""
import ast
import pathlib

import pytest

import autoshard

ROOT = pathlib.Path(autoshard.__file__).parent


def module_level_imports(path: pathlib.Path) -> list:
    """The modules ``path`` imports outside functions and ``if TYPE_CHECKING:`` blocks."""
    found = []

    def visit(body):
        for stmt in body:
            if isinstance(stmt, ast.Import):
                found.extend(a.name for a in stmt.names)
            elif isinstance(stmt, ast.ImportFrom) and stmt.module:
                found.append(stmt.module)
            elif isinstance(stmt, ast.If) and not (isinstance(stmt.test, ast.Name) and stmt.test.id == "TYPE_CHECKING"):
                visit(stmt.body)
                visit(stmt.orelse)
            elif isinstance(stmt, (ast.Try, ast.With)):
                visit(stmt.body)
            elif isinstance(stmt, ast.ClassDef):
                visit(stmt.body)

    visit(ast.parse(path.read_text()).body)
    return found


@pytest.mark.parametrize("layer", ["cost", "rules"])
def test_cost_and_rules_import_neither_passes_nor_planner(layer):
    wrong = {f"{layer}/{p.name}": m for p in sorted((ROOT / layer).glob("*.py"))
             for m in module_level_imports(p)
             if any(m == up or m.startswith(up + ".") for up in ("autoshard.passes", "autoshard.planner"))}
    assert not wrong, wrong


def test_the_check_sees_a_module_level_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nfrom autoshard.passes.annotate import annotate\n"
                    "if TYPE_CHECKING:\n    from autoshard.passes.capture import Graph\n"
                    "def f():\n    from autoshard.planner.solve import solve\n")
    assert module_level_imports(path) == ["typing", "autoshard.passes.annotate"]
