"""A new user's first day with ``sqla-jobs`` (issue 12): complete help, clean pipes, typos caught.

Each test here fails on the friction it names; the commands run in a subprocess, as a user runs them.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import insert

from sqla_jobs import __version__
from sqla_jobs.cli import build_parser, iter_commands
from tests import app, forkserver
from tests.conftest import ROOT, Database, run_cli
from tests.helpers import count, enqueue, run_burst
from tests.test_cli import APP, assert_clean_error, clean_env

CLI = f"{shlex.quote(sys.executable)} -m sqla_jobs.cli"
#: The command without rich installed: rich is optional, and the plain-text tables print line by line.
CLI_NO_RICH = (f"{shlex.quote(sys.executable)} -c "
               + shlex.quote("import sys; sys.modules['rich'] = None; from sqla_jobs.cli import main; "
                             "sys.exit(main())"))


# -- 4. --help is complete -----------------------------------------------------------------------------


def test_every_option_argument_and_command_has_help() -> None:
    """Walks the whole parser: an option, argument or (sub)command without help text fails the test."""
    parser = build_parser()
    missing: list[str] = []
    commands = [((), parser, "sqla-jobs"), *iter_commands(parser)]
    assert len(commands) > 15  # the walk found the nested commands (dead list, jobs show, migrations render…)
    for path, command, summary in commands:
        name = " ".join(("sqla-jobs", *path))
        if not summary:
            missing.append(f"{name}: no one-line help in the command list")
        if not command.description:
            missing.append(f"{name}: no description")
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            if not (action.help or "").strip():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.metavar or action.dest}")
    assert missing == []


def test_help_shows_defaults_and_descriptions() -> None:
    result = run_cli("worker", "--help", env=clean_env())
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "Claim and run jobs until stopped." in text
    for option, default in (("--lease", "60.0"), ("--poll-interval", "1.0"), ("--grace", "30.0")):
        assert re.search(rf"{option} \S+ .*?\(default: {re.escape(default)}\)", text), (option, text)
    show = run_cli("jobs", "show", "--help", env=clean_env())
    assert "ID the job's id" in " ".join(show.stdout.split())


def test_help_never_shows_the_url_from_the_environment() -> None:
    """``--url`` defaults to SQLA_JOBS_URL, which may hold a password: help must not print it."""
    env = clean_env(SQLA_JOBS_URL="postgresql+psycopg://me:s3cret@db/app")
    result = run_cli("jobs", "list", "--help", env=env)
    assert result.returncode == 0
    assert "s3cret" not in result.stdout


def test_version() -> None:
    result = run_cli("--version", env=clean_env())
    assert result.returncode == 0
    assert result.stdout.strip() == f"sqla-jobs {__version__}"


# -- 7. the command table in docs/reference/cli.md -------------------------------------------------------


def test_cli_reference_table_lists_every_command() -> None:
    """The first table of docs/reference/cli.md has one row per top-level command of the parser."""
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    table = page.split("| command", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\|\s*`([a-z-]+)[^`]*`", table, re.M)
    parser_commands = [path[0] for path, _p, _h in iter_commands(build_parser()) if len(path) == 1]
    assert sorted(rows) == sorted(parser_commands)


# -- 9. a bad worker setting names that setting only ----------------------------------------------------


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--lease", "-1", "argument --lease: must be > 0, got -1"),
    ("--poll-interval", "0", "argument --poll-interval: must be > 0, got 0"),
    ("--grace", "-5", "argument --grace: must be >= 0, got -5"),
    ("--heartbeat", "0", "argument --heartbeat: must be > 0, got 0"),
])
def test_a_bad_worker_setting_names_only_itself(option: str, value: str, says: str, tmp_path: Path) -> None:
    result = run_cli("worker", option, value, "--url", f"sqlite:///{tmp_path / 'x.db'}", *APP, env=clean_env())
    assert result.returncode == 2
    assert says in result.stderr
    for other in ("batch_size", "poll_interval", "lease and"):
        assert other not in result.stderr
    assert not (tmp_path / "x.db").exists()  # refused before touching the database


# -- 3. piping into head -------------------------------------------------------------------------------


def piped(command: str, reader: str, env: dict[str, str], cwd: Path) -> tuple[str, str, int]:
    """``command | reader`` in bash: what the reader printed, the command's stderr and exit status."""
    script = f"{command} 2>err.txt | {reader}; echo ${{PIPESTATUS[0]}} > status.txt"
    out = forkserver.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return out.stdout, (cwd / "err.txt").read_text(), int((cwd / "status.txt").read_text())


def test_piping_into_head_stops_quietly(db: Database, tmp_path: Path) -> None:
    """The reader goes away before the command is done writing: it exits quietly, without a traceback.

    ``head -2`` stops reading after two lines; whether the command then still has output to write
    depends on the pipe's buffer (64 KiB on Linux, more on some kernels), so the one-shot commands
    get a reader that is gone before they write (``true``), and ``stats --watch``, which writes on
    forever, gets the real ``head -2``.
    """
    with db.engine.begin() as conn:
        conn.execute(insert(app.Job.__table__), [{"kind": "noop", "payload": {"n": i}} for i in range(1000)])
    env = db.env()
    target = f"--app tests.app:queue --url {shlex.quote(db.url)}"
    for command, reader in ((f"{CLI} jobs list --limit 1000 {target}", "true"),
                            (f"{CLI_NO_RICH} jobs list --limit 1000 {target}", "true"),
                            (f"{CLI_NO_RICH} jobs list --limit 1000 --json {target}", "true"),
                            (f"{CLI_NO_RICH} stats --watch 0.01 {target}", "head -2"),
                            (f"{CLI} stats --json --watch 0.01 {target}", "head -2")):
        shown, err, status = piped(command, reader, env, tmp_path)
        if reader.startswith("head"):
            assert len(shown.splitlines()) == 2, (command, shown)
        assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, (command, err)
        assert status == 141, (command, status, err)  # 128 + SIGPIPE: the pipe closed under it, quietly


# -- 5. a misspelled kind --------------------------------------------------------------------------------


def test_a_misspelled_kind_is_an_error_listing_the_kinds(db: Database) -> None:
    enqueue(db.engine, "noop")
    enqueue(db.engine, "fail", {"message": "x"}, max_attempts=1)
    run_burst(db.engine)  # noop finishes, fail goes to the dead letters
    with db.engine.begin() as conn:  # a kind whose handler was removed from the app: its jobs remain
        conn.execute(insert(app.Job.__table__), [{"kind": "retired_kind", "payload": {}}])
    env = db.env()

    typo = run_cli("jobs", "list", "--kind", "noopp", *APP, env=env)
    err = assert_clean_error(typo, 2, "--kind 'noopp' matches nothing", "did you mean 'noop'?",
                             "table 'jobs'", "kinds in jobs: noop, retired_kind")
    assert re.search(r"the app's kinds: [a-z_, ]*\bflaky\b", err)

    for argv in (("dead", "retry", "--kind", "flakey"), ("dead", "list", "--kind", "flakey"),
                 ("dead", "purge", "--older-than", "0s", "--kind", "flakey")):
        result = run_cli(*argv, *APP, env=env)
        assert_clean_error(result, 2, "--kind 'flakey' matches nothing", "did you mean 'flaky'?",
                           "table 'dead_jobs'", "kinds in dead_jobs: fail")
    assert count(db.engine, app.DeadJob) == 1  # nothing purged nor requeued

    # Kinds that can match still work: one in the table only, one of the app with no rows.
    retired = run_cli("jobs", "list", "--kind", "retired_kind", *APP, env=env)
    assert retired.returncode == 0 and "retired_kind" in retired.stdout, retired.stderr
    none_yet = run_cli("dead", "retry", "--kind", "flaky", *APP, env=env)
    assert none_yet.returncode == 0 and "requeued 0 job(s)" in none_yet.stdout, none_yet.stderr


# -- 1. migrations path 3 as documented; 9. one line of output --------------------------------------------


def test_render_reads_app_and_url_from_alembic_ini(tmp_path: Path) -> None:
    """The issue's repro: `migrations init`, set sqla_jobs.app, `migrations render`, no --app, no --url."""
    env = clean_env()

    def sqla_jobs(*args: str) -> subprocess.CompletedProcess[str]:
        return forkserver.run([sys.executable, "-m", "sqla_jobs.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    init = sqla_jobs("migrations", "init", "m")
    assert init.returncode == 0, init.stderr
    assert len(init.stdout.strip().splitlines()) == 1 and "set sqla_jobs.app" in init.stdout  # not alembic's too
    ini = tmp_path / "alembic.ini"
    ini.write_text(re.sub(r"(?m)^sqla_jobs\.app =.*$", "sqla_jobs.app = tests.app:queue", ini.read_text()))
    assert "sqlalchemy.url = sqlite:///app.db" in ini.read_text()

    render = sqla_jobs("migrations", "render")
    assert render.returncode == 0, render.stderr
    lines = render.stdout.strip().splitlines()
    assert lines[0].startswith("wrote ") and "Generating" not in render.stdout  # its own line, not alembic's
    assert "  create table jobs" in lines
    assert not (tmp_path / "app.db").exists()  # the database of sqlalchemy.url does not exist yet: no empty file

    upgrade = forkserver.run([sys.executable, "-m", "alembic", "upgrade", "head"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert upgrade.returncode == 0, upgrade.stderr
    # Now render compares with sqlalchemy.url's database, read from alembic.ini: nothing is missing.
    again = sqla_jobs("migrations", "render")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "the job tables are up to date: no revision written"
    assert len(list((tmp_path / "m" / "versions").glob("*.py"))) == 1

    (tmp_path / "alembic.ini").write_text(ini.read_text().replace("sqla_jobs.app = tests.app:queue",
                                                                  "sqla_jobs.app ="))
    no_app = sqla_jobs("migrations", "render")
    assert_clean_error(no_app, 2, "no app given", "--app", "SQLA_JOBS_APP", "sqla_jobs.app in alembic.ini")


# -- 9. no empty SQLite files left behind ------------------------------------------------------------------


def test_a_failed_sqlite_start_leaves_no_empty_file(tmp_path: Path) -> None:
    typo = tmp_path / "jbos.db"
    for argv in (("worker", "--burst"), ("jobs", "list"), ("stats",), ("dead", "retry", "--all")):
        result = run_cli(*argv, "--url", f"sqlite:///{typo}", *APP, env=clean_env())
        assert_clean_error(result, 2, f"no database at {typo}", "create-tables")
        assert not typo.exists(), argv
    health = run_cli("health", "--max-oldest-age", "1m", "--url", f"sqlite:///{typo}", *APP, env=clean_env())
    assert health.returncode == 1 and health.stdout.startswith(f"UNHEALTHY: no database at {typo}")
    assert not typo.exists()
    created = run_cli("create-tables", "--url", f"sqlite:///{typo}", *APP, env=clean_env())
    assert created.returncode == 0 and typo.stat().st_size > 0, created.stderr


def test_bench_on_sqlite_leaves_no_file(tmp_path: Path) -> None:
    result = forkserver.run(
        [sys.executable, "-m", "sqla_jobs.cli", "bench", "--url", "sqlite:///b.db", "--jobs", "20", "--runs", "1",
         "--processes", "1", "--concurrency", "2", "--latency-samples", "5", "--json"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert '"drain (jobs/s)"' in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither b.db nor the scratch file


# -- 9. the log's duration and stats' run time: what each measures ---------------------------------------


def test_log_duration_is_the_handler_and_stats_counts_from_claim_to_finish(db: Database) -> None:
    """The log line's "(N ms)" is the handler's own time; stats' run time (claim to finish) contains it.

    Both are labelled for what they are, so "(0.0 ms)" next to a ~10 ms stats mean is no contradiction.
    """
    for seconds in (0.0, 0.3):
        enqueue(db.engine, "sleep", {"seconds": seconds})
    worker = run_cli("worker", "--burst", *APP, env=db.env())
    assert worker.returncode == 0, worker.stderr
    logged = [float(ms) for ms in
              re.findall(r"job \d+ sleep attempt 1/5 \((\d+\.\d) ms\): finished", worker.stderr)]
    # The handler's own time: the 0.3 s sleep logs at least 300 ms, and clearly more than the no-op
    # (no bound on the no-op itself: a loaded machine may take a while to schedule any thread).
    assert len(logged) == 2 and max(logged) >= 300 and min(logged) < max(logged) - 150, logged
    stats = run_cli("stats", "--json", *APP, env=db.env())
    (sleep,) = [r for r in json.loads(stats.stdout)["run_times"] if r["kind"] == "sleep"]
    assert sleep["max"] * 1000 >= max(logged)  # claim to finish holds the handler's time
    table = run_cli("stats", *APP, env=db.env())
    assert "Run time by kind (claim to finish, last 1h)" in table.stdout


def test_an_empty_queue_filter_names_the_queues_that_exist(db: Database) -> None:
    enqueue(db.engine, "noop", queue="emails")
    result = run_cli("jobs", "list", "--queue", "emials", *APP, env=db.env())
    assert result.returncode == 0, result.stderr  # queue names are free-form: an empty queue is no error
    assert result.stdout.strip() == "no jobs match (no job is in queue 'emials'; queues in the table: emails)"
