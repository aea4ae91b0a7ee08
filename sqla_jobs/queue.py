"""Internal, temporary: the old import path of ``JobQueue`` and ``JobEvent``, now in ``_app``/``_registry``.

Only ``worker.py`` and ``_lost.py`` still import from here, as they are
being split in a parallel branch; when that lands they import ``._app`` and
this module is deleted. Users import from ``sqla_jobs``.
"""

from ._app import EVENTS, Handler, JobEvent, JobQueue

__all__ = ["EVENTS", "Handler", "JobEvent", "JobQueue"]
