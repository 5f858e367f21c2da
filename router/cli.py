"""`stagemesh router`: the OpenAI HTTP gateway over one or more replicas."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from stagemesh.core.heap import freeze_startup_heap
from stagemesh.core.service_options import add_service_arguments, setup_service

log = logging.getLogger("stagemesh.router")


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
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\": the model calls tools in its own format (needs --tool-call-parser)")
    p.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>) or llama3_json")
    p.add_argument("--policy", choices=("least-load", "cache-aware", "kv-aware", "round-robin"), default="least-load",
                   help="least-load: fewest running + 4 x waiting; cache-aware: where this router sent the prompt's "
                        "prefix before (a guess); kv-aware: where the replicas' KV events say the prompt's leading "
                        "blocks are cached, unless that replica is much busier; round-robin")
    p.add_argument("--responses-store-size", type=int, default=1000,
                   help="the Responses API keeps this many responses (store: true) in memory for GET /v1/responses/"
                        "{id} and previous_response_id, the oldest dropped first")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's own 'chat_template' (chat completions, /tokenize) instead of refusing it "
                        "with a 400, as vLLM's flag: each renders in a worker process, killed past "
                        "--chat-template-timeout or past the longest prompt the model can take")
    p.add_argument("--chat-template-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="with --trust-request-chat-template: the time a request's chat template may take to render "
                        "before its worker is killed and the request gets a 400 (default 5)")
    p.add_argument("--max-waiting-requests", type=int, default=0,
                   help="answer 429 (with Retry-After) once this many requests wait for their first token "
                        "(0: unbounded; the schedulers' own queue limits also give 429)")
    p.add_argument("--max-request-retries", type=int, default=3,
                   help="a request whose replica fails goes on on another one (before its first token: sent again; "
                        "after: continued from the tokens already streamed), at most this many times")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between replica checks")
    add_service_arguments(p, metrics_port=False)


def run(args: argparse.Namespace) -> int:
    setup_service(args, "stagemesh-router")
    return asyncio.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from aiohttp import web

    from router.app import build_app
    from router.balancing import POLICIES
    from router.replicas import ReplicaSet
    from router.tokenization import Tokenizer
    from stagemesh.core.errors import StagemeshError
    from stagemesh.core.model_source import resolve_source
    from stagemesh.core.model_config import ModelConfig

    if args.model and args.model_option and args.model != args.model_option:
        raise StagemeshError(f"two models given: '{args.model}' and --model '{args.model_option}'")
    model = args.model_option or args.model
    if args.max_request_retries < 0:
        raise StagemeshError("--max-request-retries must be >= 0")
    if args.responses_store_size < 1:
        raise StagemeshError("--responses-store-size must be >= 1")
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
    from router.config import RouterConfig

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise StagemeshError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    config = RouterConfig(name, args.api_key, args.max_model_len, args.public_metrics,
                          args.tool_call_parser if args.enable_auto_tool_choice else None, args.responses_store_size,
                          args.trust_request_chat_template, args.chat_template_timeout)
    tokenizer = Tokenizer(model_dir, model_config.max_position_embeddings, config.template_timeout_s)
    from router.observe import configure

    configure(name, args.max_model_len or replicas.max_model_len or model_config.max_position_embeddings, args.replica)
    from stagemesh.core import telemetry

    if telemetry.enabled():  # a span per HTTP request, its context carried on to the scheduler
        from opentelemetry import trace
        from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

        AioHttpServerInstrumentor().instrument(tracer_provider=trace.get_tracer_provider())
    app = build_app(replicas, tokenizer, config)
    grpc_server = None
    if args.grpc_port is not None:
        from router.frontend import FrontendServicer, serve_frontend

        grpc_server, grpc_port = await serve_frontend(FrontendServicer(replicas, tokenizer, config), args.host,
                                                      args.grpc_port)
        log.info("gRPC frontend (stagemesh.v1.Frontend) on %s:%d", args.host, grpc_port)
    checker = asyncio.create_task(replicas.health_loop())
    # a client that disconnects cancels its handler, which aborts the request in the scheduler
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                           keepalive_timeout=args.http_timeout_keep_alive)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    log.info("router serving %s on http://%s:%d over %d replica(s) (%s); OpenAI API at /v1", name, args.host, port,
             len(replicas.replicas), args.policy)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    freeze_startup_heap("router")
    await stop.wait()
    checker.cancel()
    if grpc_server is not None:
        await grpc_server.stop(grace=1)
    await runner.cleanup()
    return 0
