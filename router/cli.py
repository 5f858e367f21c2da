"""`stagemesh router`: the OpenAI HTTP gateway over one or more replicas."""
from __future__ import annotations

import argparse
import asyncio
import logging

from stagemesh.core import event_loop
from stagemesh.core.heap import freeze_startup_heap
from stagemesh.core.flags import add_flags
from stagemesh.core.service_options import setup_service

log = logging.getLogger("stagemesh.router")
STARTUP_WAIT_S = 600.0  # a --reuse-port / --listen-when-ready router's wait for a healthy replica before it listens


def add_arguments(p: argparse.ArgumentParser) -> None:
    from router.config import RouterOptions

    add_flags(p, RouterOptions)


def run(args: argparse.Namespace) -> int:
    setup_service(args, "stagemesh-router")
    return event_loop.run(_main(args))


async def _main(args: argparse.Namespace) -> int:
    from router.balancing import POLICIES
    from router.replica_set import ReplicaSet
    from router.state import LIFECYCLE
    from stagemesh.core.shutdown import Shutdown

    shutdown = Shutdown(args.shutdown_timeout, log, "router")
    shutdown.install_async()  # a signal during start-up: the router stops as soon as it is up
    _check_args(args)
    replicas = ReplicaSet(args.replica, POLICIES[args.policy](), args.health_interval, args.max_waiting_requests,
                          args.max_request_retries)
    await replicas.refresh()
    app, config = _build_app(args, replicas)
    await _report_store(app)
    _reload_on_sighup(config)
    control = await _control(args, replicas, app[LIFECYCLE], config)
    if config.lora.enabled:  # a replica that lacks an adapter loaded at run time (it restarted) gets it
        from router import lora_api

        replicas.after_refresh.append(lambda: lora_api.sync_soon(config.lora))
    checker = asyncio.create_task(replicas.health_loop())
    rebalancer = None
    if args.rebalance_interval:
        from router.rebalance import rebalance_loop

        rebalancer = asyncio.create_task(rebalance_loop(replicas, args.rebalance_interval, args.rebalance_min_gap))
    if args.reuse_port or args.listen_when_ready:
        await _wait_for_a_replica(replicas, shutdown)
    if args.listen_when_ready and not replicas.healthy():  # (past the wait) /health: 503 until a replica serves
        _starting(app[LIFECYCLE], replicas)
    grpc_server = await _frontend(args, replicas, app, config)
    runner, site = await _serve_http(args, app, config.served_model_name, len(replicas.replicas))
    _run_batches(args, app, runner.addresses[0][1])
    freeze_startup_heap("router")
    await shutdown.wait()
    await _drain(shutdown, app[LIFECYCLE], site, replicas)
    checker.cancel()
    if rebalancer is not None:
        rebalancer.cancel()
    if grpc_server is not None:
        await grpc_server.stop(grace=0)
    if control is not None:
        control[1].cancel()
        await control[0].stop(grace=0)
    await runner.cleanup()
    await replicas.close()
    if config.limits is not None:  # (the places its requests held in a shared store: given back)
        await config.limits.close()
    return 0


def _check_args(args: argparse.Namespace) -> None:
    from stagemesh.core.errors import StagemeshError

    if args.model and args.model_option and args.model != args.model_option:
        raise StagemeshError(f"two models given: '{args.model}' and --model '{args.model_option}'")
    if args.max_request_retries < 0:
        raise StagemeshError("--max-request-retries must be >= 0")
    _check_store(args)
    if args.max_waiting_requests < 0 or args.health_interval <= 0 or args.http_timeout_keep_alive <= 0:
        raise StagemeshError("--max-waiting-requests must be >= 0, --health-interval and --http-timeout-keep-alive > 0")
    if not args.rebalance_interval >= 0 or args.rebalance_min_gap < 2:
        raise StagemeshError(f"--rebalance-interval must be >= 0 (0: off) and --rebalance-min-gap >= 2 (a move of "
                             f"half the gap), got {args.rebalance_interval} and {args.rebalance_min_gap}")


def _build_app(args: argparse.Namespace, replicas):
    """The gateway's aiohttp app over the replicas, and the router's config: the served name (the flag's, else a
    replica's, else the model's), the tokenizer of the model (a GGUF's: its --tokenizer), LoRA, tools, traces."""
    from router.app import build_app
    from router.config import RouterConfig, json_any_whitespace
    from router.generation_config import load, report
    from router.lora_registry import LoRARegistry
    from router.observe import configure
    from router.tokenization import Tokenizer
    from stagemesh.core.model_config import ModelConfig
    from stagemesh.core.model_source import resolve_source
    from stagemesh.core.common_flags import PoolingOptions
    from stagemesh.core.flags import from_args

    source = resolve_source(args.model_option or args.model, args.tokenizer, args.quantization)
    model_config = ModelConfig.from_path(source.model_dir)
    name = args.served_model_name or next((r.served_model_name for r in replicas.replicas if r.served_model_name),
                                          None) or source.name
    tenants, limits = _tenants(args)
    config = RouterConfig(name, args.api_key, args.max_model_len, args.public_metrics, None, tenants=tenants,
                          limits=limits, max_queue_wait=args.max_queue_wait,
                          responses_store=args.responses_store, responses_store_size=args.responses_store_size,
                          responses_store_ttl=args.responses_store_ttl,
                          trust_request_chat_template=args.trust_request_chat_template,
                          chat_template_timeout=args.chat_template_timeout,
                          json_any_whitespace=json_any_whitespace(args.structured_outputs_config),
                          grammar_compile_timeout=args.grammar_compile_timeout,
                          sampling_defaults=report(load(source.model_dir, args.generation_config,
                                                        args.override_generation_config)),
                          lora=LoRARegistry(_lora_modules(args, name), args.enable_lora,
                                            tuple(args.allowed_local_lora_path), replica_set=replicas),
                          pooler=from_args(PoolingOptions, args).resolve(source.model_dir, model_config.raw),
                          batch_dir=args.batch_dir, batch_max_file_bytes=args.batch_max_file_bytes,
                          batch_concurrency=args.batch_concurrency,
                          stream_interval=args.stream_interval)
    tokenizer = Tokenizer(source.model_dir, model_config.max_position_embeddings, config.template_timeout_s,
                          config.grammar_compile_timeout, config.json_any_whitespace)
    config = _auto_tool_choice(args, config, tokenizer)
    config = _reasoning(args, config, tokenizer)
    configure(name, args.max_model_len or replicas.max_model_len or model_config.max_position_embeddings)
    _instrument()
    return build_app(replicas, tokenizer, config), config


def _tenants(args: argparse.Namespace):
    """(--api-keys-file's tenants, their limits counted where the routers share them: the Redis store of
    --responses-store, else this router), or (None, None). Routers that share a port (--reuse-port) without a
    Redis store would each count a tenant's limits apart: a file that sets one is refused."""
    from router.limits import MemoryWindows, TenantLimits
    from router.responses_api.store import REDIS_SCHEMES
    from router.tenants import Tenants

    if not args.api_keys_file:
        return None, None
    redis = args.responses_store.startswith(REDIS_SCHEMES)
    unshared = "this router shares its port with others (--reuse-port, --api-server-count) and no Redis store " \
               "(--responses-store redis://...) would count it for all of them" if args.reuse_port and not redis \
        else None
    tenants = Tenants.from_file(args.api_keys_file, unshared)
    if redis:
        from router.limits_redis import RedisSlots, RedisWindows

        return tenants, TenantLimits(RedisWindows(args.responses_store), RedisSlots(args.responses_store))
    return tenants, TenantLimits(MemoryWindows())


def _instrument() -> None:
    """With traces on (stagemesh.core.telemetry): a span per HTTP request, its context carried on to the
    scheduler."""
    from stagemesh.core import telemetry

    if telemetry.enabled():
        from opentelemetry import trace
        from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

        AioHttpServerInstrumentor().instrument(tracer_provider=trace.get_tracer_provider())


async def _frontend(args: argparse.Namespace, replicas, app, config):
    """The gRPC frontend's server (stagemesh.v1.Frontend), or None without --grpc-port."""
    if args.grpc_port is None:
        return None
    from router.frontend import FrontendServicer, serve_frontend
    from router.state import LIFECYCLE, TOKENIZER

    server, port = await serve_frontend(FrontendServicer(replicas, app[TOKENIZER], config, app[LIFECYCLE]),
                                        args.host, args.grpc_port)
    log.info("gRPC frontend (stagemesh.v1.Frontend) on %s:%d", args.host, port)
    return server


async def _serve_http(args: argparse.Namespace, app, name: str, num_replicas: int):
    """The OpenAI HTTP API listening (SO_REUSEPORT with --reuse-port): its runner and site."""
    from aiohttp import web

    from router.http_server import GatewayRunner
    from router.state import LIFECYCLE

    # a client that disconnects cancels its handler, which aborts the request in the scheduler
    runner = GatewayRunner(app, access_log=None, handler_cancellation=True,
                           keepalive_timeout=args.http_timeout_keep_alive, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, reuse_port=args.reuse_port or None)
    await site.start()
    app[LIFECYCLE].listening = True
    log.info("router serving %s on http://%s:%d over %d replica(s) (%s); OpenAI API at /v1", name, args.host,
             runner.addresses[0][1], num_replicas, args.policy)
    return runner, site


async def _wait_for_a_replica(replicas, shutdown) -> None:
    """A router opens its ports only once a replica can serve when it shares them (--reuse-port: the kernel
    spreads new connections over every router listening there, ready or not) or is told to (--listen-when-ready:
    vLLM's start-up, where an open port means "send now"). At most STARTUP_WAIT_S, then it listens anyway and
    answers 503 until a replica serves."""
    loop = asyncio.get_running_loop()
    start = last = loop.time()
    while not replicas.healthy() and not shutdown.requested.is_set():
        now = loop.time()
        if now - start > STARTUP_WAIT_S:
            log.warning("no replica is healthy after %.0fs: listening anyway (/health and /ready answer 503 until "
                        "one serves)", STARTUP_WAIT_S)
            return
        if now - last >= 5 or now == start:
            last = now
            log.info("waiting for a replica to serve before listening (at most %.0fs left): %s",
                     STARTUP_WAIT_S - (now - start),
                     "; ".join(f"{r.address}: {r.reason or 'healthy'}" for r in replicas.replicas))
        await asyncio.sleep(0.1)


def _run_batches(args: argparse.Namespace, app, port: int) -> None:
    """With --batch-dir: this router runs batches (its own and those nobody runs), each line sent to itself."""
    from router.batch.api import RUNNER

    if RUNNER in app:
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        app[RUNNER].serve(f"http://{host if ':' not in host else f'[{host}]'}:{port}")
        log.info("Batch API: files and batches under %s", args.batch_dir)


def _starting(lifecycle, replicas) -> None:
    """/health says 503 until a health check finds a replica that serves."""
    def check() -> None:
        if lifecycle.starting and replicas.healthy():
            lifecycle.starting = False
            log.info("a replica serves: /health says 200")

    lifecycle.starting = True
    replicas.after_refresh.append(check)


async def _drain(shutdown, lifecycle, site, replicas) -> None:
    """Take no new work (readiness false; the listening socket closed, so that new connections reach the other
    routers), let the requests in flight finish, at most --shutdown-timeout; those still running then are left
    to their replicas, which keep the resumable ones for their clients to resume on another router."""
    lifecycle.draining = True
    await site.stop()
    if not await shutdown.drain(lambda: lifecycle.active == 0, lambda: f"{lifecycle.active} request(s)"):
        replicas.detach()


def _reload_on_sighup(config) -> None:
    """--api-keys-file is read again on SIGHUP (a file that does not parse keeps the tenants: logged)."""
    import signal

    from stagemesh.core.errors import StagemeshError

    tenants = config.tenants
    if tenants is None or tenants.path is None:
        return

    def reload() -> None:
        try:
            tenants.reload()
        except StagemeshError:
            pass  # (logged by reload)

    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


async def _control(args: argparse.Namespace, replicas, lifecycle, config):
    """The control port's server (router.control) and its health task (held while it runs), or None without
    --control-port."""
    if args.control_port is None:
        return None
    from router.control import CONTROL_HOST, serve_control

    server, port, follower = await serve_control(replicas, args.control_port,
                                                 lambda: lifecycle.listening and bool(replicas.healthy())
                                                 and not lifecycle.draining, config.tenants)
    log.info("control port (stagemesh.v1.RouterControl) on %s:%d", CONTROL_HOST, port)
    return server, follower


def _auto_tool_choice(args: argparse.Namespace, config, tokenizer):
    """The config with tool_choice "auto"'s parser: the flags', else the one the chat template shows
    (router.tool_parser_choice), logged either way."""
    import dataclasses

    from router.tool_parser_choice import choose

    choice = choose(args.enable_auto_tool_choice, args.tool_call_parser, tokenizer.tok.chat_template)
    log.info("%s", choice.message)
    if choice.parser == "openai" and args.reasoning_parser is None:  # (its calls are harmony messages)
        args.reasoning_parser = "openai_gptoss"
        log.info("reasoning parser openai_gptoss: the openai tool-call parser reads gpt-oss's harmony channels "
                 "(--reasoning-parser names it)")
    return dataclasses.replace(config, tool_call_parser=choice.parser, reasoning_parser=args.reasoning_parser)


def _reasoning(args: argparse.Namespace, config, tokenizer):
    """The config with --reasoning-parser, and whether the model's chat template thinks, logged."""
    import dataclasses

    from router.reasoning import template_thinks

    if args.reasoning_parser is None:
        return config
    thinks = template_thinks(tokenizer.tok.chat_template)
    log.info("reasoning parser %s: %s", args.reasoning_parser,
             "the chat template has a thinking part: answers that do not open <think> start in it" if thinks else
             "the chat template has no thinking part: only answers that open with <think> are split")
    return dataclasses.replace(config, reasoning_parser=args.reasoning_parser, template_thinks=thinks)


def _check_store(args: argparse.Namespace) -> None:
    from router.responses_api.store_flags import check_store_options
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
