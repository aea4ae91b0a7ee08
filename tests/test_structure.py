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
    assert any(dialect_branches(p.read_text(encoding="utf-8")) for p in DRIVERS.rglob("*.py"))  # its subpackages too


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


#: Which folders of the package each folder may import (docs/development.md, "The layout"). The model and
#: the app (the modules at the top) sit on the drivers; the worker on both; the relay, the bench and the
#: command on the worker. An arrow the other way (the drivers asking the worker, the app loading the CLI)
#: is the start of an import circle.
LAYERS: dict[str, set[str]] = {
    "drivers": set(),
    "core": {"drivers"},
    "alembic": {"core", "drivers"},
    "web": {"core", "drivers"},
    "worker": {"core", "drivers"},
    "relay": {"worker", "core", "drivers"},
    "bench": {"worker", "core", "drivers"},
    "cli": {"alembic", "bench", "relay", "web", "worker", "core", "drivers"},
}
FOLDERS = {"drivers", "alembic", "web", "worker", "relay", "bench", "cli"}


def _folder(module: str) -> str:
    """The folder a module is in; ``core`` for the modules at the top; ``errors`` (every layer's) for the tree."""
    parts = module.split(".")
    if module == "sqla_jobs.errors":
        return "errors"
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else "core"


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path) -> set[str]:
    """The package's own modules ``path`` imports, lazy imports inside functions included, as absolute names."""
    module = _module_of(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from . import signals` imports a module; `from .x import name` a name of module x.
            found.update(f"{base}.{alias.name}" for alias in node.names if (PACKAGE.parent / f"{base}.{alias.name}"
                         .replace(".", "/")).with_suffix(".py").exists())
            found.add(base)
    return {name for name in found if name.startswith("sqla_jobs.")}


def test_the_layers_checker_reads_relative_and_lazy_imports() -> None:
    imported = _imported_modules(PACKAGE / "worker" / "control.py")
    assert {"sqla_jobs.worker.store", "sqla_jobs.drivers.base"} <= imported
    assert "sqla_jobs.drivers.postgresql.capped" in _imported_modules(PACKAGE / "drivers" / "postgresql" / "driver.py")
    assert _folder("sqla_jobs.drivers.postgresql.claim") == "drivers" and _folder("sqla_jobs._models") == "core"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_folder_imports_only_the_layers_below_it(path: Path) -> None:
    folder = _folder(_module_of(path))
    if folder == "errors" or (path.parent == PACKAGE and path.stem in ("__init__", "demo", "testing")):
        return  # the public surface re-exports the worker; the demo and the test helpers run one
    wrong = sorted(name for name in _imported_modules(path)
                   if (other := _folder(name)) not in (folder, "errors") and other not in LAYERS[folder])
    assert not wrong, (f"{path.relative_to(PACKAGE.parent)} ({folder}/) imports {wrong}: {folder}/ may import only "
                       f"{sorted(LAYERS[folder])} (docs/development.md, 'The layout')")


def test_every_driver_says_how_it_reads_a_json_field() -> None:
    # Per-key limits read a payload field in SQL (drivers/_limits.py payload_key); there is no portable
    # spelling, so no default either: a backend that forgot it would fail there, not guess.
    from sqla_jobs.drivers import registered
    from sqla_jobs.drivers._setup import Setup

    assert registered()
    for driver in registered():
        assert driver.json_field_text.__func__ is not Setup.json_field_text.__func__, driver.__name__  # type: ignore[attr-defined]
