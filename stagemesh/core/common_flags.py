"""The flags more than one service takes, declared once (stagemesh.core.flags): the model, LoRA, and the
single flags `stagemesh serve` passes to several kinds of child. A service's options use these constants
(or nest these groups); a flag one service alone takes is declared in that service's options."""
from __future__ import annotations

import os
from dataclasses import dataclass

from stagemesh.core.errors import StagemeshError
from stagemesh.core.flags import Flag
from stagemesh.core.kv_cache_dtype import KV_CACHE_DTYPES
from stagemesh.core.lora import ALLOWED_PATH_FLAG, MAX_LORA_RANKS
from stagemesh.core.model_source import ACTIVATION_MODES, QUANTIZATION_METHODS
from stagemesh.core.pooling import CONVERTS, RUNNERS, PoolerConfig, resolve

MODEL = Flag(("model",), kind="positional",
             help="model directory, or a .gguf file with --tokenizer (default: the embedded model)")


@dataclass(frozen=True)
class ModelOptions:
    """The model a service serves: MODEL, and the flags that say how to read its weights."""
    model: str | None = MODEL.field()
    tokenizer: str | None = Flag(("--tokenizer",), metavar="DIR", help=(
        "with a .gguf MODEL: the model directory whose config.json and tokenizer go with it (as vLLM's --tokenizer "
        "for a GGUF)")).field()
    quantization: str | None = Flag(("--quantization", "-q"), choices=QUANTIZATION_METHODS, help=(
        "gguf: serve a .gguf file's quantised weights as they are (Q4_0, Q4_1, Q4_K, Q8_0; with no MODEL, the "
        "embedded model's GGUF); w8a16: int8 weights with a scale per output channel, quantised at load, fp32/bf16 "
        "activations; w8a8: the same with activations quantised to int8 per token and block of 32 (dynamic), CPU "
        "stages only; fp8: "
        "float8_e4m3fn weights with a scale per output channel, quantised at load, weight-only, CUDA stages only "
        "(or an fp8 checkpoint's own); compressed-tensors, fbgemm_fp8, modelopt, gptq (gptq_marlin), awq "
        "(awq_marlin), mxfp4 "
        "(gpt-oss's experts): name the "
        "format of a quantised checkpoint (read from its quantization_config anyway; a mismatch is refused: "
        "docs/quantization.md)"
    )).field()
    quantization_activations: str | None = Flag(("--quantization-activations",), choices=ACTIVATION_MODES, help=(
        "how quantised integer weights (GGUF, GPTQ, AWQ, INT8, W4A16) multiply on CPU stages: exact (weight-only: "
        "fp32/bf16 activations, every product the dequantised model's) or int8 (activations quantised to int8 per "
        "row and group, products on VNNI; allowed where its accuracy contract holds: docs/quantization.md). "
        "Default: each format's measured choice"
    )).field()


@dataclass(frozen=True)
class PoolingOptions:
    """vLLM's pooling runner flags: the stages pool with them, the routers serve the pooling endpoints by them
    (stagemesh.core.pooling resolves both the same way from the model's config)."""
    runner: str = Flag(("--runner",), default="auto", choices=RUNNERS, help=(
        "generate: a generative model; pooling: the last stage pools the prompt's hidden states instead of sampling "
        "(/v1/embeddings, /classify, /score, /rerank, /pooling); auto (default): pooling for a "
        "*ForSequenceClassification or reward architecture, as vLLM's")).field()
    convert: str = Flag(("--convert",), default="auto", choices=CONVERTS, help=(
        "with --runner pooling, what the model is served as (vLLM's): embed (last-token pooled, normalized), "
        "classify (its score head, softmax; a single label: a cross-encoder for /score and /rerank) or reward "
        "(every token's hidden state, softmaxed); auto: by the architecture (a generative model: embed)")).field()
    pooler_config: str | None = Flag(("--pooler-config",), metavar="JSON", help=(
        "vLLM's pooler config over the model's and its sentence-transformers config: {\"pooling_type\": "
        "\"LAST|MEAN|CLS|ALL|STEP\", \"normalize\": BOOL, \"dimensions\": N, \"activation\": BOOL, "
        "\"step_tag_id\": ID, \"returned_token_ids\": [IDS]}")).field()

    def resolve(self, model_dir, raw: dict) -> PoolerConfig | None:
        """The pooler these flags give the model (None: the generate runner), or a start-up error naming why."""
        return resolve(model_dir, raw, self.runner, self.convert, self.pooler_config)

    def argv(self) -> list[str]:
        out = ["--runner", self.runner, "--convert", self.convert]
        return out + (["--pooler-config", self.pooler_config] if self.pooler_config is not None else [])


LORA_LIMITS = ("max_loras", "max_lora_rank", "max_cpu_loras")  # not the router's (it holds no adapter weights)


@dataclass(frozen=True)
class LoRAOptions:
    """vLLM's LoRA flags: the stages load the adapters, the schedulers and routers know their names."""
    enable_lora: bool = Flag(("--enable-lora",), kind="switch",
                             help="serve LoRA adapters: a request picks one by its model name (docs/lora.md)").field()
    lora_modules: tuple[str, ...] = Flag(("--lora-modules",), kind="extend", default=(), metavar="NAME=PATH", help=(
        "LoRA adapters (PEFT directories) as name=path or vLLM's JSON {\"name\": ..., \"path\": ..., "
        "\"base_model_name\": ...}; needs --enable-lora")).field()
    allowed_local_lora_path: tuple[str, ...] = Flag((ALLOWED_PATH_FLAG,), kind="extend", default=(), metavar="DIR",
                                                    help=(
        "directories adapters loaded at run time (/v1/load_lora_adapter, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) "
        "may be read from: a client's lora_path elsewhere is refused (ours; default none: run-time loading refused)"
    )).field()
    max_loras: int = Flag(("--max-loras",), type=int, default=1,
                          help="LoRA adapters in one batch (the stages' slots)").field()
    max_lora_rank: int = Flag(("--max-lora-rank",), type=int, default=16,
                              help=f"the largest adapter rank ({', '.join(map(str, MAX_LORA_RANKS))})").field()
    max_cpu_loras: int | None = Flag(("--max-cpu-loras",), type=int,
                                     help="adapters kept in host memory (default: --max-loras)").field()


# single flags of two services (and serve, which passes them on to both)
SERVED_MODEL_NAME = Flag(("--served-model-name",),
                         help="the model name clients send (default: the MODEL as given; a router's: its replicas')")
MAX_MODEL_LEN = Flag(("--max-model-len",), type=int,
                     help="the longest context a request may have (default: the model's, capped by the KV cache; a "
                          "router's caps below the replicas' own limit)")
MAX_REQUEST_RETRIES = Flag(("--max-request-retries",), type=int, default=3, help=(
    "a request whose replica fails goes on on another one (before its first token: sent again; after: continued "
    "from the tokens already streamed), at most this many times; a scheduler fails a request under which the "
    "pipeline broke more than this many times"))
# the router's bound on its own check of a constraint, and the scheduler's on its last stage's compile (while it
# waits, a structured request is not scheduled: vLLM's WAITING_FOR_FSM); past it, the request's 400
GRAMMAR_COMPILE_TIMEOUT = Flag(("--grammar-compile-timeout",), type=float, default=5.0, metavar="SECONDS", help=(
    "a request's structured-output constraint that takes longer to compile gets a 400 naming the bound (default "
    "5, as vLLM's regex bound): on the router (in a worker process) and on the replica's last stage, where the "
    "request waits, unscheduled, while its constraint compiles"))
# SGLang's flag: the scheduler's warm-up requests (scheduler.warmup) and a CPU stage's oneDNN builds at load
# (stage_worker.layers.warm_onednn); its default comes from the environment, so that every service of a mesh
# (and of each mesh a test suite starts) reads the same one
SKIP_WARMUP_ENV = "STAGEMESH_SKIP_SERVER_WARMUP"
SKIP_SERVER_WARMUP = Flag(("--skip-server-warmup",), kind="bool", help=(
    "SGLang's: say ready without warming up: the scheduler runs no warm-up requests through a new pipeline, and a "
    "CPU stage builds its oneDNN products as its steps first meet each row count rather than all at load. The "
    "first requests pay for what is made on first use (the first takes about twice the second). Default: off, or "
    f"${SKIP_WARMUP_ENV}=1 (what the test suite sets)"))


def skip_server_warmup(value: bool | None) -> bool:
    """--skip-server-warmup as given, else the environment's STAGEMESH_SKIP_SERVER_WARMUP (1/true or 0/false)."""
    if value is not None:
        return value
    raw = os.environ.get(SKIP_WARMUP_ENV, "").strip().lower()
    if raw not in ("", "0", "1", "false", "true"):
        raise StagemeshError(f"{SKIP_WARMUP_ENV}={raw!r}: expected 1 or 0 (true or false)")
    return raw in ("1", "true")


BLOCK_SIZE = Flag(("--block-size",), type=int, default=16)
PIPELINE_PARALLEL_SIZE = Flag(("--pipeline-parallel-size", "-pp"), type=int, default=1)
SPECULATIVE_CONFIG = Flag(("--speculative-config",), metavar="JSON", help=(
    "vLLM's speculative decoding config (JSON): method ngram (prompt lookup, proposed by the scheduler: "
    "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min) or draft_model ({\"model\": DIR, "
    "\"num_speculative_tokens\": k}: the last stage runs the draft on TP rank 0 with a KV cache of its own, in its "
    "KV budget); not with --async-scheduling (docs/speculative-decoding.md)"))
KV_CACHE_DTYPE = Flag(("--kv-cache-dtype",), default="auto", choices=KV_CACHE_DTYPES, help=(
    "vLLM's: the KV cache's dtype. auto: the model's; fp8 (= fp8_e4m3) or fp8_e5m2: one byte a value, so the same "
    "memory (--kv-cache-memory) holds twice a bf16 cache's tokens, four times an fp32 one's; each layer's keys and "
    "values scaled by the checkpoint's k_scale / v_scale, else 1.0, or by --calculate-kv-scales "
    "(docs/kv-cache-fp8.md). A scheduler refuses a stage whose --kv-cache-dtype is not its own"))
HOST = Flag(("--host",), default="127.0.0.1", help="address to listen on")
ADVERTISE_HOST = Flag(("--advertise-host",), help="address other services use to reach this service")
