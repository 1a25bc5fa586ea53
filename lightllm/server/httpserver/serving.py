"""uvicorn for a public server: connection timeouts, a connection limit and a bounded shutdown.

uvicorn brings the keep-alive timeout, ``limit_concurrency``, the listen backlog and a graceful
shutdown bound. It has no deadline for a request's headers, so ``HeaderDeadlineProtocol`` adds
one; the deadline for the body lives in the app (``api_http.BodyReadGuard``), which can answer 408.

Shutdown (SIGTERM / SIGINT), in order:
1. uvicorn stops accepting connections and closes the idle ones; ``HttpServerManager.begin_shutdown``
   makes requests still sending their body answer 503 at once;
2. in-flight requests get ``--timeout_graceful_shutdown`` s to finish, then fail with 503 (a
   second signal fails them at once; a third makes uvicorn quit without waiting);
3. the app's lifespan ends: the worker processes are told to exit, and the caller waits for them.
uvicorn's own bound (the backstop that cancels request tasks) is ``SHUTDOWN_FAIL_GRACE_S`` later.
"""
import asyncio
import logging
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn[standard]'s C parser; h11 (pure Python) serves without it
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:
    HttpToolsProtocol = None

from lightllm.common.constants import HTTP_IMPLEMENTATIONS
from lightllm.utils.gc_freeze import freeze_start_up_objects
from lightllm.utils.signals import signal_handlers

logger = logging.getLogger(__name__)

# After --timeout_graceful_shutdown the failed requests get this long to send their 503 before
# uvicorn cancels what is left
SHUTDOWN_FAIL_GRACE_S = 2.0
SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The signal count (first = 1) at which shutdown stops waiting for requests / for anything
HURRY_SIGNAL_COUNT = 2
FORCE_SIGNAL_COUNT = 3
# How long the HTTP process's event loop may keep the GIL once another thread waits for it (Python's
# default: 5 ms). The worker-reader thread then hands each step's updates to a busy loop within about
# this long; at the default they waited 5.1 ms p50 on an H100 host (docs/decode_step.md)
HTTP_SWITCH_INTERVAL_S = 0.0005
# Bytes a connection may send without completing a request's headers (h11's default
# max_incomplete_event_size, which uvicorn keeps); past it the request gets a 400
MAX_INCOMPLETE_EVENT_BYTES = 16 * 1024


@dataclass(frozen=True)
class ConnectionLimits:
    """The HTTP server's connection settings (StartArgs' ``timeout_*``, ``limit_concurrency``, ``backlog``)."""

    timeout_keep_alive: float
    timeout_request_header: float
    timeout_graceful_shutdown: float
    limit_concurrency: int
    backlog: int
    http: str = "auto"  # the HTTP/1.1 parser (HTTP_IMPLEMENTATIONS)
    loop: str = "auto"  # the event loop (LOOP_IMPLEMENTATIONS)

    @classmethod
    def of(cls, args) -> "ConnectionLimits":
        return cls(args.timeout_keep_alive, args.timeout_request_header, args.timeout_graceful_shutdown,
                   args.limit_concurrency, args.backlog, args.http, args.loop)


class HeaderDeadline:
    """A deadline for a request's headers, mixed into one of uvicorn's HTTP protocols: a connection
    that has not sent a request's full headers ``header_timeout_s`` after it opened, or after its
    previous response, is closed (idle connections that never send anything; slowloris). uvicorn's
    keep-alive timeout still closes an idle kept-alive connection first."""

    header_timeout_s: float = 30.0  # set per server by header_deadline_protocol()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class HeaderDeadlineProtocol(HeaderDeadline, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the header deadline."""

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a new request's headers arrived
            self._cancel_header_deadline()

    def on_response_complete(self) -> None:
        # armed first: the call below may start a pipelined request, which cancels it
        if not self.transport.is_closing():
            self._arm_header_deadline()
        super().on_response_complete()


# without httptools this class has no parser base and header_deadline_protocol() never picks it
class HttpToolsHeaderDeadlineProtocol(HeaderDeadline, HttpToolsProtocol or object):
    """uvicorn's httptools protocol (a C parser, as ``uvicorn[standard]`` serves) with the header
    deadline.
    httptools buffers headers without bound, so as h11 it answers 400 once more than
    MAX_INCOMPLETE_EVENT_BYTES arrived without completing the headers (or a piece of the body)."""

    _incomplete_bytes = 0  # received since the parser last completed the headers or a body piece

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        self._incomplete_bytes += len(data)
        super().data_received(data)
        if self._incomplete_bytes > MAX_INCOMPLETE_EVENT_BYTES and not self.transport.is_closing():
            self.send_400_response("Request headers too large.")

    def on_headers_complete(self) -> None:
        self._incomplete_bytes = 0
        self._cancel_header_deadline()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._incomplete_bytes = 0
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._incomplete_bytes = 0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # a pipelined request (its headers already in) starts in the call below: no deadline then
        waiting = bool(self.pipeline)
        super().on_response_complete()
        if not waiting and not self.transport.is_closing():
            self._arm_header_deadline()


def header_deadline_protocol(header_timeout_s: float, http: str = "auto") -> type:
    """The HTTP protocol class with this header deadline (uvicorn builds one per connection):
    httptools' when ``http`` is "httptools", or "auto" and httptools is installed; else h11's."""
    if http not in HTTP_IMPLEMENTATIONS:
        raise ValueError(f"http: {http!r} is not one of {', '.join(HTTP_IMPLEMENTATIONS)}")
    if http == "httptools" and HttpToolsProtocol is None:
        raise ValueError("http: httptools is not installed (pip install httptools)")
    use_httptools = http == "httptools" or (http == "auto" and HttpToolsProtocol is not None)
    base = HttpToolsHeaderDeadlineProtocol if use_httptools else HeaderDeadlineProtocol
    return type(base.__name__, (base,), {"header_timeout_s": header_timeout_s})


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that tells the app when shutdown begins and lets the process exit normally.

    ``on_shutdown()`` runs when shutdown begins, ``on_hurry()`` at the second signal (both on the
    event loop). uvicorn re-raises the signal once it has shut down, which kills the process before
    its atexit handlers run: multiprocessing's, which unlink the worker queues' semaphores (the
    "leaked semaphore" warning at every shutdown), and the caller's own clean-up. Here ``run()``
    returns instead; ``signals`` lists what was received."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None], on_hurry: Callable[[], None],
                 shutdown_signals: Sequence[int] = SHUTDOWN_SIGNALS, on_signal: Optional[Callable[[int], None]] = None,
                 on_started: Optional[Callable[[], None]] = None):
        super().__init__(config)
        self.on_started = on_started  # called once the server accepts connections
        self.on_shutdown = on_shutdown
        self.on_hurry = on_hurry
        self.shutdown_signals = tuple(shutdown_signals)
        self.on_signal = on_signal  # called with each shutdown signal received (passed on to other processes)
        self.signals: List[int] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    async def shutdown(self, sockets=None) -> None:
        self.on_shutdown()
        if len(self.signals) >= HURRY_SIGNAL_COUNT:
            self.on_hurry()
        await super().shutdown(sockets=sockets)

    def capture_signals(self):
        return signal_handlers(self.shutdown_signals, self.handle_exit)

    def handle_exit(self, sig: int, frame) -> None:
        self.signals.append(sig)
        if self.on_signal is not None:
            self.on_signal(sig)
        self.should_exit = True
        if len(self.signals) == HURRY_SIGNAL_COUNT and self._loop is not None:
            self._loop.call_soon_threadsafe(self.on_hurry)
        elif len(self.signals) >= FORCE_SIGNAL_COUNT:
            self.force_exit = True


def uvicorn_config(app, host: str, port: int, limits: ConnectionLimits) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=header_deadline_protocol(limits.timeout_request_header, limits.http),
        loop=limits.loop,
        timeout_keep_alive=limits.timeout_keep_alive,
        # uvicorn refuses when the open connections, the new one among them, reach its limit: one more
        # serves --limit_concurrency connections, as the flag says
        limit_concurrency=limits.limit_concurrency + 1,
        backlog=limits.backlog,
        timeout_graceful_shutdown=limits.timeout_graceful_shutdown + SHUTDOWN_FAIL_GRACE_S,
    )


def make_server(app, manager, args, port: Optional[int] = None, **signals) -> GracefulServer:
    """The server of ``app`` over ``manager`` with ``args``' connection limits (on ``port``, else --port);
    ``signals``: GracefulServer's ``shutdown_signals``, ``on_signal`` and ``on_started``."""
    limits = ConnectionLimits.of(args)
    config = uvicorn_config(app, args.host, args.port if port is None else port, limits)
    freeze_start_up_objects()
    return GracefulServer(config, on_shutdown=lambda: manager.begin_shutdown(limits.timeout_graceful_shutdown),
                          on_hurry=manager.hurry_shutdown, **signals)


def bind_socket(host: str, port: int, backlog: int, reuse_port: bool = False, first: bool = True) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (OSError when the port is taken or the address
    is not this host's). Start-up binds it before the model worker starts, so such a failure is
    reported at once, and "serving on" is only printed for a port that is ours. ``reuse_port``:
    SO_REUSEPORT, so that each HTTP process of --httpserver_workers listens on a socket of its own and
    the kernel spreads new connections evenly over them (from one shared socket, whichever process
    wakes first accepts all that wait); the ``first`` of them checks that the port is free (another
    server's SO_REUSEPORT sockets would otherwise take this one in)."""
    if reuse_port and first:
        bind_socket(host, port, backlog).close()
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def tune_http_process() -> None:
    """Process-wide settings of the HTTP server's process (call once, before serving)."""
    sys.setswitchinterval(HTTP_SWITCH_INTERVAL_S)


def serve_http(app, manager, args, sock: Optional[socket.socket] = None, **signals) -> GracefulServer:
    """Serve ``app`` (over ``manager``) until a shutdown signal, on ``sock`` (bind_socket's) or
    else a socket uvicorn binds; returns once it is shut down. ``signals``: as make_server's."""
    tune_http_process()
    server = make_server(app, manager, args, **signals)
    server.run(sockets=None if sock is None else [sock])
    return server
