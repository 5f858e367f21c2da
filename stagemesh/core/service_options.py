"""Options every long-running service shares: logs, traces, metrics, TLS and the internal token.

Each service's options nest :class:`ServiceOptions` (stagemesh.core.flags); its
``run`` calls :func:`setup_service` once, before it opens any port. TLS and the
internal token (stagemesh.core.internal_token) are kept per process (one service per
process), so every place that opens a gRPC channel or server goes through
:func:`channel`, :func:`aio_channel`, :func:`aio_server` and :func:`add_port` and
honours the flags without threading them through.

TLS: ``--tls-cert``/``--tls-key`` make the service's own ports TLS; with
``--tls-ca`` as well the service checks its peers against that CA both ways
(mutual TLS: a service presents its own certificate when it calls another).
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import traceback
from dataclasses import dataclass
from pathlib import Path

import grpc

from stagemesh.core import internal_token, shutdown
from stagemesh.core.errors import StagemeshError
from stagemesh.core.flags import Flag

log = logging.getLogger("stagemesh")

LOG_LEVELS = ("debug", "info", "warning", "error")
# A peer that restarts (same address) must be reachable again within seconds: gRPC's default
# reconnect backoff grows to 120 s, during which every call on the channel fails at once.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                     ("grpc.max_reconnect_backoff_ms", 2000)]


TITLE = "logs, traces, metrics and TLS"


@dataclass(frozen=True)
class ServiceOptions:
    """Every service's logs, traces, metrics, TLS, internal token and drain (the router has no --metrics-port:
    its metrics are on its HTTP port)."""
    log_level: str = Flag(("--log-level",), default="info", choices=LOG_LEVELS, title=TITLE).field()
    log_format: str = Flag(("--log-format",), default="text", choices=("text", "json"), title=TITLE,
                           help="json: one JSON object per line").field()
    otlp_traces_endpoint: str | None = Flag(("--otlp-traces-endpoint",), metavar="URL", title=TITLE, help=(
        "send OpenTelemetry traces here (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; neither set: tracing off)"
    )).field()
    metrics_port: int | None = Flag(("--metrics-port",), type=int, title=TITLE,
                                    help="serve Prometheus metrics on this port at /metrics (default: off)").field()
    tls_cert: str | None = Flag(("--tls-cert",), metavar="PEM", title=TITLE,
                                help="this service's certificate (gRPC over TLS)").field()
    tls_key: str | None = Flag(("--tls-key",), metavar="PEM", title=TITLE, help="the private key of --tls-cert").field()
    tls_ca: str | None = Flag(("--tls-ca",), metavar="PEM", title=TITLE, help=(
        "CA that signs the other services' certificates: verify peers with it (mutual TLS when --tls-cert is given "
        "too)")).field()
    # (the token travels to a child in its environment: a command line is visible to `ps`)
    internal_token_file: str | None = Flag(("--internal-token-file",), metavar="FILE", title=TITLE, passed_on=False,
                                           help=f"the shared secret internal RPCs carry and check (default: "
                                                f"${internal_token.ENV}; neither: internal RPCs are not "
                                                "authenticated)").field()
    internal_token: str | None = Flag(("--internal-token",), metavar="TOKEN", title=TITLE, passed_on=False, help=(
        "the same secret on the command line (visible to `ps`; prefer --internal-token-file)")).field()
    shutdown_timeout: float = Flag(("--shutdown-timeout",), type=float, default=shutdown.DEFAULT_TIMEOUT_S,
                                   metavar="SECONDS", title=TITLE, help=shutdown.HELP).field()


def setup_service(args: argparse.Namespace, service_name: str) -> None:
    """Logging, TLS, tracing and the metrics endpoint of one service process."""
    from stagemesh.core.logs import setup_logging
    from stagemesh.core.telemetry import setup_tracing

    setup_logging(args.log_level, args.log_format)
    configure_tls(args.tls_cert, args.tls_key, args.tls_ca)
    internal_token.configure(args)
    setup_tracing(service_name, args.otlp_traces_endpoint)
    port = getattr(args, "metrics_port", None)
    if port is not None:
        from prometheus_client import start_http_server

        try:
            start_http_server(port, addr=getattr(args, "host", "127.0.0.1"))
        except OSError as err:
            raise StagemeshError(f"--metrics-port {port}: {err.strerror or err}") from None
        logging.getLogger("stagemesh").info("Prometheus metrics on port %d at /metrics", port)


@dataclass(frozen=True)
class TLSConfig:
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None


_tls = TLSConfig()


def configure_tls(cert: str | None, key: str | None, ca: str | None) -> TLSConfig:
    global _tls
    if (cert is None) != (key is None):
        raise StagemeshError("--tls-cert and --tls-key go together: give both or neither")

    def read(flag: str, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise StagemeshError(f"{flag} {path}: {err.strerror}") from None
        if b"-----BEGIN" not in data:
            raise StagemeshError(f"{flag} {path}: not a PEM file")
        return data

    _tls = TLSConfig(read("--tls-cert", cert), read("--tls-key", key), read("--tls-ca", ca))
    return _tls


def channel_credentials(tls: TLSConfig | None = None) -> grpc.ChannelCredentials | None:
    tls = tls or _tls
    if not tls.enabled:
        return None
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def channel(target: str, options: list | None = None) -> grpc.Channel:
    """A blocking channel to another service of the mesh: TLS and the internal token when configured."""
    creds, options = channel_credentials(), RECONNECT_OPTIONS + (options or [])
    chan = grpc.insecure_channel(target, options) if creds is None else grpc.secure_channel(target, creds, options)
    if internal_token.token() is not None:
        chan = grpc.intercept_channel(chan, internal_token.SyncClientInterceptor())
    return chan


def aio_channel(target: str, options: list | None = None) -> grpc.aio.Channel:
    """An asyncio channel to another service of the mesh: TLS and the internal token when configured."""
    creds, options = channel_credentials(), RECONNECT_OPTIONS + (options or [])
    interceptors = internal_token.aio_client_interceptors() if internal_token.token() is not None else None
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)


def aio_server(options: list | None = None, errors: grpc.aio.ServerInterceptor | None = None) -> grpc.aio.Server:
    """An asyncio server of an internal service: every call but health and reflection must carry the
    internal token when one is configured; errors: the service's exceptions to status codes
    (stagemesh.core.grpc_errors.ErrorInterceptor), around its handlers."""
    interceptors = [internal_token.ServerInterceptor(), *([errors] if errors is not None else [])]
    quiet_grpc_teardown(asyncio.get_running_loop())
    return grpc.aio.server(interceptors=interceptors, options=options)


def quiet_grpc_teardown(loop: asyncio.AbstractEventLoop) -> None:
    """grpc.aio's poller may still run a callback on its closed file descriptor while a service stops
    (grpc/grpc#34139: OSError EBADF from PollerCompletionQueue._handle_events). Nothing is wrong, but asyncio
    logs it as an ERROR with a traceback in the middle of a clean shutdown; it is logged at DEBUG instead.
    Every other exception is reported as before."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        err = context.get("exception")
        if isinstance(err, OSError) and err.errno == errno.EBADF and any(
                f.filename.endswith("completion_queue.pyx.pxi") for f in traceback.extract_tb(err.__traceback__)):
            log.debug("grpc.aio's poller after its descriptor closed (grpc/grpc#34139): %s", err)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    if not getattr(previous, "quiets_grpc_teardown", False):
        handler.quiets_grpc_teardown = True  # type: ignore[attr-defined]
        loop.set_exception_handler(handler)


def add_port(server, address: str) -> int:
    """Bind ``address`` on a grpc or grpc.aio server, with TLS when configured."""
    if _tls.cert is not None:
        creds = grpc.ssl_server_credentials([(_tls.key, _tls.cert)], root_certificates=_tls.ca,
                                            require_client_auth=_tls.ca is not None)
        return server.add_secure_port(address, creds)
    return server.add_insecure_port(address)
