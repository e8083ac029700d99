"""A TCP proxy in front of a local server that can go down for a moment: ``outage(seconds)``
closes its listening socket and every open connection (requests in flight fail, new ones are
refused), then listens again on the same port. The object-store retry tests put it between
batchjob and the moto S3 server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class FlakyProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self.outages = 0
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self, port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        return s

    def _serve(self) -> None:
        while True:
            listener = self._listener
            try:
                client, _ = listener.accept()
            except OSError:  # closed by an outage: wait for the next listener
                while self._listener is listener:
                    time.sleep(0.01)
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def outage(self, seconds: float) -> None:
        """Down for ``seconds`` (blocking), then up again on the same port."""
        old = self._listener
        with self._lock:
            conns, self._open = self._open, []
        with contextlib.suppress(OSError):
            old.shutdown(socket.SHUT_RDWR)  # wakes the accept() waiting on it
        old.close()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        time.sleep(seconds)
        self.outages += 1
        self._listener = self._listen(self.port)

    def close(self) -> None:
        self._listener.close()
