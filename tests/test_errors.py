"""Every error the library raises is a `TskvError`, so a caller catches tskv's own in one clause
(and each is still the builtin it always was: a ValueError, a TypeError, ...).

The raise statements are read from the source of every library module (core, curve, shells),
so a new one is checked the day it is written. What each raises is resolved in its module: a
class, a function whose return annotation names the classes it makes, or a parameter whose
annotation is `type[...]` of them. Trio's own signals (a channel's end, `WouldBlock`) and the
iterator protocol's are allowed by name, and a bare `raise` re-raises what was caught.
"""

from __future__ import annotations

import ast
import importlib
import typing
from pathlib import Path

import pytest
import trio

from tskv.core.errors import TskvError

PACKAGE = Path(__file__).resolve().parents[1] / "tskv"
LAYERS = ("core", "curve", "shells")
# Signals of a protocol, not errors: what a Trio API or an async iterator says by raising.
PROTOCOL = {StopAsyncIteration, trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError}


def library_modules() -> list[str]:
    return sorted(
        f"tskv.{layer}.{path.stem}"
        for layer in LAYERS
        for path in (PACKAGE / layer).glob("*.py")
        if path.stem != "__init__"
    )


def _resolve(module: object, expression: ast.expr) -> object:
    """The object a name or dotted name in a module stands for."""
    if isinstance(expression, ast.Name):
        return getattr(module, expression.id)
    if isinstance(expression, ast.Attribute):
        return getattr(_resolve(module, expression.value), expression.attr)
    raise AssertionError(f"cannot resolve {ast.unparse(expression)}")


def _classes_of_annotation(module: object, annotation: str) -> list[type]:
    """The classes an annotation such as `TskvValueError | TskvTypeError` or `type[X]` names."""
    namespace = vars(module)
    found: list[type] = []
    for name in annotation.replace("type[", "").replace("]", "").split("|"):
        name = name.strip()
        found.append(eval(name, namespace))
    return found


def _raised(module: object, function: ast.AST | None, node: ast.Raise) -> list[type]:
    """The classes a raise statement may raise."""
    exc = node.exc
    assert exc is not None
    target = exc.func if isinstance(exc, ast.Call) else exc
    function_def = (ast.FunctionDef, ast.AsyncFunctionDef)
    if isinstance(target, ast.Name) and isinstance(function, function_def):
        for argument in [*function.args.args, *function.args.kwonlyargs]:
            if argument.arg == target.id:  # a parameter: its annotation says which classes
                assert argument.annotation is not None, f"{target.id} has no annotation"
                return _classes_of_annotation(module, ast.unparse(argument.annotation))
        local = _local_annotation(function, target.id)
        if local is not None:
            return _classes_of_annotation(module, local)
    if not isinstance(exc, ast.Call):
        return []  # `raise error`: an instance caught or kept earlier, raised again
    if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
        made = _method(module, target.attr)  # `raise self._closed_error()`: a builder method
    else:
        made = _resolve(module, target)
    if isinstance(made, type):
        return [made]
    hints = typing.get_type_hints(made)  # a function that builds the error
    returned = hints["return"]
    return list(typing.get_args(returned)) or [returned]


def _method(module: object, name: str) -> object:
    for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__ and name in vars(value):  # type: ignore[attr-defined]
            return vars(value)[name]
    raise AssertionError(f"no method {name} in {module}")


def _local_annotation(function: ast.AST, name: str) -> str | None:
    for node in ast.walk(function):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == name
        ):
            return ast.unparse(node.annotation)
    return None


def _raises(module_name: str) -> list[tuple[int, list[type]]]:
    module = importlib.import_module(module_name)
    tree = ast.parse(Path(module.__file__ or "").read_text())
    found: list[tuple[int, list[type]]] = []

    def visit(node: ast.AST, function: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (
                child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            )
            if isinstance(child, ast.Raise) and child.exc is not None:
                found.append((child.lineno, _raised(module, function, child)))
            visit(child, inner)

    visit(tree, None)
    return found


@pytest.mark.parametrize("module_name", library_modules())
def test_every_error_the_library_raises_is_a_tskv_error(module_name: str) -> None:
    wrong = [
        f"{module_name}:{line} raises {kind.__name__}"
        for line, kinds in _raises(module_name)
        for kind in kinds
        if not issubclass(kind, TskvError) and kind not in PROTOCOL
    ]
    assert wrong == []


def test_the_walk_sees_raises_of_every_kind() -> None:
    """It reads classes, builder functions and parameters: not an empty walk that passes."""
    kinds = {kind for module in library_modules() for _, found in _raises(module) for kind in found}
    names = {kind.__name__ for kind in kinds}
    assert {"ConfigError", "WireError", "TskvTypeError", "TskvValueError"} <= names
    assert len(library_modules()) > 30
