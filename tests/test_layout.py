"""The code layout is part of the design: which package may import which, and what ``pip install`` adds.

DESIGN.md: ``rlog`` is the lowest layer and imports nothing else of ours; ``bootstrap`` builds on
``rlog``; ``core`` and ``replicant`` build on both and never import each other; ``spark`` depends on
``rlog`` only; ``cli`` wires everything. Everything installs under one package, ``mnesite``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("rlog", "bootstrap", "core", "replicant", "spark", "cli")
# package -> the packages of ours it may import (itself always allowed)
ALLOWED = {
    "rlog": set(),
    "bootstrap": {"rlog"},
    "core": {"rlog", "bootstrap"},
    "replicant": {"rlog", "bootstrap"},
    "spark": {"rlog"},
    "cli": {"rlog", "bootstrap", "core", "replicant", "spark"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """Every (package of ours, line) that ``path`` imports, at any depth of the module (lazy imports too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mnesite" and len(parts) > 1 and parts[1] in PACKAGES:
                found.add((parts[1], node.lineno))
            elif parts[0] in PACKAGES:
                found.add((parts[0], node.lineno))  # a bare top-level import is itself a layout error
    return found


def layout_violations(repo: Path) -> list[str]:
    violations = []
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            for imported, line in imported_packages(path):
                if imported != package and imported not in ALLOWED[package]:
                    violations.append(f"{path.relative_to(repo)}:{line} imports {imported}")
    return violations


def test_every_package_imports_only_the_layers_below_it() -> None:
    assert layout_violations(REPO) == []


def test_the_import_rule_check_catches_a_violation(tmp_path: Path) -> None:
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "core" / "bad.py").write_text("def f():\n    from mnesite.replicant import node\n")
    (tmp_path / "rlog" / "bad.py").write_text("import mnesite.core.consensus\n")
    (tmp_path / "spark" / "bad.py").write_text("from core import node\n")
    assert sorted(layout_violations(tmp_path)) == [
        "core/bad.py:2 imports replicant",
        "rlog/bad.py:1 imports core",
        "spark/bad.py:1 imports core",
    ]


# Protocol decisions live in pure modules the deterministic simulator runs: they import neither the
# network (zmq) nor the database (apsw), directly or through any module of ours they import.
PURE_MODULES = (
    "bootstrap.copy",
    "bootstrap.fence",
    "bootstrap.serve",
    "core.agent",
    "core.agent_budget",
    "core.consensus",
    "core.consensus_wire",
    "core.guard_tail",
    "core.membership",
    "core.outcome",
    "core.recovery",
    "core.rules",
    "core.snapshot",
    "core.transaction",
    "core.watch",
    "replicant.reads",
    "replicant.replica",
    "replicant.upstream",
    "rlog.errors",
    "rlog.messages",
    "rlog.replication",
    "rlog.retention",
    "rlog.roles",
    "rlog.schema",
    "rlog.types",
)
IMPURE = {"zmq", "apsw"}


def _imports(repo: Path, module: str) -> tuple[set[str], set[str]]:
    """(external top-level packages, modules of ours) that ``module`` imports, at any depth."""
    external: set[str] = set()
    ours: set[str] = set()
    tree = ast.parse((repo / (module.replace(".", "/") + ".py")).read_text())
    for node in ast.walk(tree):
        names: list[tuple[str, list[str]]] = []
        if isinstance(node, ast.Import):
            names = [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [(node.module, [alias.name for alias in node.names])]
        for name, members in names:
            parts = name.split(".")
            if parts[0] != "mnesite":
                external.add(parts[0])
                continue
            base = ".".join(parts[1:])
            for member in members or [""]:
                candidate = f"{base}.{member}" if member else base
                ours.add(candidate if (repo / (candidate.replace(".", "/") + ".py")).exists() else base)
    return external, ours


def impure_imports(repo: Path, modules: tuple[str, ...]) -> list[str]:
    found = []
    for module in modules:
        seen: set[str] = set()
        todo = [(module, module)]
        while todo:
            current, path = todo.pop()
            if current in seen or not (repo / (current.replace(".", "/") + ".py")).exists():
                continue
            seen.add(current)
            external, ours = _imports(repo, current)
            found += [f"{module} imports {name} (via {path})" for name in sorted(external & IMPURE)]
            todo += [(other, f"{path} -> {other}") for other in ours]
    return found


def test_pure_modules_import_neither_zmq_nor_apsw() -> None:
    assert impure_imports(REPO, PURE_MODULES) == []


def test_the_purity_check_catches_an_indirect_import(tmp_path: Path) -> None:
    (tmp_path / "core").mkdir()
    (tmp_path / "rlog").mkdir()
    (tmp_path / "core" / "rules.py").write_text("from mnesite.rlog import helper\n")
    (tmp_path / "rlog" / "helper.py").write_text("def f():\n    import apsw\n")
    assert impure_imports(tmp_path, ("core.rules",)) == ["core.rules imports apsw (via core.rules -> rlog.helper)"]


def test_the_front_door() -> None:
    import mnesite

    assert mnesite.Client.__module__ == "mnesite.rlog.client"


@pytest.mark.slow
def test_a_wheel_installs_only_the_mnesite_package(tmp_path: Path) -> None:
    """``pip install .`` adds ``mnesite`` and its dist-info to site-packages, nothing generic."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("mnesite-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top_level = {name.split("/")[0] for name in archive.namelist()}
        names = set(archive.namelist())
    assert {name for name in top_level if not name.endswith(".dist-info")} == {"mnesite"}
    for module in ("core/node.py", "rlog/messages.py", "replicant/node.py", "cli/main.py", "spark/compare.py"):
        assert f"mnesite/{module}" in names
    assert not any(name.startswith("mnesite/tests") for name in names)


def _rule_table_rows(text: str, columns: int) -> list[str]:
    """The rows (header and rule lines dropped) of the markdown table with this many columns."""
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.count("|") == columns + 1]
    return [row for row in rows[2:] if not row.startswith("| ---")]


def _check_named_tests(rows: list[str], cell_index: int) -> int:
    """Every `test_x.py` and `::test_name` a row's test cell names exists; returns how many names."""
    named = 0
    for row in rows:
        cell = row.split("|")[cell_index]
        current = None
        for match in re.finditer(r"`(test_\w+\.py)?(?:::)?(\w*)`", cell):
            file, name = match.groups()
            current = file or current
            assert current is not None and (REPO / "tests" / current).exists(), row
            if not name:
                continue
            source = (REPO / "tests" / current).read_text()
            assert re.search(rf"def {name}\(", source), f"{current}::{name} named in the rule table does not exist"
            named += 1
    return named


def test_every_test_the_rule_table_names_exists() -> None:
    """docs/contributing/design.md names, for each protocol rule, the tests that catch its breakage."""
    table = _rule_table_rows((REPO / "docs" / "contributing" / "design.md").read_text(), 4)
    assert len(table) >= 15
    assert _check_named_tests(table, 4) >= 15


def test_every_test_the_readme_rule_table_names_exists() -> None:
    """README's short rule table (rule, module, tests) names tests that exist, at least one per rule."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Rules and the tests that catch them") :]
    section = section[: section.index("\n## ", 1)]
    table = _rule_table_rows(section, 3)
    assert len(table) >= 15
    for row in table:
        assert "`test_" in row.split("|")[3], f"a README rule row names no test: {row}"
    assert _check_named_tests(table, 3) >= 15
