"""The router's flags (RouterOptions, stagemesh.core.flags), and the settings it serves with (RouterConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field

from stagemesh.core.common_flags import (GRAMMAR_COMPILE_TIMEOUT, HOST, LORA_LIMITS, MAX_MODEL_LEN, MAX_REQUEST_RETRIES,
                                         SERVED_MODEL_NAME, LoRAOptions, ModelOptions, PoolingOptions)
from stagemesh.core.errors import StagemeshError
from stagemesh.core.flags import Flag, group
from stagemesh.core.service_options import ServiceOptions
from router.generation_config import SamplingDefaults
from router.lora_registry import LoRARegistry
from stagemesh.core.pooling import PoolerConfig
from router.reasoning import REASONING_PARSERS
from router.limits import TenantLimits
from router.tenants import Tenants

POLICIES = ("least-load", "cache-aware", "kv-aware", "round-robin")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class RouterOptions:
    """`stagemesh router`'s command line, each flag declared once (serve passes the same ones on)."""
    model_option: str | None = Flag(("--model",), metavar="MODEL",
                                    help="the same as the positional MODEL (vLLM's spelling)").field()
    source: ModelOptions = group(ModelOptions)
    replica: tuple[str, ...] | None = Flag(("--replica",), kind="append", required=True, metavar="HOST:PORT",
                                           help="a replica's scheduler (repeat for data parallelism)").field()
    host: str = HOST.field()
    port: int = Flag(("--port",), type=int, default=8000, help="HTTP port (0: any free port)").field()
    grpc_port: int | None = Flag(("--grpc-port",), type=int, help=(
        "serve the gRPC frontend on this port (0: any free port; default: off)")).field()
    served_model_name: str | None = SERVED_MODEL_NAME.field()
    api_key: str | None = Flag(("--api-key",), help=(
        "require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint but /health (and the gRPC "
        "frontend's metadata 'authorization'): one tenant, \"default\", of weight 1 and no limits")).field()
    api_keys_file: str | None = Flag(("--api-keys-file",), metavar="FILE", help=(
        "the API keys by tenant, JSON: {\"tenants\": {NAME: {\"keys\": [...], \"weight\": W, "
        "\"requests_per_minute\": R, \"tokens_per_minute\": T, \"max_concurrency\": C}}}, every field but keys "
        "optional. A key of no tenant gets a 401; a tenant's weight is its share of the replicas' steps against the "
        "others' (the schedulers' --tenant-fair-share). Read again on SIGHUP (or serve's POST "
        "/admin/reload-api-keys) without a restart; a file that does not parse then keeps the tenants it had, "
        "and the log says why (at start-up it is refused, naming the line). Not with --api-key")).field()
    public_metrics: bool = Flag(("--public-metrics",), kind="switch",
                                help="serve /metrics without the API key").field()
    http_timeout_keep_alive: float = Flag(("--http-timeout-keep-alive",), type=float, default=5.0, metavar="SECONDS",
                                          help=(
        "close a connection that sends no complete request (headers included) for this long, as vLLM's "
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE (default 5)")).field()
    max_model_len: int | None = MAX_MODEL_LEN.field()
    enable_auto_tool_choice: bool | None = Flag(("--enable-auto-tool-choice",), kind="bool", help=(
        "tool_choice \"auto\": the model calls tools in its own format, which --tool-call-parser reads. Default: on "
        "when the model's chat template shows a format a parser reads (the start-up log names the parser it chose), "
        "else off (\"auto\" gets a 400); --no-enable-auto-tool-choice keeps it off")).field()
    tool_call_parser: str | None = Flag(("--tool-call-parser",), choices=TOOL_CALL_PARSERS, help=(
        "how the model writes tool calls: hermes (<tool_call>{...}</tool_call>), llama3_json, or openai (gpt-oss's "
        "harmony messages to functions.NAME; it needs --reasoning-parser openai_gptoss, which it brings when none is "
        "given) (default: chosen from the chat template)")).field()
    reasoning_parser: str | None = Flag(("--reasoning-parser",), choices=REASONING_PARSERS, help=(
        "split a reasoning model's thinking off its chat answers, as vLLM's parser of that name: <think> ... "
        "</think> goes to the message's reasoning / reasoning_content (streamed as such deltas; a reasoning item "
        "in the Responses API), the rest is the content; include_reasoning false drops it. A model whose chat "
        "template has no thinking part answers as without it; openai_gptoss reads gpt-oss's harmony channels "
        "(analysis: reasoning, final: content; its tool calls with --tool-call-parser openai). A "
        "request with an output constraint "
        "(structured outputs, tool_choice required or named) is refused while the model thinks: vLLM applies "
        "it after the reasoning ends, which is not built here yet")).field()
    policy: str = Flag(("--policy",), default="least-load", choices=POLICIES, help=(
        "least-load: fewest running + 4 x waiting; cache-aware: where this router sent the prompt's prefix before "
        "(a guess); kv-aware: where the replicas' KV events say the prompt's leading blocks are held, in any KV "
        "tier, each block weighed by the best tier holding it (device 1.0, host 0.8, disk 0.5), unless that replica "
        "is much busier; a replica whose events the router cannot trust now (a gap, its stream lost: resynced from "
        "a snapshot) counts no hit (docs/disaggregated-prefill.md); round-robin")).field()
    responses_store: str = Flag(("--responses-store",), default="memory", metavar="memory|URL", help=(
        "where the Responses API keeps its responses (store: true) for GET and DELETE /v1/responses/{id} and "
        "previous_response_id: memory (default: this router's own), or a Redis URL that several routers share "
        "(redis://[:PASSWORD@]HOST:PORT/DB, rediss:// for TLS, unix://PATH; keys stagemesh:responses:<id>; each call "
        "times out after 1 s unless the URL sets ?socket_timeout=S&socket_connect_timeout=S). While Redis is down, "
        "what needs it answers 503, and a response that could not be kept says \"store\": false")).field()
    responses_store_size: int | None = Flag(("--responses-store-size",), type=int, help=(
        "memory store: keep this many responses, the oldest dropped first (default 1000); not with a Redis store, "
        "which --responses-store-ttl and the server's maxmemory bound")).field()
    responses_store_ttl: float | None = Flag(("--responses-store-ttl",), type=float, metavar="SECONDS", help=(
        "Redis store: each response expires this many seconds after it was made (default 3600; a conversation goes "
        "on as long as its last response is younger); not with memory")).field()
    trust_request_chat_template: bool = Flag(("--trust-request-chat-template",), kind="switch", help=(
        "render a request's own 'chat_template' (chat completions, /tokenize) instead of refusing it with a 400, as "
        "vLLM's flag: each renders in a worker process, killed past --chat-template-timeout or past the longest "
        "prompt the model can take")).field()
    chat_template_timeout: float = Flag(("--chat-template-timeout",), type=float, default=5.0, metavar="SECONDS",
                                        help=(
        "with --trust-request-chat-template: the time a request's chat template may take to render before its "
        "worker is killed and the request gets a 400 (default 5)")).field()
    structured_outputs_config: str | None = Flag(("--structured-outputs-config",), metavar="JSON", help=(
        "as vLLM's: {\"backend\": \"xgrammar\", \"disable_any_whitespace\": BOOL}. JSON constraints (response_format, "
        "guided_json, forced tool calls) generate compact JSON unless disable_any_whitespace is false (then a run of "
        "at most 16 whitespace characters may come between tokens); a request's "
        "structured_outputs.disable_any_whitespace overrides it. Default here: true (vLLM's default, false, lets a "
        "small model run away on whitespace)")).field()
    grammar_compile_timeout: float = GRAMMAR_COMPILE_TIMEOUT.field()
    max_queue_wait: float = Flag(("--max-queue-wait",), type=float, default=0.0, metavar="SECONDS", help=(
        "saturation shedding: a new request whose tenant's oldest waiting request has waited this long on every "
        "replica (the schedulers' queues, as their stats say) gets a 503 with Retry-After instead of queueing; a "
        "tenant of weight w sheds at SECONDS x w / the file's largest weight, so the lowest-weight tenants are "
        "shed first (0: never)")).field()
    max_waiting_requests: int = Flag(("--max-waiting-requests",), type=int, default=0, help=(
        "answer 429 (with Retry-After) once this many requests wait for their first token (0: unbounded; the "
        "schedulers' own queue limits also give 429)")).field()
    generation_config: str = Flag(("--generation-config",), default="auto", metavar="auto|vllm|FOLDER", help=(
        "the default sampling of a request that leaves some unset (vLLM's flag): auto takes the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as the "
        "default max_tokens); vllm ignores it (the API's own defaults: chat and completions' temperature 1.0, "
        "max_tokens the room the context leaves); FOLDER takes FOLDER/generation_config.json, whose "
        "max_new_tokens then also caps every request's max_tokens, as in vLLM. A request's own values win. The "
        "start-up log says which defaults were taken")).field()
    override_generation_config: str | None = Flag(("--override-generation-config",), metavar="JSON", help=(
        "defaults over --generation-config's (vLLM's flag), e.g. '{\"temperature\": 0.5}'; its max_new_tokens "
        "also caps every request's max_tokens, as in vLLM")).field()
    max_request_retries: int = MAX_REQUEST_RETRIES.field()
    stream_interval: int = Flag(("--stream-interval",), type=int, default=1, metavar="TOKENS", help=(
        "vLLM's: a choice's output goes out every TOKENS tokens (its first token at once, its last with the finish), "
        "so that a stream sends fewer, larger chunks and the router spends less per token; 1 (the default): every "
        "token as it comes")).field()
    lora: LoRAOptions = group(LoRAOptions, skip=LORA_LIMITS)
    pooling: PoolingOptions = group(PoolingOptions)
    health_interval: float = Flag(("--health-interval",), type=float, default=1.0,
                                  help="seconds between replica checks").field()
    rebalance_interval: float = Flag(("--rebalance-interval",), type=float, default=0.0, metavar="SECONDS", help=(
        "every SECONDS, move running requests from the busiest replica to the least loaded when they differ by "
        "--rebalance-min-gap or more: they go on there with their KV (the schedulers' --migration-policy; the "
        "receiving replica names the busy one with --kv-peer, as serve does), as a draining replica's do "
        "(router.rebalance). 0 (the default): requests stay where they started")).field()
    rebalance_min_gap: int = Flag(("--rebalance-min-gap",), type=int, default=4, metavar="REQUESTS", help=(
        "with --rebalance-interval: the difference in running requests that makes a move (half of it moves)"
    )).field()
    reuse_port: bool = Flag(("--reuse-port",), kind="switch", help=(
        "listen with SO_REUSEPORT, so that several routers share the HTTP (and gRPC) port and the kernel spreads "
        "connections over them (`stagemesh serve --api-server-count N` sets it)")).field()
    listen_when_ready: bool = Flag(("--listen-when-ready",), kind="switch", help=(
        "open the HTTP and gRPC ports only once a replica can answer a request, as vLLM's server opens its port "
        "only once its engine serves: a start-up script that waits for /health sends at once (`stagemesh serve` "
        "sets it for its routers). Without it the router listens at once: /health is its liveness, /ready its "
        "readiness")).field()
    control_port: int | None = Flag(("--control-port",), type=int, help=(
        "serve stagemesh.v1.RouterControl on this loopback port (0: any free port): the mesh's supervisor changes "
        "the replicas while the router serves, and probes this router's own readiness there (grpc.health.v1); "
        "needs the internal token (`stagemesh serve` sets it)")).field()
    batch_dir: str | None = Flag(("--batch-dir",), metavar="DIR", help=(
        "serve the Batch API (/v1/files with purpose batch, /v1/batches), keeping files and batches under DIR: they "
        "survive a restart, and a batch in progress goes on (on any router given the same DIR, one at a time). "
        "Default: off (vLLM has no online Batch API)")).field()
    batch_max_file_bytes: int = Flag(("--batch-max-file-bytes",), type=int, default=200 << 20, help=(
        "a larger upload to /v1/files is refused with a 413 that says this limit (default 200 MiB, OpenAI's)")).field()
    batch_concurrency: int = Flag(("--batch-concurrency",), type=int, default=8, help=(
        "a batch's requests in flight at once (default 8); under --scheduling-policy priority on the replicas, they "
        "run below interactive requests")).field()
    service: ServiceOptions = group(ServiceOptions, skip=("metrics_port",))


@dataclass(frozen=True)
class RouterConfig:
    served_model_name: str
    api_key: str | None = None  # every endpoint but /health (and /metrics when public) needs it: one tenant
    max_model_len: int | None = None  # a cap below the replicas' own
    public_metrics: bool = False  # /metrics without the API key
    tool_call_parser: str | None = None  # tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser)
    reasoning_parser: str | None = None  # --reasoning-parser: chat answers' thinking split off (router.reasoning)
    template_thinks: bool = False  # the model's chat template has a thinking part (router.reasoning)
    # the Responses API's stored responses: "memory" (this router's, the last responses_store_size, default 1000)
    # or a Redis URL that several routers share (each response kept responses_store_ttl seconds, default 3600);
    # None: not given (router.responses_api.store refuses a bound that is not its store's)
    responses_store: str = "memory"
    responses_store_size: int | None = None
    responses_store_ttl: float | None = None
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered, not refused
    chat_template_timeout: float = 5.0  # seconds a request's own chat template may take to render
    # JSON constraints' whitespace when a request does not say (--structured-outputs-config's
    # disable_any_whitespace, true by default here): False compact, True a bounded run per gap
    json_any_whitespace: bool = False
    grammar_compile_timeout: float = 5.0  # seconds a request's constraint may take to compile (router.grammar_pool)
    # the model's generation config (--generation-config): defaults of what a request's sampling leaves unset
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # --enable-lora: adapters a request picks by its model name (--lora-modules, and those loaded at run time)
    lora: LoRARegistry = field(default_factory=LoRARegistry)
    # --runner pooling: how the replicas pool, which endpoints serve (router.pooling_api); None: generation
    pooler: PoolerConfig | None = None
    # --batch-dir: the Batch API's files and batches (router.batch); None: the Batch API is off
    batch_dir: str | None = None
    batch_max_file_bytes: int = 200 << 20
    batch_concurrency: int = 8
    stream_interval: int = 1  # --stream-interval: tokens a choice's outputs gather before they go out
    max_queue_wait: float = 0.0  # --max-queue-wait (router.admission.shed; 0: no shedding)
    limits: TenantLimits | None = None  # the tenants' limits, counted (router.limits)
    # the keys every endpoint but /health (and /metrics when public) needs, by tenant (router.tenants): the
    # --api-keys-file's, or --api-key's one tenant; None: no key needed
    tenants: Tenants | None = None

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return self.lora.names()

    def __post_init__(self) -> None:
        if self.api_key is not None:
            if self.tenants is not None and self.tenants.path is not None:
                raise StagemeshError("--api-key and --api-keys-file cannot both be given: add the key to a tenant "
                                     "of the file")
            if self.tenants is None:  # (derived once, when built; a copy by dataclasses.replace keeps it)
                object.__setattr__(self, "tenants", Tenants.of_api_key(self.api_key))
        if not self.chat_template_timeout > 0:
            raise StagemeshError(f"--chat-template-timeout must be > 0, got {self.chat_template_timeout}")
        if not self.grammar_compile_timeout > 0:
            raise StagemeshError(f"--grammar-compile-timeout must be > 0, got {self.grammar_compile_timeout}")
        if self.batch_max_file_bytes < 1 or self.batch_concurrency < 1:
            raise StagemeshError("--batch-max-file-bytes and --batch-concurrency must be >= 1")
        if self.stream_interval < 1:
            raise StagemeshError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if not self.max_queue_wait >= 0:
            raise StagemeshError(f"--max-queue-wait must be >= 0 seconds, got {self.max_queue_wait}")
        if self.tool_call_parser == "openai" and self.reasoning_parser != "openai_gptoss":
            given = self.reasoning_parser or "none"
            raise StagemeshError("--tool-call-parser openai reads gpt-oss's harmony messages: it needs "
                                 f"--reasoning-parser openai_gptoss (the default with it), not {given}")

    @property
    def template_timeout_s(self) -> float | None:
        """The time bound of requests' own chat templates; None: they are refused (router.tokenization)."""
        return self.chat_template_timeout if self.trust_request_chat_template else None


STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_any_whitespace")


def json_any_whitespace(structured_outputs_config: str | None) -> bool:
    """The whitespace default of --structured-outputs-config (vLLM's flag: JSON with "backend", auto or
    xgrammar, and "disable_any_whitespace"); compact unless it says "disable_any_whitespace": false."""
    import json

    flag = "--structured-outputs-config"
    if structured_outputs_config is None:
        return False
    try:
        value = json.loads(structured_outputs_config)
    except ValueError as err:
        raise StagemeshError(f"{flag} must be JSON: {err}") from None
    if not isinstance(value, dict) or set(value) - set(STRUCTURED_OUTPUTS_KEYS):
        raise StagemeshError(f"{flag} takes an object with the keys {', '.join(STRUCTURED_OUTPUTS_KEYS)}, got "
                             f"{structured_outputs_config}")
    if value.get("backend", "xgrammar") not in ("auto", "xgrammar"):
        raise StagemeshError(f"{flag} backend {value['backend']!r} is not available: this server compiles with "
                             "xgrammar")
    disable = value.get("disable_any_whitespace", True)
    if not isinstance(disable, bool):
        raise StagemeshError(f"{flag} disable_any_whitespace must be true or false, got {disable!r}")
    return not disable
