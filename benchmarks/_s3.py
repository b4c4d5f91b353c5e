"""moto's S3 server, in this process, counting the bytes it serves: the bucket's side of "how much did the job read".

Used by benchmarks/restore.py and by the tests' ``s3_server`` fixture (tests/conftest.py). The counts are the bytes of
the bodies GET requests were answered with, per ``bucket/key`` (path-style requests, as s3fs makes them to an
endpoint URL): what the server sent to readers, whatever the client library or the library's own counters say.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["CountingApp", "counting_server_class", "start_counting_server"]


class CountingApp:
    """moto's WSGI application, wrapped to count the bytes of the GET answers per object (:meth:`bytes_served`)."""

    def __init__(self) -> None:
        from moto.moto_server.threaded_moto_server import DomainDispatcherApplication, create_backend_app

        self.app = DomainDispatcherApplication(create_backend_app)
        self.served: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        body = self.app(environ, start_response)
        if environ.get("REQUEST_METHOD") != "GET":
            return body
        key = environ.get("PATH_INFO", "").lstrip("/")

        def counted() -> Iterator[bytes]:
            try:
                for piece in body:
                    with self._lock:
                        self.served[key] += len(piece)
                    yield piece
            finally:
                if hasattr(body, "close"):
                    body.close()

        return counted()

    def bytes_served(self, prefix: str = "", suffix: str = "") -> int:
        """Bytes served of the objects whose ``bucket/key`` starts with ``prefix`` and ends with ``suffix``."""
        with self._lock:
            return sum(n for k, n in self.served.items() if k.startswith(prefix) and k.endswith(suffix))


def counting_server_class(app: CountingApp) -> type:
    """moto's ``ThreadedMotoServer`` serving ``app`` (its constructor's arguments: ip_address, port, verbose)."""
    from moto.moto_server.threaded_moto_server import MotoRequestHandler, ThreadedMotoServer
    from werkzeug.serving import make_server

    class CountingMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:  # (moto's own, with the wrapped app)
            self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    return CountingMotoServer


def start_counting_server() -> tuple[Any, CountingApp, str]:
    """A started server on 127.0.0.1 (a free port), its counter and its endpoint URL; ``server.stop()`` ends it. Its
    request log is off (werkzeug's logger at WARNING)."""
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = CountingApp()
    server = counting_server_class(app)(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server, app, f"http://127.0.0.1:{server.get_host_and_port()[1]}"
