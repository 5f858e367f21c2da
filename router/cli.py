"""`stagemesh router`: the OpenAI HTTP gateway over one or more replicas."""
from __future__ import annotations

import argparse
import asyncio
import logging

from stagemesh.core.heap import freeze_startup_heap
from stagemesh.core.service_options import add_service_arguments, setup_service

log = logging.getLogger("stagemesh.router")
SHARED_PORT_WAIT_S = 300.0  # a --reuse-port router's wait for a healthy replica before it listens


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model directory, for the tokenizer and chat template "
                                                          "(default: the embedded model)")
    p.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                   help="the same as the positional MODEL (vLLM's spelling)")
    from stagemesh.core.model_source import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--replica", action="append", required=True, metavar="HOST:PORT",
                   help="a replica's scheduler (repeat for data parallelism)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=None, help="serve the gRPC frontend on this port (0: any free "
                                                               "port; default: off)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: the replicas')")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                                                   "(and the gRPC frontend's metadata 'authorization')")
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--http-timeout-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="close a connection that sends no complete request (headers included) for this long, "
                        "as vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default 5)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap below the replicas' own limit")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                   help="tool_choice \"auto\": the model calls tools in its own format, which --tool-call-parser "
                        "reads. Default: on when the model's chat template shows a format a parser reads (the "
                        "start-up log names the parser it chose), else off (\"auto\" gets a 400); "
                        "--no-enable-auto-tool-choice keeps it off")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>) or llama3_json "
                        "(default: chosen from the chat template)")
    p.add_argument("--policy", choices=("least-load", "cache-aware", "kv-aware", "round-robin"), default="least-load",
                   help="least-load: fewest running + 4 x waiting; cache-aware: where this router sent the prompt's "
                        "prefix before (a guess); kv-aware: where the replicas' KV events say the prompt's leading "
                        "blocks are held, in any KV tier, each block weighed by the best tier holding it (device 1.0, "
                        "host 0.8, disk 0.5), unless that replica is much busier; a replica whose events the router "
                        "cannot trust now (a gap, its stream lost: resynced from a snapshot) counts no hit "
                        "(docs/disaggregated-prefill.md); round-robin")
    p.add_argument("--responses-store", default="memory", metavar="memory|URL",
                   help="where the Responses API keeps its responses (store: true) for GET and DELETE /v1/responses/"
                        "{id} and previous_response_id: memory (default: this router's own), or a Redis URL that "
                        "several routers share (redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS, unix://PATH; "
                        "keys stagemesh:responses:<id>; each call times out after 1 s unless the URL sets "
                        "?socket_timeout=S&socket_connect_timeout=S). While Redis is down, what needs it answers "
                        "503, and a response that could not be kept says \"store\": false")
    p.add_argument("--responses-store-size", type=int, default=None,
                   help="memory store: keep this many responses, the oldest dropped first (default 1000); not with "
                        "a Redis store, which --responses-store-ttl and the server's maxmemory bound")
    p.add_argument("--responses-store-ttl", type=float, default=None, metavar="SECONDS",
                   help="Redis store: each response expires this many seconds after it was made (default 3600; a "
                        "conversation goes on as long as its last response is younger); not with memory")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own 'chat_template' (chat completions, /tokenize) instead of refusing it "
                        "with a 400, as vLLM's flag: each renders in a worker process, killed past "
                        "--chat-template-timeout or past the longest prompt the model can take")
    p.add_argument("--chat-template-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="with --trust-request-chat-template: the time a request's chat template may take to render "
                        "before its worker is killed and the request gets a 400 (default 5)")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help="as vLLM's: {\"backend\": \"xgrammar\", \"disable_any_whitespace\": BOOL}. JSON constraints "
                        "(response_format, guided_json, forced tool calls) generate compact JSON unless "
                        "disable_any_whitespace is false (then a run of at most 16 whitespace characters may come "
                        "between tokens); a request's structured_outputs.disable_any_whitespace overrides it. "
                        "Default here: true (vLLM's default, false, lets a small model run away on whitespace)")
    p.add_argument("--grammar-compile-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="a request's structured-output constraint that takes longer to compile (in a worker "
                        "process) gets a 400 naming the bound (default 5, as vLLM's regex bound)")
    p.add_argument("--max-waiting-requests", type=int, default=0,
                   help="answer 429 (with Retry-After) once this many requests wait for their first token "
                        "(0: unbounded; the schedulers' own queue limits also give 429)")
    p.add_argument("--max-request-retries", type=int, default=3,
                   help="a request whose replica fails goes on on another one (before its first token: sent again; "
                        "after: continued from the tokens already streamed), at most this many times")
    from stagemesh.core.lora import add_lora_arguments

    add_lora_arguments(p, limits=False)
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between replica checks")
    p.add_argument("--reuse-port", action="store_true",
                   help="listen with SO_REUSEPORT, so that several routers share the HTTP (and gRPC) port and the "
                        "kernel spreads connections over them (`stagemesh serve --api-server-count N` sets it)")
    p.add_argument("--control-port", type=int, default=None,
                   help="serve stagemesh.v1.RouterControl on this loopback port (0: any free port): the mesh's "
                        "supervisor changes the replicas while the router serves, and probes this router's own "
                        "readiness there (grpc.health.v1); needs the internal token (`stagemesh serve` sets it)")
    add_service_arguments(p, metrics_port=False)


def run(args: argparse.Namespace) -> int:
    setup_service(args, "stagemesh-router")
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from aiohttp import web

    from router.app import build_app
    from router.balancing import POLICIES
    from router.http_server import GatewayRunner
    from router.replica_set import ReplicaSet
    from router.tokenization import Tokenizer
    from stagemesh.core.errors import StagemeshError
    from stagemesh.core.model_source import resolve_source
    from stagemesh.core.model_config import ModelConfig
    from router.state import LIFECYCLE
    from stagemesh.core.shutdown import Shutdown

    shutdown = Shutdown(args.shutdown_timeout, log, "router")
    shutdown.install_async()  # a signal during start-up: the router stops as soon as it is up
    if args.model and args.model_option and args.model != args.model_option:
        raise StagemeshError(f"two models given: '{args.model}' and --model '{args.model_option}'")
    model = args.model_option or args.model
    if args.max_request_retries < 0:
        raise StagemeshError("--max-request-retries must be >= 0")
    _check_store(args)
    if args.max_waiting_requests < 0 or args.health_interval <= 0 or args.http_timeout_keep_alive <= 0:
        raise StagemeshError("--max-waiting-requests must be >= 0, --health-interval and --http-timeout-keep-alive > 0")
    source = resolve_source(model, args.tokenizer, args.quantization)  # a GGUF's tokenizer: its --tokenizer
    model_dir = source.model_dir
    model_config = ModelConfig.from_path(model_dir)
    replicas = ReplicaSet(args.replica, POLICIES[args.policy](), args.health_interval, args.max_waiting_requests,
                          args.max_request_retries)
    await replicas.refresh()
    name = args.served_model_name or next((r.served_model_name for r in replicas.replicas if r.served_model_name),
                                          None) or source.name
    from router.config import RouterConfig, json_any_whitespace
    from router.lora_registry import LoRARegistry

    config = RouterConfig(name, args.api_key, args.max_model_len, args.public_metrics, None,
                          responses_store=args.responses_store, responses_store_size=args.responses_store_size,
                          responses_store_ttl=args.responses_store_ttl,
                          trust_request_chat_template=args.trust_request_chat_template,
                          chat_template_timeout=args.chat_template_timeout,
                          json_any_whitespace=json_any_whitespace(args.structured_outputs_config),
                          grammar_compile_timeout=args.grammar_compile_timeout,
                          lora=LoRARegistry(_lora_modules(args, name), args.enable_lora,
                                            tuple(args.allowed_local_lora_path), replica_set=replicas))
    tokenizer = Tokenizer(model_dir, model_config.max_position_embeddings, config.template_timeout_s,
                          config.grammar_compile_timeout, config.json_any_whitespace)
    config = _auto_tool_choice(args, config, tokenizer)
    from router.observe import configure

    configure(name, args.max_model_len or replicas.max_model_len or model_config.max_position_embeddings)
    from stagemesh.core import telemetry

    if telemetry.enabled():  # a span per HTTP request, its context carried on to the scheduler
        from opentelemetry import trace
        from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

        AioHttpServerInstrumentor().instrument(tracer_provider=trace.get_tracer_provider())
    app = build_app(replicas, tokenizer, config)
    await _report_store(app)
    control = await _control(args, replicas, app[LIFECYCLE])
    if config.lora.enabled:  # a replica that lacks an adapter loaded at run time (it restarted) gets it
        from router import lora_api

        replicas.after_refresh.append(lambda: lora_api.sync_soon(config.lora))
    checker = asyncio.create_task(replicas.health_loop())
    if args.reuse_port:
        await _wait_for_a_replica(replicas, shutdown)
    grpc_server = None
    if args.grpc_port is not None:
        from router.frontend import FrontendServicer, serve_frontend

        grpc_server, grpc_port = await serve_frontend(FrontendServicer(replicas, tokenizer, config, app[LIFECYCLE]),
                                                      args.host, args.grpc_port)
        log.info("gRPC frontend (stagemesh.v1.Frontend) on %s:%d", args.host, grpc_port)
    # a client that disconnects cancels its handler, which aborts the request in the scheduler
    runner = GatewayRunner(app, access_log=None, handler_cancellation=True,
                           keepalive_timeout=args.http_timeout_keep_alive, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_port=args.reuse_port or None)
    await site.start()
    app[LIFECYCLE].listening = True
    port = runner.addresses[0][1]
    log.info("router serving %s on http://%s:%d over %d replica(s) (%s); OpenAI API at /v1", name, args.host, port,
             len(replicas.replicas), args.policy)
    freeze_startup_heap("router")
    await shutdown.wait()
    await _drain(shutdown, app[LIFECYCLE], site, replicas)
    checker.cancel()
    if grpc_server is not None:
        await grpc_server.stop(grace=0)
    if control is not None:
        control[1].cancel()
        await control[0].stop(grace=0)
    await runner.cleanup()
    await replicas.close()
    return 0


async def _wait_for_a_replica(replicas, shutdown) -> None:
    """A router that shares its ports (--reuse-port) joins them only once a replica can serve: the kernel spreads
    new connections over every router listening there, ready or not (at most SHARED_PORT_WAIT_S, then it joins
    anyway and answers 503 until a replica serves)."""
    loop = asyncio.get_running_loop()
    start = last = loop.time()
    while not replicas.healthy() and not shutdown.requested.is_set():
        now = loop.time()
        if now - start > SHARED_PORT_WAIT_S:
            log.warning("no replica is healthy after %.0fs: joining the shared port anyway", SHARED_PORT_WAIT_S)
            return
        if now - last >= 5 or now == start:
            last = now
            log.info("waiting for a healthy replica before joining the shared port (at most %.0fs left)",
                     SHARED_PORT_WAIT_S - (now - start))
        await asyncio.sleep(0.1)


async def _drain(shutdown, lifecycle, site, replicas) -> None:
    """Take no new work (readiness false; the listening socket closed, so that new connections reach the other
    routers), let the requests in flight finish, at most --shutdown-timeout; those still running then are left
    to their replicas, which keep the resumable ones for their clients to resume on another router."""
    lifecycle.draining = True
    await site.stop()
    if not await shutdown.drain(lambda: lifecycle.active == 0, lambda: f"{lifecycle.active} request(s)"):
        replicas.detach()


async def _control(args: argparse.Namespace, replicas, lifecycle):
    """The control port's server (router.control) and its health task (held while it runs), or None without
    --control-port."""
    if args.control_port is None:
        return None
    from router.control import CONTROL_HOST, serve_control

    server, port, follower = await serve_control(replicas, args.control_port,
                                                 lambda: lifecycle.listening and bool(replicas.healthy())
                                                 and not lifecycle.draining)
    log.info("control port (stagemesh.v1.RouterControl) on %s:%d", CONTROL_HOST, port)
    return server, follower


def _auto_tool_choice(args: argparse.Namespace, config, tokenizer):
    """The config with tool_choice "auto"'s parser: the flags', else the one the chat template shows
    (router.tool_parser_choice), logged either way."""
    import dataclasses

    from router.tool_parser_choice import choose

    choice = choose(args.enable_auto_tool_choice, args.tool_call_parser, tokenizer.tok.chat_template)
    log.info("%s", choice.message)
    return dataclasses.replace(config, tool_call_parser=choice.parser)


def _check_store(args: argparse.Namespace) -> None:
    from router.responses_api.store import check_store_options
    from stagemesh.core.errors import StagemeshError

    try:
        check_store_options(args.responses_store, args.responses_store_size, args.responses_store_ttl)
    except ValueError as err:
        raise StagemeshError(str(err)) from None


async def _report_store(app) -> None:
    """Which store the Responses API uses; one that does not answer yet does not stop the router."""
    from router.responses_api.handlers import STORE

    store = app[STORE]
    problem = await store.unreachable()
    if problem is None:
        log.info("Responses API store: %s", store.describe())
    else:
        log.warning("Responses API store: %s is not reachable yet (%s); the requests that need it answer 503 until "
                    "it is, each trying again", store.name, problem)


def _lora_modules(args, served: str):
    """--enable-lora --lora-modules: the adapters a request's model may name (the replicas serve them; each
    scheduler refuses a name it does not). A name that is the served model's is refused."""
    from stagemesh.core.lora import LoRAError, lora_from_args

    lora = lora_from_args(args)
    modules = lora[1] if lora is not None else ()
    if any(m.name == served for m in modules):
        raise LoRAError(f"--lora-modules: the adapter name {served!r} is the served model's name")
    return modules
