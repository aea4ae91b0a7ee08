"""Tables for the terminal: drawn with rich when it is installed (``pip install "sqla-jobs[cli]"``),
as aligned plain text otherwise, so the CLI works either way."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["print_table", "rich_available"]


def rich_available() -> bool:
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    if rich_available():
        from rich.console import Console
        from rich.table import Table

        class _Console(Console):
            def on_broken_pipe(self) -> None:
                # rich would exit 1 on its own; the CLI's main handles a closed pipe once, for every command.
                raise BrokenPipeError

        table = Table(title=title, title_justify="left")
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*row)
        _Console(soft_wrap=False).print(table)
        return
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows, strict=True)]
    print(title)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    print()
