"""A TCP proxy for the fault-injection tests: put it between a worker and PostgreSQL, then cut or stall.

``cut()`` resets every open connection (the client sees the server vanish)
and keeps accepting new ones; ``stall()`` keeps the sockets open but stops
forwarding bytes in both directions, as a network partition would, until
``resume()``. Threads and sockets only; it listens on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.accepted = 0
        threading.Thread(target=self._accept_loop, daemon=True, name="proxy-accept").start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._pairs.append((client, server))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._flowing.wait()  # stalled: hold the bytes, keep the sockets open
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _reset(dst)
            _reset(src)

    def cut(self) -> int:
        """Reset every open connection; returns how many were cut."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, server in pairs:
            _reset(client)
            _reset(server)
        return len(pairs)

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self.resume()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.cut()


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dead peer or a firewall reset would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
