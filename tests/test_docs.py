"""The code in docs/ runs as printed, so the guides cannot drift from the code.

Every page under docs/ is collected. Conventions of the docs, which this test enforces:

* a ```python block whose first line is ``# name.py`` is a file: it is written to ``name.py``;
* every other ```python block of a page is part of one script, run top to bottom in a fresh folder;
* in ```sh blocks, lines starting with ``python `` or ``sqla-jobs `` are run in order, after the files
  are written (``pip install`` lines and ``#`` comments are the only others allowed: the test's
  environment has the extras installed); a ```text block right after such a block shows (part of)
  its output, and is checked;
* ```text blocks show output, synopses or diagrams: not code;
* any other block (code that needs a server, your own app, a package the tests do not install, or a
  config file for another tool) is preceded by ``<!-- not run: REASON -->`` on the line before its
  fence (an HTML comment: the site does not show it). An unmarked block that this test cannot run fails it.

The quickstart's files (``jobs.py``) are there for every page, as the how-tos say.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import ROOT

DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```\s*$", re.S | re.M)
NOT_RUN = re.compile(r"<!-- not run: (\S.*?) -->")
SETUP = ("pip install ", "#")  # sh lines a page may show without the test running them


def all_blocks(page: str) -> list[tuple[str, str, str | None]]:
    """(language, body, the reason it is not run or None) of every fenced block of ``page``."""
    return parse_blocks((DOCS / page).read_text())


def parse_blocks(text: str) -> list[tuple[str, str, str | None]]:
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().splitlines()
        marker = NOT_RUN.fullmatch(before[-1].strip()) if before else None
        found.append((match.group(1), match.group(2), marker.group(1) if marker else None))
    return found


def blocks(page: str) -> list[tuple[str, str]]:
    """The blocks the test runs or checks: all but those marked not run."""
    return [(lang, body) for lang, body, reason in all_blocks(page) if reason is None]


def runs(lang: str, body: str) -> bool:
    if lang == "python":
        return True
    lines = [ln.strip() for ln in body.splitlines() if ln.strip()]
    return lang == "sh" and any(ln.startswith(("python ", "sqla-jobs ")) for ln in lines) and all(
        ln.startswith(("python ", "sqla-jobs ", *SETUP)) for ln in lines
    )


def unrunnable(page: str, text: str | None = None) -> list[str]:
    """The blocks of ``page`` that are neither run, nor output, nor marked not run with a reason."""
    problems = []
    for n, (lang, body, reason) in enumerate(parse_blocks(text) if text else all_blocks(page), 1):
        first = body.strip().splitlines()[0] if body.strip() else ""
        setup_only = lang == "sh" and all(ln.strip().startswith(SETUP) for ln in body.splitlines() if ln.strip())
        if reason is not None or lang == "text" or runs(lang, body) or setup_only:
            continue
        what = f"```{lang}" if lang else "``` (no language: give it one, ```text for a synopsis)"
        problems.append(f"docs/{page} block {n} {what} `{first[:60]}`")
    return problems


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
    return forkserver.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


#: Every page with code the test runs; the others have only output, marked blocks or no code.
RUNNABLE = [page for page in PAGES if any(runs(lang, body) for lang, body in blocks(page))]


def test_every_code_block_runs_or_says_why_not() -> None:
    problems = [problem for page in PAGES for problem in unrunnable(page)]
    assert not problems, (
        "these doc blocks are not run by tests/test_docs.py: make them runnable, or put "
        "`<!-- not run: REASON -->` on the line before the fence:\n" + "\n".join(problems)
    )


def test_the_marker_is_seen() -> None:
    # The checker is not vacuous: a marked block is skipped, an unmarked one of the same kind is reported.
    text = "<!-- not run: needs a server -->\n```sql\nselect 1;\n```\n\n```sql\nselect 2;\n```\n```\nx\n```\n"
    assert [reason for _, _, reason in parse_blocks(text)] == ["needs a server", None, None]
    problems = unrunnable("probe.md", text)
    assert len(problems) == 2 and "select 2" in problems[0] and "no language" in problems[1]


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
            if not runs(lang, body):
                continue
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
