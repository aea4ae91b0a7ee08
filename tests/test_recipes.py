"""The how-tos followed literally, one after another, as a new user does (issue 30, findings 3, 4, 11, 16).

Each test runs a page's code the way tests/test_docs.py does (its files written, its other python
blocks as one script, in a fresh folder with the quickstart's files), then checks what the page
leaves behind for the next step a reader takes.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from sqlalchemy import func, inspect, select, table

from tests.conftest import ROOT, make_database
from tests.test_docs import blocks, run


def write_page(page: str, folder: Path, *, quickstart: bool = True) -> str:
    """Write ``page``'s files (and the quickstart's) into ``folder``; return its script (the other blocks)."""
    script: list[str] = []
    pages = (["quickstart.md"] if quickstart else []) + [page]
    for name in pages:
        for lang, body in blocks(name):
            if lang != "python":
                continue
            first = body.splitlines()[0] if body.strip() else ""
            if re.fullmatch(r"# [\w/]+\.py", first):
                target = folder / first[2:]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(body)
            elif name == page:
                script.append(body)
    return "\n".join(script)


def run_page(page: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run ``page``'s script in ``folder`` (after its files are written), as the doc test does."""
    (folder / "page_script.py").write_text(write_page(page, folder))
    result = run("python page_script.py", folder)
    assert result.returncode == 0, f"{page}: {result.stderr}"
    return result


def sh_commands(page: str) -> list[str]:
    return [ln.strip() for lang, body in blocks(page) if lang == "sh"
            for ln in body.splitlines() if ln.strip().startswith(("python ", "sqla-jobs "))]


def test_the_fastapi_recipe_does_not_warn_about_itself(tmp_path: Path) -> None:
    result = run_page("howto/fastapi.md", tmp_path)
    assert "receipt sent" in result.stdout
    assert "pool holds at most" not in result.stderr, result.stderr


def test_the_pool_warning_names_the_async_factory_for_an_async_engine(tmp_path: Path) -> None:
    (tmp_path / "undersized.py").write_text(
        "import asyncio\n"
        "from sqlalchemy.ext.asyncio import create_async_engine\n"
        "from jobs import Base, queue\n"
        "from sqla_jobs import AsyncWorker\n"
        "engine = create_async_engine('sqlite+aiosqlite:///shop.db')\n"
        "async def main():\n"
        "    async with engine.begin() as conn:\n"
        "        await conn.run_sync(Base.metadata.create_all)\n"
        "    await AsyncWorker(engine, queue, concurrency=40).run(burst=True)\n"
        "asyncio.run(main())\n"
    )
    write_page("quickstart.md", tmp_path, quickstart=False)
    result = run("python undersized.py", tmp_path)
    assert result.returncode == 0, result.stderr
    assert "create_async_engine(url, pool_size=42)" in result.stderr, result.stderr
    assert "create_engine(url" not in result.stderr


def test_readme_quickstart_is_importable_as_the_app_its_comment_names(tmp_path: Path) -> None:
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    (tmp_path / "quickstart.py").write_text(code)
    first = run("python quickstart.py", tmp_path)
    assert first.returncode == 0, first.stderr
    comment = re.search(r"# In production: (sqla-jobs worker .*)", code)
    assert comment, "README's quickstart lost its worker comment"
    assert "--app quickstart:queue" in comment.group(1), "the comment must name the snippet's own module"
    worker = run(comment.group(1) + " --burst", tmp_path)
    assert worker.returncode == 0, worker.stderr
    listed = run("sqla-jobs jobs list --json --url sqlite:///quickstart.db --app quickstart:queue", tmp_path)
    assert listed.returncode == 0, listed.stderr
    # Importing the app neither enqueued another order nor ran a worker of its own.
    assert [row["state"] for row in json.loads(listed.stdout)] == ["finished"]


def test_the_flask_recipes_worker_finds_the_apps_sqlite_database(tmp_path: Path) -> None:
    write_page("howto/frameworks.md", tmp_path)
    (tmp_path / "order.py").write_text(
        "import sys\nfrom flask_app import app\n"
        "client = app.test_client()\n"
        "if sys.argv[1] == 'place':\n"
        "    assert client.post('/orders', json={'email': 'ada@example.com'}).status_code == 201\n"
        "else:\n"
        "    print(client.get('/orders/1').get_json())\n"
    )
    placed = run("python order.py place", tmp_path)
    assert placed.returncode == 0, placed.stderr
    source = (tmp_path / "flask_app.py").read_text()
    comment = re.search(r"#\s+(sqla-jobs worker --url \S+ --app flask_app:queue)", source)
    assert comment, "flask_app.py no longer says how to start its worker"
    worker = run(comment.group(1) + " --burst", tmp_path)  # the command the recipe gives, literally
    assert worker.returncode == 0, worker.stderr
    assert "confirm_order attempt 1/5" in worker.stderr
    shown = run("python order.py show", tmp_path)
    assert "'confirmed': True" in shown.stdout, shown.stdout + shown.stderr
    for command in sh_commands("howto/frameworks.md"):  # the page's own commands, as printed
        if "flask_app" in command or "instance/shop.db" in command:
            result = run(command, tmp_path)
            assert result.returncode == 0, (command, result.stderr)


@pytest.mark.parametrize(("page", "database", "app"), [
    ("howto/unique-jobs.md", "unique.db", "jobs:queue"),
    ("howto/periodic-jobs.md", "periodic.db", "reports:queue"),
])
def test_a_page_leaves_only_jobs_the_quickstarts_worker_can_run(
    page: str, database: str, app: str, tmp_path: Path
) -> None:
    run_page(page, tmp_path)
    for command in sh_commands(page):
        assert run(command, tmp_path).returncode == 0, command
    # The reader's next step: a worker on what the page left behind.
    worker = run(f"sqla-jobs worker --burst --url sqlite:///{database} --app {app}", tmp_path)
    assert worker.returncode == 0, worker.stderr
    assert "KeyError" not in worker.stderr and "failed" not in worker.stderr, worker.stderr
    listed = run(f"sqla-jobs jobs list --json --limit 1000 --url sqlite:///{database} --app {app}", tmp_path)
    states = {row["state"] for row in json.loads(listed.stdout)}
    assert states <= {"finished"}, states


def test_the_testing_recipe_on_postgresql_leaks_no_job_between_tests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_page("howto/testing.md", tmp_path)
    for database in make_database("postgresql", tmp_path):
        monkeypatch.setenv("TEST_DATABASE_URL", database.url)  # what the page tells the reader to set
        for _ in range(2):  # twice: the second run starts from what the first left behind
            result = run("python -m pytest -q -p no:cacheprovider test_shop.py", tmp_path)
            assert result.returncode == 0, result.stdout + result.stderr
            assert "5 passed" in result.stdout, result.stdout
        # The tests ran on PostgreSQL (the recipe created its tables there), and left them empty.
        tables = set(inspect(database.engine).get_table_names(schema=database.schema))
        assert {"orders", "jobs", "dead_jobs"} <= tables, tables
        with database.engine.connect() as conn:
            for name in ("orders", "jobs", "dead_jobs"):
                assert conn.scalar(select(func.count()).select_from(table(name, schema=database.schema))) == 0
