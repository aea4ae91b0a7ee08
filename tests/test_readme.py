"""README's quickstart runs exactly as printed, so it cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_python() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "README.md lost its quickstart"
    return blocks[0]


def test_quickstart_runs_as_printed(tmp_path: Path) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(readme_python())
    # A fresh interpreter in an empty folder: the code must stand on its own.
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "quickstart.db").exists()


def test_quickstart_against_postgres(tmp_path: Path) -> None:
    from tests.conftest import make_database

    for database in make_database("postgresql", tmp_path):
        code = readme_python().replace('"sqlite:///quickstart.db"', repr(database.url))
        script = tmp_path / "quickstart_pg.py"
        script.write_text(code)
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr


def test_readme_has_exactly_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"```sh\n(.*?)```", text, re.S)
    assert [c.strip() for c in commands] == [
        'pip install . && sqla-jobs demo',
        'pip install -e ".[test]" && pytest -n 4 -m "not serial" && pytest -m serial',
    ]
