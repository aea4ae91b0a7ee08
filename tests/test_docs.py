"""The code in docs/ runs as printed, so the guides cannot drift from the code.

Conventions of the docs, which this test enforces:

* a ```python block whose first line is ``# name.py`` is a file: it is written to ``name.py``;
* every other ```python block of a page is part of one script, run top to bottom in a fresh folder;
* in ```sh blocks, lines starting with ``python `` or ``sqla-jobs `` are run in order, after the files
  are written; a ```text block right after such a block shows (part of) its output, and is checked;
* ```py and ```shell blocks show code and commands that need a server or your own app: not run.

The quickstart's files (``jobs.py``) are there for every page, as the how-tos say.
Pages opt in through ``RUNNABLE`` below.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(page: str) -> list[tuple[str, str]]:
    return FENCE.findall((DOCS / page).read_text())


def expected_output(text: str) -> list[re.Pattern[str]]:
    """Each shown line must appear in the output; '...' stands for anything (a log prefix, a time)."""
    patterns = []
    for line in text.strip().splitlines():
        regex = ".*".join(re.escape(part) for part in line.strip().split("..."))
        regex = re.sub(r"\\\([0-9\\.]+\\ ms\\\)", r"\\(\\d+\\.\\d ms\\)", regex)
        patterns.append(re.compile(regex))
    return patterns


def run(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(command)
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "sqla-jobs":
        argv[:1] = [sys.executable, "-m", "sqla_jobs.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SQLA_JOBS_")}
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), str(ROOT)])
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


#: The pages written to these conventions. A new page joins by being added here.
RUNNABLE = [
    "quickstart.md",
    "howto/enqueue.md",
    "howto/handlers.md",
    "howto/retries-and-dead-letters.md",
    "howto/dashboard.md",
    "reference/api.md",
    "reference/cli.md",
]


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_code_runs_as_printed(page: str, tmp_path: Path) -> None:
    script: list[str] = []
    commands: list[tuple[str, str | None]] = []  # (command, shown output of its block)
    items = blocks(page)
    for lang, body in blocks("quickstart.md"):
        if lang == "python" and re.fullmatch(r"# \w+\.py", body.splitlines()[0]):
            (tmp_path / body.splitlines()[0][2:]).write_text(body)
    for i, (lang, body) in enumerate(items):
        if lang == "python":
            first = body.splitlines()[0] if body.strip() else ""
            if re.fullmatch(r"# [\w/]+\.py", first):
                target = tmp_path / first[2:]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(body)
            else:
                script.append(body)
        elif lang == "sh":
            runnable = [ln.strip() for ln in body.splitlines() if ln.strip().startswith(("python ", "sqla-jobs "))]
            shown = items[i + 1][1] if i + 1 < len(items) and items[i + 1][0] == "text" else None
            for n, command in enumerate(runnable):
                commands.append((command, shown if n == len(runnable) - 1 else None))
    assert script or commands, f"{page} has python/sh blocks but nothing runnable in them"
    if script:
        (tmp_path / "page_script.py").write_text("\n".join(script))
        result = run("python page_script.py", tmp_path)
        assert result.returncode == 0, f"{page}: its python blocks failed:\n{result.stderr}"
    for command, shown in commands:
        result = run(command, tmp_path)
        assert result.returncode == 0, f"{page}: `{command}` failed:\n{result.stderr}"
        if shown is not None:
            for pattern in expected_output(shown):
                assert pattern.search(result.stdout + result.stderr), (
                    f"{page}: `{command}` did not print {pattern.pattern!r}:\n{result.stdout}{result.stderr}"
                )


def test_every_page_is_linked_from_the_index() -> None:
    index = (DOCS / "index.md").read_text()
    for page in PAGES:
        if page != "index.md":
            assert f"({page})" in index, f"docs/index.md does not link {page}"
