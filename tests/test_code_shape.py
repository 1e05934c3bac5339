"""The shape the code keeps: short functions, modules of one concept, imports that point one way.

These are the limits the project holds itself to (see the README's layout table): a module over
500 lines or a function over 60 is split by concept, and lower layers never import upper ones
(`api -> baselm -> {store, metal}`; a model does not know a file format).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("baselm", "api", "store", "metal")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _sources(folders: tuple[str, ...]) -> list[Path]:
    files = []
    for folder in folders:
        files += [p for p in (ROOT / folder).rglob("*.py") if "fixtures" not in p.parts]
    return sorted(files)


def _imports(path: Path) -> set[str]:
    """Every module name an import statement in `path` names, at any depth of the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_module_is_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in _sources((*PACKAGES, "tests", "scripts"))
        if (n := p.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_60_lines():
    long = {}
    for path in _sources((*PACKAGES, "tests", "scripts")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                num_lines = node.end_lineno - node.lineno + 1
                if num_lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = num_lines
    assert long == {}


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("store", ("baselm.api", "baselm.engine", "baselm.scheduler", "baselm.chat", "baselm.models")),
        ("metal", ("baselm.api", "baselm.store", "baselm.engine", "baselm.scheduler", "baselm.kv", "baselm.models")),
        ("baselm/models", ("baselm.store", "baselm.api", "baselm.engine", "baselm.scheduler")),
    ],
)
def test_lower_layers_do_not_import_upper_ones(folder, forbidden):
    bad = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith(forbidden)) for p in _sources((folder,))
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_baselm_does_not_import_api_except_the_cli():
    bad = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("baselm.api"))
        for p in _sources(("baselm",))
        if p.name != "cli.py"
    }
    assert {k: v for k, v in bad.items() if v} == {}
