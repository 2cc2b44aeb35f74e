"""The shape issue #47 asked of the code, checked on its source (no imports, no network)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("p2p", "dedloc_jax", "models", "examples")
MAX_FUNCTION_LINES = 100
MAX_PEER_LINES = 350


def _sources(*packages: str) -> Iterator[tuple[Path, ast.Module]]:
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _outermost_functions(node: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions and methods not nested in another function (a nested one is its parent's)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield child
        else:
            yield from _outermost_functions(child)


def test_no_function_is_over_100_lines_nested_ones_counted_in_their_parent() -> None:
    long = [
        f"{path.relative_to(ROOT)}:{fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
        for path, tree in _sources(*PACKAGES)
        for fn in _outermost_functions(tree)
        if fn.end_lineno is not None and fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_peer_keeps_membership_only() -> None:
    lines = len((ROOT / "dedloc_jax" / "peer.py").read_text().splitlines())
    assert lines <= MAX_PEER_LINES


def test_dedloc_jax_types_its_nodes_and_dhts() -> None:
    """A part's node or DHT is typed (an ``Any`` hid which of them a part needed)."""
    untyped = []
    for path, tree in _sources("dedloc_jax"):
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
            for arg in args:
                if arg.arg in ("node", "dht") and (
                    arg.annotation is None or ast.unparse(arg.annotation) == "Any"
                ):
                    untyped.append(f"{path.relative_to(ROOT)}:{fn.name}({arg.arg})")
    assert untyped == []


def test_no_part_is_told_apart_by_its_attributes() -> None:
    """No ``hasattr`` in the collaboration or the volunteer program: what a host or a part
    offers is its type's (``host.py``'s protocols), not found out at run time."""
    found = [
        f"{path.relative_to(ROOT)}:{call.lineno}"
        for path, tree in _sources("dedloc_jax", "examples")
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "hasattr"
    ]
    assert found == []
