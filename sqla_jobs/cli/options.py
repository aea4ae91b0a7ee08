"""The parser's parts every command shares: its help layout, the argument types, the common options."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Formatter", "Parser", "common_options", "iter_commands", "job_id_argument", "json_flag", "not_negative",
           "positive"]


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help, unless the help already names it. Never
    ``--url``'s: it comes from ``SQLA_JOBS_URL`` and may hold a password."""

    hidden = frozenset({"url", "app", "help", "version"})

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (action.default in (None, False, argparse.SUPPRESS) or action.dest in self.hidden
                or "default" in text or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every (sub)command parser: the same help layout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)


def iter_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """Every subcommand below ``parser``, depth first: (its words, its parser, its one-line help)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*path, name), sub, helps.get(name, "")
                yield from iter_commands(sub, (*path, name))


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(raw: str) -> Any:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {raw}")
        return value

    return parse


def not_negative(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {raw}")
    return value


def common_options(p: argparse.ArgumentParser, app: bool = True) -> None:
    p.add_argument("--url", default=os.environ.get("SQLA_JOBS_URL"),
                   help="database URL (env SQLA_JOBS_URL), e.g. postgresql+psycopg://user@host/db; "
                        "add ?prepare_threshold=none behind PgBouncer in transaction mode")
    if app:
        p.add_argument("--app", default=os.environ.get("SQLA_JOBS_APP"),
                       help="your JobQueue as module:attr (env SQLA_JOBS_APP)")


def json_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON instead of a table")


def job_id_argument(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("id", type=int, metavar="ID", help=what)
