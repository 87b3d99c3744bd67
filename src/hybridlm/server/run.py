"""Running the app: `serve` in the foreground (the CLI), `running` in a thread (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

from hybridlm.server.app import create_app, ready
from hybridlm.server.guard import Policy, guarded_protocol
from hybridlm.server.service import Service


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one, chosen by the system)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


HEADER_TIMEOUT_S = 10.0  # a request's headers arrive within this (slow clients hold no connection longer)


def max_connections() -> int:
    """Open connections served at once: half the descriptors this process may hold (at most 1024), so that
    the rest (model files, tool servers, traces) never runs out and no accept loop spins at the limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(16, min(1024, (soft if soft > 0 else 1024) // 2))


def _server(service: Service | None, *, api_key, max_body_bytes, log_level: str,
            policy: Policy) -> tuple[uvicorn.Server, FastAPI]:
    app = create_app(service, api_key=api_key, max_body_bytes=max_body_bytes, policy=policy)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, access_log=log_level == "debug",
                            http=guarded_protocol(HEADER_TIMEOUT_S, max_connections()), timeout_keep_alive=5,
                            h11_max_incomplete_event_size=64 * 1024)
    return uvicorn.Server(config), app


def serve(service: Service | Callable[[], Service], *, host: str = "127.0.0.1", port: int = 8000,
          sock: socket.socket | None = None,
          api_key: str | None = None, max_body_bytes: int = 8 * 2**20, log_level: str = "info",
          allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = (), on_ready=None) -> None:
    """Serve until SIGINT or SIGTERM (on `sock`, or a socket bound to host:port).

    The engine steps in this (the main) thread, the HTTP server runs in another (see
    `Service.loop` for why); either one ending stops the other. `service` may be a function
    that loads the model and returns the service: the HTTP server answers from the start
    (/health: 503 "loading"), and serves once it returns.
    """
    sock = sock if sock is not None else bind(host, port)
    policy = Policy(sock.getsockname()[0], allowed_hosts, allowed_origins)
    given = service if isinstance(service, Service) else None
    server, app = _server(given, api_key=api_key, max_body_bytes=max_body_bytes, log_level=log_level, policy=policy)

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            if app.state.service is not None:
                app.state.service.stop()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    thread = threading.Thread(target=http, name="hybridlm-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    loaded = given
    try:
        if loaded is None and server.started and not isinstance(service, Service):
            loaded = service()
            ready(app, loaded)
        if server.started and on_ready is not None:
            on_ready(sock.getsockname()[1])
        if server.started and loaded is not None:
            loaded.loop()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a clean stop
        pass
    finally:
        server.should_exit = True
        if loaded is not None:
            loaded.stop()
        thread.join(timeout=10)
        if loaded is not None:
            loaded.close()
        sock.close()
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def running(service: Service, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
            max_body_bytes: int = 8 * 2**20, log_level: str = "warning", allowed_hosts: tuple[str, ...] = (),
            allowed_origins: tuple[str, ...] = ()) -> Iterator[str]:
    """The server in a background thread for the `with` block; yields its base URL (…/v1)."""
    sock = bind(host, port)
    server, _ = _server(service, api_key=api_key, max_body_bytes=max_body_bytes, log_level=log_level,
                        policy=Policy(host, allowed_hosts, allowed_origins))
    service.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="hybridlm-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError("the server did not start")
    try:
        yield f"http://{host}:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        service.close()
        sock.close()
