"""The private servers this suite stops and restarts leave the machine's own servers alone.

A MariaDB server deletes, as it starts, every ``#sql*`` file in its tmpdir: its own temporary tables left from
a last run. In a tmpdir shared with the machine's MariaDB (``/tmp``, the default) those were the other server's
live temporary tables, and a test running beside the restart failed with "Error on delete of
'/tmp/#sql-temptable-...'" (CI, stop 53). The private server has a tmpdir of its own.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from . import mariadb_server
from .conftest import _private


def test_a_private_mariadb_leaves_the_shared_temporary_folder_alone() -> None:
    # Named as the machine's server names its temporary tables, in the folder it keeps them in.
    probe = Path(tempfile.gettempdir()) / f"#sql-sqla-jobs-probe-{os.getpid()}.MAI"
    probe.touch()
    try:
        servers = _private(mariadb_server.unavailable, mariadb_server.PrivateMariaDB, "MariaDB server")
        server = next(servers)
        try:
            assert server.process is not None and server.process.poll() is None
            assert probe.exists(), "starting a private MariaDB deleted a temporary table of the machine's server"
        finally:
            next(servers, None)  # the rest of the fixture: the server destroyed
    finally:
        probe.unlink(missing_ok=True)
