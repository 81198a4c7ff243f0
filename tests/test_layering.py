"""The folders import only below themselves: the rule table is docs/architecture.md's
`layers` block, and this test reads every import of the product packages (module level
and inside functions) and fails on one that runs up the layering, or into lab code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARCHITECTURE = REPO / "docs" / "architecture.md"
LAB = {"tests", "bench", "scripts"}


def rules(text: str) -> dict[str, set[str]]:
    """The `layers` block: `PACKAGE: ALLOWED ...` per line; `*` allows every package.

    A dotted name (builder.format) is a room with a rule of its own: it may import only what
    its line names, plus itself."""
    m = re.search(r"```layers\n(.*?)```", text, re.DOTALL)
    if not m:
        raise AssertionError(f"{ARCHITECTURE}: no ```layers block")
    table: dict[str, set[str]] = {}
    for line in m.group(1).splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, allowed = line.partition(":")
        table[name.strip()] = set(allowed.split())
    return table


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, source: str) -> list[tuple[int, str]]:
    """Every module `path` imports: (line, absolute dotted name), relative imports resolved."""
    tree = ast.parse(source, str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # `from pkg import name`: pkg.name, a module or a name of pkg (the rule is the same)
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return out


def room(name: str, table: dict[str, set[str]]) -> str | None:
    """The most specific rule that covers module `name`."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in table:
            return ".".join(parts[:i])
    return None


def allowed(importer: str, imported: str, table: dict[str, set[str]]) -> bool:
    mine = room(importer, table)
    assert mine is not None
    theirs = room(imported, table)
    top = imported.split(".")[0]
    if theirs is None:
        return top not in LAB  # the standard library and third-party packages
    if theirs == mine or theirs.startswith(mine + ".") or "*" in table[mine]:
        return True
    names = table[mine]
    # allowed if the imported module, or a package that contains it, is named
    return any(imported == n or imported.startswith(n + ".") for n in names)


def violations(table: dict[str, set[str]], files: list[tuple[Path, str]]) -> list[str]:
    """The imports of `files` ((path, source)) that the table does not allow, one line each."""
    found = []
    for path, source in files:
        me = module_name(path)
        if room(me, table) is None:
            continue
        for line, name in imports(path, source):
            if not allowed(me, name, table):
                found.append(f"{path.relative_to(REPO)}:{line}: {me} imports {name} "
                             f"({room(me, table)} may import {' '.join(sorted(table[room(me, table)])) or 'nothing'})")
    return sorted(set(found))


def product_files(table: dict[str, set[str]]) -> list[tuple[Path, str]]:
    tops = {name.split(".")[0] for name in table}
    return [(p, p.read_text()) for p in sorted(p for top in tops for p in (REPO / top).rglob("*.py"))]


def test_every_product_package_has_a_rule():
    table = rules(ARCHITECTURE.read_text())
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    missing = packages - {n.split(".")[0] for n in table}
    assert not missing, f"packages without a line in docs/architecture.md's layers block: {sorted(missing)}"


def test_no_import_runs_up_the_layering():
    table = rules(ARCHITECTURE.read_text())
    found = violations(table, product_files(table))
    assert not found, "imports against docs/architecture.md:\n" + "\n".join(found)


@pytest.mark.parametrize(("source", "bad"), [
    ("import snapshotter.local\n", True),                     # cache -> snapshotter: up
    ("def f():\n    from p2p import swarm\n", True),          # a lazy import counts too
    ("from tests.lab import netlab\n", True),                 # lab code in the product
    ("from . import store\nimport builder.format\n", False),  # itself, and below
    ("import json, zstandard\n", False),                      # outside the house
])
def test_the_check_catches_an_upward_import(source, bad):
    table = rules(ARCHITECTURE.read_text())
    probe = REPO / "cache" / "probe.py"  # a module of cache/ that is not on disk
    assert bool(violations(table, [(probe, source)])) is bad
