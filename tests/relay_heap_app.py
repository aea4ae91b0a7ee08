"""``--app tests.relay_heap_app:queue``: the relay tests' app, telling whether the relay froze its start-up heap.

At the first garbage collection after the process froze more of its heap than it had when this module was imported
(``gc.get_freeze_count()``: ``sqla-jobs relay`` calls ``freeze_startup_heap`` once the relay is built; the tests'
fork server froze its own start-up before), it writes to the file that ``SQLA_JOBS_TEST_HEAP_REPORT``
names whether the collector still scans the app's queue object. A relay that never froze writes nothing.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any

from tests.relay_app import queue

__all__ = ["queue"]


_FROZEN_AT_IMPORT = gc.get_freeze_count()


_reported: list[bool] = []  # once: the callback stays in gc.callbacks (removing it while the collector walks
# that list could skip another callback)


def _report(phase: str, info: dict[str, Any]) -> None:
    if phase != "stop" or _reported or gc.get_freeze_count() <= _FROZEN_AT_IMPORT:
        return
    _reported.append(True)
    with open(os.environ["SQLA_JOBS_TEST_HEAP_REPORT"], "w") as report:
        json.dump({"queue_scanned": any(obj is queue for obj in gc.get_objects())}, report)


gc.callbacks.append(_report)
