"""The layers hold as the tree shows them: the core (`tskv/core/`) decides and does no I/O, CURVE
stands on the core, the shells on both, and no library module imports a tool.

The module lists are read from the tree itself, so a new module is checked the day it appears.
Imports are read from the source (those inside functions too, which run only sometimes), and
each core module is also imported in a fresh interpreter to prove that nothing it reaches,
third-party code included, brings in trio or zmq.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tskv"
# What each library layer may import from tskv; the package __init__ only re-exports.
MAY_IMPORT = {
    "core": ("tskv.core",),
    "curve": ("tskv.core", "tskv.curve"),
    "shells": ("tskv.core", "tskv.curve", "tskv.shells"),
}
TOOLS = ("tskv.sim", "tskv._cli", "tskv.testing", "tskv.pytest_plugin")
BENCHMARKS = PACKAGE.parent / "benchmarks"  # beside the package: not in the wheel


def modules(layer: str) -> list[str]:
    return sorted(
        f"tskv.{layer}.{path.stem}" if path.stem != "__init__" else f"tskv.{layer}"
        for path in (PACKAGE / layer).glob("*.py")
    )


def source(module: str) -> Path:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imported(module: str) -> set[str]:
    """Every tskv module `module` names in an import statement, wherever it stands."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source(module).read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name == "tskv" or name.startswith("tskv.")}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def import_graph() -> dict[str, set[str]]:
    """Each library module (tools aside) and the library modules it imports, wherever the
    import stands: a lazy import inside a function that closes a circle is still a circle."""
    library = [name for layer in MAY_IMPORT for name in modules(layer)]
    known = set(library)
    return {
        name: {target for target in imported(name) if target in known and target != name}
        for name in library
    }


def circle_from(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as the modules along it, or None (a depth-first search that
    meets a module still on its path has found one)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return [*path[path.index(name) :], name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            if (found := visit(target)) is not None:
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if (found := visit(name)) is not None:
            return found
    return None


def test_the_circle_finder_finds_a_circle() -> None:
    assert circle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle_from({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_library_module_imports_itself_round_a_circle() -> None:
    circle = circle_from(import_graph())
    assert circle is None, "an import circle: " + " -> ".join(circle or [])


def test_the_tree_has_every_layer() -> None:
    assert len(modules("core")) >= 10 and modules("curve") and modules("shells")
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    # Only the re-exports, the entry point and the tools stand beside the layers.
    assert loose == ["__init__.py", "__main__.py", "pytest_plugin.py", "testing.py"]


@pytest.mark.parametrize("layer", sorted(MAY_IMPORT))
def test_each_layer_imports_only_what_is_below_it(layer: str) -> None:
    for module in modules(layer):
        names = imported(module) - {"tskv"}  # `from tskv.core import codec` names the package
        outside = sorted(name for name in names if not within(name, MAY_IMPORT[layer]))
        assert outside == [], f"{module} imports {outside}"


def test_no_library_module_imports_a_tool() -> None:
    library = ["tskv", *(m for layer in MAY_IMPORT for m in modules(layer))]
    for module in library:
        tools = sorted(name for name in imported(module) if within(name, TOOLS))
        assert tools == [], f"{module} imports the tools {tools}"


def test_the_benchmark_stands_outside_the_package_and_nothing_in_it_imports_it() -> None:
    assert (BENCHMARKS / "__main__.py").is_file() and not (PACKAGE / "_bench").exists()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        names = {
            alias.name if isinstance(node, ast.Import) else node.module or ""
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for alias in node.names
        }
        assert not any(within(name, ("benchmarks",)) for name in names), module


# Load a core module and what it imports without running tskv/__init__.py (which re-exports the
# shells), then list what came in.
PROBE = """
import importlib, pathlib, sys, types
package = types.ModuleType("tskv")
package.__path__ = [{root!r}]
sys.modules["tskv"] = package
importlib.import_module({module!r})
print(" ".join(sorted(name for name in sys.modules if name.split(".")[0] in ("trio", "zmq"))))
"""


@pytest.mark.parametrize("module", modules("core"))
def test_a_core_module_never_reaches_trio_or_zmq(module: str) -> None:
    code = PROBE.format(root=str(PACKAGE), module=module)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"{module} brings in {done.stdout.strip()}"


# Sizes a reader takes in at once, counted in lines of code (docstrings aside: the entry points
# are asked to document their transitions, which should not cost them their place). Argument
# parsing is a list of flags, not logic, and is exempt.
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 600, 220, 60
FLAG_LISTS = {"build_parser", "sim_flags"}


def code_lines(node: ast.AST) -> int:
    docs = 0
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs += (first.end_lineno or first.lineno) - first.lineno + 1
    return (getattr(node, "end_lineno", 0) or 0) - getattr(node, "lineno", 0) + 1 - docs


def test_no_module_class_or_function_is_too_big_to_read_at_once() -> None:
    too_big = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE:
            too_big.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and code_lines(node) > MAX_CLASS:
                too_big.append(f"class {node.name}: {code_lines(node)}")
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and node.name not in FLAG_LISTS and code_lines(node) > MAX_FUNCTION:
                too_big.append(f"{path.name} {node.name}(): {code_lines(node)}")
    assert too_big == []


def test_every_class_says_why_it_exists() -> None:
    """A class is a concept a reader meets: each one opens with a docstring saying why it is
    there (its fields say what it holds)."""
    silent = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and ast.get_docstring(node) is None
    ]
    assert silent == []
