"""The package's shape: only the driver package knows which database it talks to.

Reads the source with ``ast`` (no imports, no regex over comments or
docstrings) and fails on any module outside ``sqla_jobs/drivers/`` that

* compares something with a database name (``x == "postgresql"``,
  ``name in ("sqlite", ...)``, ``match`` cases included), or
* reads a dialect's name (``.dialect.name``: ask ``drivers.driver_class_of``),
  or the old ``SQL.postgres``/``.sqlite`` flags.

Differences between databases belong in a driver method or capability
property (see ``sqla_jobs/drivers/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sqla_jobs"
DRIVERS = PACKAGE / "drivers"
NAMES = {"postgresql", "postgres", "sqlite", "mysql", "mariadb", "oracle", "mssql"}


def _names_a_database(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("+")[0].lower() in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_database(e) for e in node.elts)
    return False


def dialect_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place ``source`` decides on a database name."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_names_a_database(n) for n in (node.left, *node.comparators)):
            found.append((node.lineno, "compares with a database name"))
        elif isinstance(node, ast.match_case) and _names_a_database(getattr(node.pattern, "value", None) or node):
            found.append((node.pattern.lineno, "matches a database name"))
        elif isinstance(node, ast.Attribute):
            if node.attr == "name" and isinstance(node.value, ast.Attribute) and node.value.attr == "dialect":
                found.append((node.lineno, "reads .dialect.name"))
            elif node.attr in ("postgres", "sqlite"):
                found.append((node.lineno, f"reads .{node.attr}"))
    return found


def _outside_drivers() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if DRIVERS not in p.parents)


def test_the_checker_catches_each_form() -> None:
    source = (
        'if engine.dialect.name == "postgresql": pass\n'
        'if url.get_backend_name() in ("sqlite", "x"): pass\n'
        "if sql.postgres: pass\n"
        'ok = "mysql+pymysql" != kind\n'
        'match name:\n    case "sqlite":\n        pass\n'
        'x = Integer().with_variant(BigInteger(), "postgresql")  # a type for a dialect is no branch\n'
    )
    assert sorted(line for line, _ in dialect_branches(source)) == [1, 1, 2, 3, 4, 6]


@pytest.mark.parametrize("path", _outside_drivers(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_outside_the_drivers_branches_on_a_dialect(path: Path) -> None:
    branches = dialect_branches(path.read_text(encoding="utf-8"))
    assert not branches, f"{path.relative_to(PACKAGE.parent)}: " + "; ".join(
        f"line {line} {what}" for line, what in branches
    ) + ": move the difference into a driver method or capability (sqla_jobs/drivers/)"


def test_the_driver_package_is_where_the_differences_are() -> None:
    # The checker is not vacuous: the drivers themselves do branch on names (URL aliases, say).
    assert any(dialect_branches(p.read_text(encoding="utf-8")) for p in DRIVERS.glob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports written with their leading dots."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
    return found


def test_the_registry_half_of_the_app_touches_no_database() -> None:
    # Handlers, hooks, retry policy and the enqueue check are plain Python; the database is
    # the operations half's (sqla_jobs/_admin.py), through a driver.
    imports = _imports(PACKAGE / "_registry.py")
    assert not {name for name in imports if name.startswith(("sqlalchemy", ".drivers", "._admin", "._app"))}
    assert {".drivers", "._models"} <= _imports(PACKAGE / "_admin.py")
