"""Apps with a periodic job, for worker processes (``--app tests.periodic_app:queue``).

They share tests.app's tables and its ``record`` handler (one effect row per
start and finish), so tests can count the runs of each slot. ``without`` is
the same app after the schedule was removed from the code.
"""

from __future__ import annotations

from sqla_jobs import JobQueue
from tests import app

# check_kinds=False: tests.app's own check already refuses kinds it has no handler for.
queue: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False)
queue.handler("record")(app.record_run)
queue.periodic(every=2, kind="record", name="tick")

without: JobQueue[app.Job, app.DeadJob] = JobQueue(app.Job, app.DeadJob, check_kinds=False)
without.handler("record")(app.record_run)
