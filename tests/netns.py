"""Worker "hosts" on one machine: Linux network namespaces joined to the host by veth pairs.

Each host is a network namespace ``sqjh<i>`` with one veth link to the
root namespace: ``10.231.<i>.2`` inside, ``10.231.<i>.1`` outside. The numbers
``i`` come from a slot held (``flock``) for as long as the hosts live, so test
runs side by side (``pytest -n 4``) never make the same names or subnets. Processes
started with ``Host.popen`` see only that link (and their own loopback), so
they reach PostgreSQL only through ``10.231.<i>.1:5432``, where a ``socat``
forwarder passes the connection on to the server on 127.0.0.1 (the server's
own configuration stays untouched). Cutting the link (``Host.cut``) is what a
failed switch port or a partitioned rack does: packets stop, nobody is told,
connections hang.

Needs root (or CAP_NET_ADMIN), ``ip`` from iproute2 and ``socat``; ``.ci/run``
installs socat. ``problem()`` says what is missing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import make_url

PG_PORT = 5432
#: Hosts per slot, and slots on a machine: host numbers run from 0 to 255 (the third octet).
SLOT_SIZE = 8
SLOTS = 32


def problem() -> str | None:
    """Why hosts cannot be made here, or None."""
    for tool in ("ip", "socat"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2 socat)"
    probe = f"sqjprobe{os.getpid() % 10000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace (needs root / CAP_NET_ADMIN): {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One worker host: a namespace, its link, and the processes started in it."""

    index: int
    ns: str
    outside: str  # the veth end in the root namespace
    gateway: str  # its address: where the host reaches the database
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def url(self, url: str) -> str:
        """``url`` (a PostgreSQL URL on 127.0.0.1) as this host reaches it: through its link."""
        return make_url(url).set(host=self.gateway, port=PG_PORT).render_as_string(hide_password=False)

    def popen(self, args: Sequence[str], env: dict[str, str], **options: Any) -> subprocess.Popen[str]:
        """Start ``args`` inside the namespace, in a process group of its own (so ``kill`` gets all of it)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns, *args], env=env, text=True,
                                start_new_session=True, **options)
        self.procs.append(proc)
        return proc

    def cut(self) -> None:
        """Take the link down: in-flight packets are lost and connections hang, as on a dead switch port."""
        _ip("link", "set", self.outside, "down")

    def mend(self) -> None:
        _ip("link", "set", self.outside, "up")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@contextmanager
def _forwarder(bind: str, target_port: int) -> Iterator[None]:
    """socat listening on ``bind``:5432, passing each connection on to 127.0.0.1:``target_port``."""
    proc = subprocess.Popen(
        ["socat", f"TCP-LISTEN:{PG_PORT},bind={bind},fork,reuseaddr,nodelay", f"TCP:127.0.0.1:{target_port},nodelay"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((bind, PG_PORT), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = proc.stderr.read() if proc.stderr else ""
                    raise RuntimeError(f"socat did not start on {bind}:{PG_PORT}: {said}")
                time.sleep(0.05)
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _remove(index: int) -> None:
    """Remove host ``index``'s link and namespace, if there (also what a killed earlier run left)."""
    subprocess.run(["ip", "link", "del", f"sqjo{index}"], capture_output=True)  # goes with its peer
    subprocess.run(["ip", "netns", "del", f"sqjh{index}"], capture_output=True)


@contextmanager
def _slot() -> Iterator[int]:
    """The first free slot, held until the block ends (a killed holder's lock goes with its process)."""
    for slot in range(SLOTS):
        handle = open(f"/tmp/sqla-jobs-netns-slot-{slot}.lock", "w")  # noqa: SIM115 - held across the yield
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        try:
            yield slot
        finally:
            handle.close()  # releases the lock
        return
    raise RuntimeError(f"all {SLOTS} network-namespace slots are taken: are {SLOTS} test runs making hosts?")


@contextmanager
def hosts(count: int, *, database_port: int = PG_PORT) -> Iterator[list[Host]]:
    """Make ``count`` hosts, each with a forwarder to the database; tear everything down afterwards.

    The names and addresses (``sqjh<i>``, ``10.231.<i>.0/30``) are those of a slot nobody else
    holds; leftovers of a killed run in that slot are removed first.
    """
    if count > SLOT_SIZE:
        raise ValueError(f"at most {SLOT_SIZE} hosts at a time, not {count}")
    made: list[Host] = []
    with _slot() as slot:
        try:
            with ExitStack() as forwarders:
                try:
                    for i in range(slot * SLOT_SIZE, slot * SLOT_SIZE + count):
                        _remove(i)
                        ns, outside, inside = f"sqjh{i}", f"sqjo{i}", f"sqji{i}"
                        gateway, address = f"10.231.{i}.1", f"10.231.{i}.2"
                        _ip("netns", "add", ns)
                        host = Host(i, ns, outside, gateway)
                        made.append(host)
                        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                        _ip("link", "set", inside, "netns", ns)
                        _ip("addr", "add", f"{gateway}/30", "dev", outside)
                        _ip("link", "set", outside, "up")
                        _ip("addr", "add", f"{address}/30", "dev", inside, ns=ns)
                        _ip("link", "set", inside, "up", ns=ns)
                        _ip("link", "set", "lo", "up", ns=ns)
                        forwarders.enter_context(_forwarder(gateway, database_port))
                    yield made
                finally:
                    for host in made:
                        host.kill()
        finally:
            for host in made:
                _remove(host.index)
