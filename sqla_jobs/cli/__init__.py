"""The ``sqla-jobs`` command: ``main`` parses the arguments and runs one command.

``cli/main.py`` holds the parser and the worker, bench and demo commands; each group of commands has a
module of its own (``admin``: jobs, dead letters, stats, prune, health; ``migrations``; ``relay``;
``dashboard``); ``options`` holds the parser's shared parts (help layout, argument types, common
options); ``terminal`` draws their tables.
"""

from .main import build_parser, main
from .options import iter_commands

__all__ = ["build_parser", "iter_commands", "main"]
