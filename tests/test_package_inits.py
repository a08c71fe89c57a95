"""A package's __init__.py says what the package is and re-exports: its logic lives in modules
named for their job, so that a reader finds it by the file's name (issue 57: under 60 lines,
no logic)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "meshrun"
INITS = sorted(SRC.rglob("__init__.py"))
MAX_LINES = 60


def _logic(tree: ast.Module) -> list[str]:
    """The statements that are not a docstring, an import or a plain name binding."""
    found = []
    for node in tree.body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        names = isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.startswith("__") for t in node.targets
        )
        if not (docstring or names or isinstance(node, ast.Import | ast.ImportFrom)):
            found.append(f"line {node.lineno}: {type(node).__name__}")
    return found


@pytest.mark.parametrize("init", INITS, ids=lambda p: str(p.relative_to(SRC)))
def test_a_package_init_only_describes_and_reexports(init: Path):
    source = init.read_text()
    assert len(source.splitlines()) < MAX_LINES
    assert _logic(ast.parse(source)) == []


def test_logic_in_an_init_is_found():
    """The check sees a function, a class and a computed binding as what they are."""
    tree = ast.parse('"""doc"""\nimport os\n__all__ = ["x"]\ndef f(): pass\nclass C: pass\nx = 1\n')
    assert _logic(tree) == ["line 4: FunctionDef", "line 5: ClassDef", "line 6: Assign"]
