"""Internal, temporary: the old import path of ``JobQueue`` and ``JobEvent``, now ``_app`` / ``_registry``.

The modules that other branches of the restructuring also edit (the worker,
the CLI, bootstrap, bench, demo, the package ``__init__``) still import from
here, so those branches merge without conflicts. Once they have landed, one
commit switches every ``from .queue import`` to ``from ._app import`` and
deletes this module. Users import from ``sqla_jobs``.
"""

from ._app import EVENTS, Handler, JobEvent, JobQueue

__all__ = ["EVENTS", "Handler", "JobEvent", "JobQueue"]
