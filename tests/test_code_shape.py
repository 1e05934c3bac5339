"""The shape the code keeps: short functions, modules of one concept, imports that point one way.

These are the limits the project holds itself to (see the layout table in docs/architecture.md): a module over
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
    """Every module name an import statement in `path` names, at any depth of the file, and for
    `from X import y` also `X.y` (y may be a module: `from baselm import api`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
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


# The command layer: what `base X` does (baselm/commands/) under the CLI's declarations (baselm/cli.py).
COMMAND_LAYER = ("baselm/cli.py", "baselm/commands/")


def _in_command_layer(path: Path) -> bool:
    return str(path.relative_to(ROOT)).startswith(COMMAND_LAYER)


def test_the_engine_layer_never_imports_api():
    """`api -> baselm -> {store, metal}`: only the command layer above both (`base serve` starts the HTTP
    server) names `baselm.api`; the engine, structured output and tool calls included, never does."""
    bad = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith("baselm.api"))
        for p in _sources(("baselm", "store", "metal"))
        if not _in_command_layer(p)
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_only_the_cli_imports_commands():
    """Commands are a layer: nothing below them (engine, api, store, metal) imports a command or the CLI."""
    bad = {
        str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.startswith(("baselm.commands", "baselm.cli")))
        for p in _sources(PACKAGES)
        if not _in_command_layer(p)
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_commands_live_in_the_command_layer():
    """A module that declares options (typer) is a command, and commands live in baselm/commands/ and cli.py."""
    bad = sorted(
        str(p.relative_to(ROOT)) for p in _sources(PACKAGES) if "typer" in _imports(p) and not _in_command_layer(p)
    )
    assert bad == []


def _exits(tree: ast.AST) -> list[ast.AST]:
    """The calls and raises in `tree` that end the process: sys.exit, os._exit, raise SystemExit."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if isinstance(node.func.value, ast.Name) and (node.func.value.id, node.func.attr) in (
                ("sys", "exit"),
                ("os", "_exit"),
            ):
                found.append(node)
        elif isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id == "SystemExit":
                found.append(node)
    return found


def _hidden_exits(path: Path) -> list[str]:
    """Exits below the command layer that a caller cannot see: outside a function whose name says it
    exits (`exit_process`, `follow_and_exit`), a program's `main`, or its `if __name__ == "__main__"` block."""
    tree = ast.parse(path.read_text())
    allowed: set[int] = set()
    for node in ast.walk(tree):
        is_exit_fn = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
            "exit" in node.name or node.name == "main"
        )
        is_main_block = isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
        if is_exit_fn or is_main_block:
            allowed.update(id(n) for n in _exits(node))
    return [f"{path.relative_to(ROOT)}:{n.lineno}" for n in _exits(tree) if id(n) not in allowed]


def test_every_process_exit_is_visible_at_the_call_site():
    """Below the command layer a process ends only in a function named for it, so `load_model_for(...)`
    can never quietly not return."""
    bad = [line for p in _sources(PACKAGES) if not _in_command_layer(p) for line in _hidden_exits(p)]
    assert bad == []


FOLDERS = {
    "baselm": ROOT / "baselm",
    "baselm.api": ROOT / "api",
    "baselm.store": ROOT / "store",
    "baselm.metal": ROOT / "metal",
}


def _module_name(path: Path) -> str:
    for name, folder in FOLDERS.items():
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            return ".".join([name, *parts[:-1]] if parts[-1] == "__init__" else [name, *parts])
    raise ValueError(path)


def _folder(package: str) -> Path | None:
    head, _, rest = package.partition(".")
    top, _, rest = rest.partition(".")
    root = f"{head}.{top}" if f"{head}.{top}" in FOLDERS else head
    folder = FOLDERS.get(root)
    if folder is None:
        return None
    tail = package[len(root) :].strip(".")
    return folder.joinpath(*tail.split(".")) if tail else folder


def _package_of(module: str) -> str:
    """The node of the package graph a module belongs to: its folder, where the folder has no
    subpackages; else the module itself (a folder's loose modules and each of its subfolders are
    siblings: `baselm.engine`, `baselm.runner`, `baselm.speculative`, `baselm.api.serving`, `baselm.api.openai`)."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        folder = _folder(".".join(parts[:i]))
        if folder is not None and folder.is_dir():
            has_subpackages = any((c / "__init__.py").exists() for c in folder.iterdir() if c.is_dir())
            if not has_subpackages or i == len(parts):
                return ".".join(parts[:i])
            return ".".join(parts[: i + 1])
    return module


def _package_graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in _sources(PACKAGES):
        node = _package_of(_module_name(path))
        for name in _imports(path):
            if name.startswith("baselm.") and (target := _package_of(name)) not in (node, "baselm"):
                edges.setdefault(node, set()).add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (top := stack.pop()) != node:
                group.append(top)
            if group:
                groups.append(sorted([node, *group]))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def test_no_import_cycles_between_packages():
    """Packages import each other one way (e.g. runner -> sampling <- speculative, never back)."""
    assert _cycles(_package_graph()) == []


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _package_of("baselm.speculative.speculator") == "baselm.speculative"
    assert _package_of("baselm.runner") == "baselm.runner"
    assert _package_of("baselm.distributed.tp.engine") == "baselm.distributed.tp"
    assert _package_of("baselm.distributed.launch") == "baselm.distributed.launch"
    assert _package_of("baselm.api.openai.chat") == "baselm.api.openai"


def test_every_package_is_installed():
    """`pip install .` installs the packages pyproject.toml lists: each folder of code is there."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module_name(init) for init in _sources(PACKAGES) if init.name == "__init__.py"}
    assert found - listed == set()
