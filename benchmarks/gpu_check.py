"""GPU check (issue 45): one script, one device run of under 10 minutes on one H100, that prints everything.

A Llama-shaped model with random bf16 weights (`--shape 1b`: Llama-3.2-1B's config, the default; `--shape 8b`:
Llama-3.1-8B's) is written as a Hugging Face model directory (config.json, sharded safetensors made on the GPU, a
word-level tokenizer of the model's vocabulary), then the same workload runs through

1. `stagemesh serve` (router, scheduler, stage: the whole mesh, as processes) driven over HTTP by stagemesh's
   bench client (stagemesh.entry.bench), and
2. the in-process engine (stagemesh.entry.local_engine.LocalEngine) in this process, same weights, dtype and settings,

at batch 1 (one request at a time) and at 32 concurrent requests. It prints TPOT, output throughput, the batch-1
fraction of the HBM roofline (roofline TPOT = (weight bytes read per token + KV bytes read per token) / peak HBM
bandwidth; the peak from the device's name: H100 SXM 3.35 TB/s, H100 PCIe 2.0 TB/s, H100 NVL 3.9 TB/s, H200
4.8 TB/s, or --hbm-gbps), the mesh / in-process ratios, the targets beside them (batch 1 >= 0.8 of the roofline,
mesh / in-process >= 0.95), and a markdown table for benchmarks/RESULTS.md.

    python benchmarks/gpu_check.py                      # 1B shape, cuda
    python benchmarks/gpu_check.py --shape 8b
    python benchmarks/gpu_check.py --dry-run            # tiny shape, few tokens, CPU: the whole path, cheaply

Without CUDA it is a dry run by itself. Every wait is bounded (--startup-timeout, --request-timeout, and --budget
for the whole script: 570 s by default, inside a 10-minute device command); every process it starts is stopped on
the way out, on errors and on Ctrl-C / SIGTERM too.

What the device machine needs. It has torch, triton, grpcio, protobuf, aiohttp, transformers (with tokenizers,
safetensors, numpy, tqdm) and prometheus-client. A serve imports more: opentelemetry-api (stagemesh.core.telemetry),
grpcio-health-checking and grpcio-reflection (every service), pydantic (+ pydantic-core, annotated-types,
typing-inspection: the router's request bodies), xgrammar (+ apache-tvm-ffi: the router's grammar worker) and
jinja2 (chat templates). The script imports all of these first and, if any is missing, stops at once naming the
modules and the pip packages to carry. Carry them as a folder on PYTHONPATH, built here for the device's Python
(it prints its version first; the stored figures came from 3.12 machines, check) e.g.

    pip download --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux2014_x86_64 -d wheels \\
        opentelemetry-api grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 pydantic pydantic-core \\
        annotated-types typing-inspection xgrammar apache-tvm-ffi
    pip install --no-deps --target .gpu-deps wheels/*.whl          # about 30 MB
    run(command="PYTHONPATH=.gpu-deps python3 benchmarks/gpu_check.py", carry=[".gpu-deps"])

(`python3 benchmarks/gpu_check.py --check-deps` does only the import check, in seconds.) stagemesh itself needs no
install: the script puts this checkout on its children's PYTHONPATH and the package finds its generated protobuf
code in protos/ (stagemesh/__init__.py).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's stagemesh, installed or not
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# ---------------------------------------------------------------------------------------------------------------
# shapes

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.2-1B: 1.24 B parameters, tied embeddings
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
               tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B: 8.03 B parameters
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
               rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
               tie_word_embeddings=False),
    # the dry run's: every code path, no cost
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
}
BOS, EOS = 1, 2  # the word tokenizer's <s> and </s>
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# ---------------------------------------------------------------------------------------------------------------
# the roofline (pure arithmetic; tests/test_gpu_check.py checks it against a hand-computed figure)

# peak HBM bandwidth, GB/s (1e9 bytes/s), by the device's name; the first match wins
HBM_PEAKS: tuple[tuple[str, float, str], ...] = (
    ("H200", 4800.0, "H200 (4.8 TB/s)"),
    ("H100 PCIE", 2000.0, "H100 PCIe (2.0 TB/s)"),
    ("H100 NVL", 3900.0, "H100 NVL (3.9 TB/s)"),
    ("H100", 3350.0, "H100 SXM (3.35 TB/s)"),
)


def hbm_peak(device_name: str, override_gbps: float | None = None) -> tuple[float | None, str]:
    """(peak GB/s or None when unknown, which peak it is)."""
    if override_gbps:
        return override_gbps, f"--hbm-gbps {override_gbps:g} GB/s"
    name = device_name.upper()
    for key, gbps, label in HBM_PEAKS:
        if key in name:
            return gbps, label
    return None, f"unknown for {device_name!r}: pass --hbm-gbps"


def _dims(cfg: dict) -> tuple[int, int, int, int, int, int, int]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    return (h, cfg["intermediate_size"], cfg["num_hidden_layers"], heads, cfg["num_key_value_heads"], head_dim,
            cfg["vocab_size"])


def weight_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> int:
    """Weight bytes one decode step reads at batch 1: every layer's projections and norms, the final norm, the
    LM head (the embedding matrix when tied), and the one embedding row the token looks up."""
    h, inter, layers, heads, kv_heads, head_dim, vocab = _dims(cfg)
    per_layer = (h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h  # q, k, v, o
                 + 3 * h * inter + 2 * h)  # gate, up, down; two norms
    return dtype_bytes * (layers * per_layer + h + vocab * h + h)


def kv_bytes_per_position(cfg: dict, dtype_bytes: int = 2) -> int:
    """K and V of one token in every layer."""
    _, _, layers, _, kv_heads, head_dim, _ = _dims(cfg)
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def mean_decode_context(prompt_len: int, output_len: int) -> float:
    """Mean positions a decode step attends over: the steps that make tokens 2..n (TPOT leaves out the first,
    the prefill's) attend over prompt + 1 .. prompt + n - 1 positions."""
    return prompt_len + output_len / 2


def roofline_tpot_s(cfg: dict, prompt_len: int, output_len: int, peak_gbps: float, dtype_bytes: int = 2) -> float:
    """Batch-1 TPOT if every byte read moved at the peak HBM bandwidth."""
    kv = kv_bytes_per_position(cfg, dtype_bytes) * mean_decode_context(prompt_len, output_len)
    return (weight_bytes_per_token(cfg, dtype_bytes) + kv) / (peak_gbps * 1e9)


# ---------------------------------------------------------------------------------------------------------------
# what a serve imports

# (module, pip package): imported by a serve's services (router, scheduler, stage, grammar worker) or this script
REQUIRED = (
    ("torch", "torch"), ("grpc", "grpcio"), ("google.protobuf", "protobuf"),
    ("grpc_health.v1.health", "grpcio-health-checking"), ("grpc_reflection.v1alpha.reflection", "grpcio-reflection"),
    ("aiohttp", "aiohttp"), ("transformers", "transformers"), ("tokenizers", "tokenizers"),
    ("safetensors", "safetensors"), ("numpy", "numpy"), ("tqdm", "tqdm"), ("jinja2", "jinja2"),
    ("pydantic", "pydantic"), ("opentelemetry.trace", "opentelemetry-api"), ("opentelemetry.propagate",
                                                                              "opentelemetry-api"),
    ("prometheus_client", "prometheus-client"), ("xgrammar", "xgrammar"),
)
CUDA_REQUIRED = (("triton", "triton"),)
# stagemesh's own modules, a group per process (each service registers its own metrics: one process cannot import
# them all); importing them finds any third-party import the list above misses
SERVE_MODULES = (
    ("router.app", "router.frontend", "router.grammar_process", "router.template_process"),
    ("scheduler.cli", "scheduler.service"),
    ("stage_worker.cli", "stage_worker.service", "stage_worker.runner"),
    ("stagemesh.entry.cli", "stagemesh.entry.local_mesh", "stagemesh.entry.supervisor", "stagemesh.entry.local_engine",
     "stagemesh.entry.bench.cli", "stagemesh.entry.bench.backends", "stagemesh.core.telemetry",
     "stagemesh.v1.frontend_pb2_grpc"),
)
_IMPORT_CHECK = """
import importlib, json, sys
missing, failed = {}, {}
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except ModuleNotFoundError as err:
        missing[err.name or m] = m
    except Exception as err:
        failed[m] = f"{type(err).__name__}: {err}"
print(json.dumps({"missing": missing, "failed": failed}))
"""
PIP_NAMES = {"google": "protobuf", "grpc": "grpcio", "grpc_health": "grpcio-health-checking",
             "grpc_reflection": "grpcio-reflection", "opentelemetry": "opentelemetry-api",
             "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
             "typing_inspection": "typing-inspection", "tvm_ffi": "apache-tvm-ffi", "yaml": "pyyaml",
             "prometheus_client": "prometheus-client", "typing_extensions": "typing-extensions",
             "markupsafe": "MarkupSafe", "ml_dtypes": "ml-dtypes"}


def missing_modules(cuda: bool) -> dict[str, str]:
    """{missing module: pip package}, from importing every module a serve needs (empty: all there)."""
    missing: dict[str, str] = {}
    for module, package in REQUIRED + (CUDA_REQUIRED if cuda else ()):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            top = (err.name or module).split(".")[0]
            missing[err.name or module] = package if top == module.split(".")[0] else PIP_NAMES.get(top, top)
    if missing:
        return missing
    procs = [subprocess.Popen([sys.executable, "-c", _IMPORT_CHECK, *group], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=child_env(), cwd=str(REPO))
             for group in SERVE_MODULES]
    for group, proc in zip(SERVE_MODULES, procs):
        try:
            out, err = proc.communicate(timeout=180)
            found = json.loads(out.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise RuntimeError(f"importing {', '.join(group)} took over 180 s") from None
        except (ValueError, IndexError):
            raise RuntimeError(f"importing {', '.join(group)} failed (exit {proc.returncode}):\n"
                               f"{err[-3000:]}") from None
        for name in found["missing"]:
            missing[name] = PIP_NAMES.get(name.split(".")[0], name.split(".")[0])
        if found["failed"]:
            raise RuntimeError(f"importing stagemesh's modules failed: {found['failed']}")
    return missing


# ---------------------------------------------------------------------------------------------------------------
# the model directory


def hf_config(shape: str, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "bos_token_id": BOS, "eos_token_id": EOS,
            "pad_token_id": 0, "torch_dtype": dtype, **SHAPES[shape]}


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, inter, layers, heads, kv_heads, head_dim, vocab = _dims(cfg)
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (heads * head_dim, h)),
                (p + "self_attn.k_proj.weight", (kv_heads * head_dim, h)),
                (p + "self_attn.v_proj.weight", (kv_heads * head_dim, h)),
                (p + "self_attn.o_proj.weight", (h, heads * head_dim)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    out.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (vocab, h)))
    return out


def write_model(path: Path, shape: str, dtype: str, device: str, seed: int = 0,
                shard_bytes: int = 2 * 2**30) -> int:
    """A model directory with random weights made on `device` (seconds for 8B on a GPU) and written in shards of
    about `shard_bytes`; returns the bytes of weights."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape, dtype)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    write_tokenizer(path, cfg["vocab_size"])
    gen = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]  # planned first: each shard written once it is made
    size = total = 0
    for name, dims in tensor_shapes(cfg):
        nbytes = math.prod(dims) * itemsize
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, names in enumerate(shards):
        tensors = {}
        for name, dims in names:
            if "norm" in name:
                t = torch.ones(dims, dtype=torch_dtype, device=device)
            else:  # small enough that the activations stay finite through every layer in bf16
                t = torch.randn(dims, generator=gen, dtype=torch.float32 if device == "cpu" else torch_dtype,
                                device=device).mul_(0.02).to(torch_dtype)
            tensors[name] = t.cpu()
            del t
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        del tensors
    if device == "cuda":
        torch.cuda.empty_cache()  # the serve's stages and LocalEngine get the memory back
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    return total


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary ("w5 w6" -> [5, 6]) with a plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(path))


# ---------------------------------------------------------------------------------------------------------------
# processes and deadlines


# Both are KeyboardInterrupts, raised by signal handlers in whatever the main thread runs: so that no library's
# `except Exception` (a stage step's, a bench request's) takes one for a failure and goes on, and asyncio re-raises
# one from a task instead of keeping it in the task.
class Budget(KeyboardInterrupt):
    """The script's --budget ran out."""


class Stopped(KeyboardInterrupt):
    """SIGTERM / SIGHUP."""


def _free_port() -> int:
    """A port below the kernel's ephemeral range (stagemesh.core.ports): a port-0 bind's port may be taken as the
    source port of the mesh's own connections before serve's router binds it."""
    from stagemesh.core.ports import free_port

    return free_port()


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


class Serve:
    """`stagemesh serve` in a session of its own: ready once /health says every replica serves; stop() ends it
    and its children (SIGTERM, then SIGKILL to the whole group)."""

    def __init__(self, args: list[str], log: Path):
        self.port, self.log = _free_port(), log
        self.cmd = [sys.executable, "-m", "stagemesh", "serve", "--port", str(self.port), "--grpc-port",
                    str(_free_port()), *args]
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        """Seconds until healthy; raises RuntimeError with the log's tail if it exits or runs past `timeout`."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env(),
                                         cwd=str(REPO), start_new_session=True)
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`stagemesh serve` exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"`stagemesh serve` was not healthy after {timeout:.0f} s:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=2) as resp:
                    health = json.loads(resp.read())
                if health.get("replicas") and all(r.get("healthy") for r in health["replicas"]):
                    return time.monotonic() - start
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.25)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 60) -> None:
        proc = self.proc
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)  # the whole session: router, schedulers, stages
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait)
                # the group's other members may outlive the leader: one more SIGKILL to whatever is left
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None


# ---------------------------------------------------------------------------------------------------------------
# the two arms


@dataclass
class Workload:
    prompt_len: int
    output_len: int
    batch1_requests: int
    concurrency: int
    seed: int = 0

    def requests(self, vocab_size: int, num: int, salt: int) -> list:
        from stagemesh.entry.bench.workload import synthetic

        # different prompts per round (salt): no prefix-cache hit between rounds or arms' warm-ups
        return synthetic(vocab_size, {0, BOS, EOS}, num, (self.prompt_len,) * 2, (self.output_len,) * 2,
                         self.seed * 1000 + salt)


ROUNDS = (("batch 1", 1), ("concurrent", None))  # None: the workload's concurrency


def _summary(results: list, duration: float) -> dict:
    from stagemesh.entry.bench.report import summarize

    s = summarize(results, duration)
    return {k: s[k] for k in ("successful_requests", "failed_requests", "duration_s", "total_output_tokens",
                              "output_throughput", "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms", "mean_ttft_ms",
                              "p50_itl_ms")} | ({"errors": s["errors"]} if "errors" in s else {})


def run_mesh(serve: Serve, model_name: str, work: Workload, vocab: int, timeout: float, out: dict) -> None:
    from stagemesh.entry.bench.backends import OpenAIBackend
    from stagemesh.entry.bench.cli import drive

    async def one_round(requests: list, concurrency: int) -> tuple[list, float]:
        backend = OpenAIBackend(serve.base, model_name, None, timeout)
        try:
            return await asyncio.wait_for(drive(backend, requests, math.inf, concurrency, work.seed, False),
                                          timeout * 2)
        finally:
            await backend.close()

    _rounds(lambda reqs, conc: asyncio.run(one_round(reqs, conc)), work, vocab, out)


def run_inprocess(engine, work: Workload, vocab: int, timeout: float, out: dict) -> None:
    from stagemesh.entry.bench.report import Result
    from stagemesh.core.engine_request import EngineRequest
    from stagemesh.core.sampling_params import SamplingParams

    counter = iter(range(10**9))

    async def one(req, limit: asyncio.Semaphore) -> Result:
        async with limit:
            result, start = Result(input_len=req.input_len), time.perf_counter()
            last = start

            async def consume() -> None:
                nonlocal last
                sampling = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True)
                request = EngineRequest(f"gpu-check-{next(counter)}", req.prompt_ids, sampling)
                async for out in engine.driver.submit(request):
                    if out.finish_reason == "error":
                        result.error = out.error or "the request failed"
                        return
                    if out.new_token_ids:  # as the HTTP client times a chunk of tokens
                        now = time.perf_counter()
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        result.output_len += len(out.new_token_ids)

            try:
                await asyncio.wait_for(consume(), timeout)
            except asyncio.TimeoutError:
                result.error = f"no end after {timeout:.0f} s"
            result.latency = time.perf_counter() - start
            result.ok = not result.error and result.output_len > 0
            return result

    async def one_round(requests: list, concurrency: int) -> tuple[list, float]:
        limit = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(r, limit) for r in requests))
        return list(results), time.perf_counter() - start

    # LocalEngine's driver runs on its own event loop (as LocalEngine.generate drives it)
    _rounds(lambda reqs, conc: engine._loop.run_until_complete(one_round(reqs, conc)), work, vocab, out)


def _rounds(run_round, work: Workload, vocab: int, out: dict) -> None:
    """Warm-ups (a short request, a short concurrent round: compiles and graph captures), then each measured
    round, into out[round name] as it ends (a run stopped later keeps it)."""
    from stagemesh.entry.bench.workload import BenchRequest

    warm = [BenchRequest(max_tokens=4, prompt_ids=r.prompt_ids, input_len=r.input_len)
            for r in work.requests(vocab, work.concurrency, salt=90)]
    run_round(warm[:1], 1)
    run_round(warm, work.concurrency)
    for i, (name, concurrency) in enumerate(ROUNDS):
        concurrency = concurrency or work.concurrency
        num = work.batch1_requests if concurrency == 1 else work.concurrency
        results, duration = run_round(work.requests(vocab, num, salt=i + 1), concurrency)
        out[name] = _summary(results, duration) | {"concurrency": concurrency, "requests": num}
        log(f"  {name}: {_brief(out[name])}")


def _brief(s: dict) -> str:
    text = (f"{s['successful_requests']}/{s['requests']} ok, TPOT {s['mean_tpot_ms']:.2f} ms, "
            f"{s['output_throughput']:.1f} tok/s")
    return text + (f", errors: {s['errors']}" if s.get("errors") else "")


# ---------------------------------------------------------------------------------------------------------------
# the report


def log(msg: str) -> None:
    print(msg, flush=True)


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "none",
           "device": "cpu (" + (platform.processor() or platform.machine()) + f", {os.cpu_count()} cores)"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = "none"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["device"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
        env["device_name"] = props.name
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            env["driver"] = smi.stdout.strip() or "?"
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "?"
    try:
        env["commit"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True, timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        env["commit"] = "?"
    return env


def verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f} (target >= {target:g}: {'met' if value >= target else 'MISSED'})"


def report(env: dict, a: argparse.Namespace, cfg: dict, work: Workload, weights: int, peak: tuple,
           mesh: dict, local: dict) -> str:
    gbps, peak_label = peak
    dtype_bytes = DTYPE_BYTES[a.dtype]
    roof = roofline_tpot_s(cfg, work.prompt_len, work.output_len, gbps, dtype_bytes) if gbps else None
    per_token = weight_bytes_per_token(cfg, dtype_bytes)
    kv = kv_bytes_per_position(cfg, dtype_bytes) * mean_decode_context(work.prompt_len, work.output_len)
    lines = [
        f"## GPU check (benchmarks/gpu_check.py{' --dry-run' if a.dry_run else ''}): {env['device']}",
        "",
        f"{env['device']}{', driver ' + env['driver'] if 'driver' in env else ''}; torch {env['torch']}, CUDA "
        f"{env['cuda']}, Triton {env['triton']}, Python {env['python']}; commit {env['commit']}.",
        f"Model: `--shape {a.shape}` (Llama-shaped: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} q / {cfg['num_key_value_heads']} KV heads, vocab {cfg['vocab_size']}), random "
        f"{a.dtype} weights ({weights / 1e9:.3f} GB). Workload: {work.prompt_len}-token prompts, "
        f"{work.output_len} new tokens each (ignore_eos, greedy); batch 1 = {work.batch1_requests} requests one after "
        f"another, concurrent = {work.concurrency} at once. Same settings for both arms: --max-num-seqs "
        f"{a.max_num_seqs}, --max-num-batched-tokens {a.max_num_batched_tokens}, --kv-cache-memory "
        f"{a.kv_cache_memory}, block 16, {'async scheduling' if a.async_scheduling else 'no async scheduling'}.",
        f"Roofline (batch 1): ({per_token / 1e9:.4f} GB of weights + {kv / 1e6:.3f} MB of KV at the mean context "
        f"{mean_decode_context(work.prompt_len, work.output_len):g}) read per token / peak HBM "
        + (f"{peak_label} = **{roof * 1000:.4f} ms**." if roof else f"bandwidth {peak_label}: n/a."),
        "",
        "| arm | round | requests | TPOT mean ms | TPOT p50 ms | output tok/s | TTFT mean ms | of roofline "
        "(batch 1) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arm, data in (("mesh (`stagemesh serve`)", mesh), ("in-process (LocalEngine)", local)):
        for name, _ in ROUNDS:
            s = data.get(name)
            if s is None:
                lines.append(f"| {arm} | {name} | not run | | | | | |")
                continue
            frac = roof * 1000 / s["mean_tpot_ms"] if roof and name == "batch 1" and s["mean_tpot_ms"] else None
            lines.append(f"| {arm} | {name} | {s['successful_requests']}/{s['requests']} x {s['concurrency']} | "
                         f"{s['mean_tpot_ms']:.3f} | {s['p50_tpot_ms']:.3f} | {s['output_throughput']:,.1f} | "
                         f"{s['mean_ttft_ms']:.1f} | {verdict(frac, 0.8) if name == 'batch 1' else ''} |")
    lines += ["", "| round | mesh / in-process, output throughput | mesh / in-process, 1 / TPOT |", "|---|---|---|"]
    for name, _ in ROUNDS:
        m, l_ = mesh.get(name), local.get(name)
        if not m or not l_ or not m["output_throughput"] or not m["mean_tpot_ms"]:
            lines.append(f"| {name} | n/a | n/a |")
            continue
        lines.append(f"| {name} | {verdict(m['output_throughput'] / l_['output_throughput'], 0.95)} | "
                     f"{verdict(l_['mean_tpot_ms'] / m['mean_tpot_ms'], 0.95)} |")
    failed = [f"{arm} {name}: {s.get('errors')}" for arm, data in (("mesh", mesh), ("in-process", local))
              for name, s in data.items() if s.get("failed_requests")]
    if failed:
        lines += ["", "Failed requests: " + "; ".join(failed)]
    if a.dry_run:
        lines += ["", "(dry run: tiny shape on " + ("CPU" if a.device == "cpu" else a.device) + ", few tokens; the "
                  "figures check the path, not the speed)"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("1b", "8b", "tiny"), default="1b")
    p.add_argument("--dry-run", action="store_true", help="tiny shape, few tokens (automatic without CUDA)")
    p.add_argument("--check-deps", action="store_true", help="only check that every module a serve needs imports")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="bfloat16")
    p.add_argument("--hbm-gbps", type=float, default=None, help="peak HBM bandwidth, GB/s (default: from the name)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (dry run 16)")
    p.add_argument("--output-len", type=int, default=None, help="default 256 (dry run 8)")
    p.add_argument("--batch1-requests", type=int, default=None, help="default 4 (dry run 2)")
    p.add_argument("--concurrency", type=int, default=None, help="default 32 (dry run 8)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: --concurrency")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="KV bytes, both arms (default: room for every concurrent request, x2, at least 1 GiB on GPU)")
    p.add_argument("--skip-mesh", action="store_true", help="in-process arm only")
    p.add_argument("--skip-inprocess", action="store_true", help="mesh arm only")
    p.add_argument("--model-dir", default=None, help="reuse (or keep) the model directory here instead of a "
                                                     "temporary one")
    p.add_argument("--startup-timeout", type=float, default=300, help="seconds for the serve to become healthy")
    p.add_argument("--request-timeout", type=float, default=120, help="seconds for one request")
    p.add_argument("--budget", type=float, default=570, help="seconds for the whole script; past it, everything "
                                                              "is stopped and what was measured is printed")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (dry run: 1)")
    a = p.parse_args(argv)
    return a


def settle(a: argparse.Namespace, cuda_available: bool) -> Workload:
    """Fill in the defaults that depend on the device and the dry run."""
    if a.device is None:
        a.device = "cuda" if cuda_available else "cpu"
    if a.device == "cuda" and not cuda_available:
        sys.exit("--device cuda: torch sees no CUDA device")
    if a.device == "cpu" and not a.dry_run:
        log("no CUDA: a dry run (tiny shape, few tokens)")
        a.dry_run = True
    if a.dry_run:
        a.shape = "tiny"
    small = a.dry_run
    work = Workload(a.prompt_len or (16 if small else 128), a.output_len or (8 if small else 256),
                    a.batch1_requests or (2 if small else 4), a.concurrency or (8 if small else 32))
    a.max_num_seqs = a.max_num_seqs or work.concurrency
    a.max_model_len = work.prompt_len + work.output_len + 16
    if a.kv_cache_memory is None:
        cfg = hf_config(a.shape, a.dtype)
        need = kv_bytes_per_position(cfg, DTYPE_BYTES[a.dtype]) * (a.max_model_len + 16) * work.concurrency * 2
        a.kv_cache_memory = max(need, 2**30) if a.device == "cuda" else max(need, 8 * 2**20)
    a.async_scheduling = a.device == "cuda"  # serve's and LocalEngine's default per device, said to both
    if a.threads is None and a.device == "cpu":
        a.threads = 1
    return work


def failed_arm(what: str, err: Exception) -> int:
    import traceback

    traceback.print_exc()
    log(f"FAILED ({what}): {type(err).__name__}: {err}")
    return 1


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    log(f"gpu_check: python {platform.python_version()} ({sys.executable}), checkout {REPO}")
    start = time.monotonic()
    try:
        import torch
    except ImportError:
        log("MISSING: torch (pip: torch); nothing can run")
        return 2
    cuda = torch.cuda.is_available()
    missing = missing_modules(cuda and a.device != "cpu")
    if missing:
        packages = sorted(set(missing.values()))
        log("MISSING modules a serve imports: " + ", ".join(f"{m} (pip: {p})" for m, p in sorted(missing.items())))
        log("carry them (see this script's docstring), e.g. pip install --no-deps --target .gpu-deps "
            + " ".join(packages) + " (for this Python), then PYTHONPATH=.gpu-deps")
        return 2
    log(f"imports: every module a serve needs is there ({time.monotonic() - start:.1f} s)")
    if a.check_deps:
        return 0
    work = settle(a, cuda)
    if a.threads:
        torch.set_num_threads(a.threads)
    env = environment(a.device)
    log("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    peak = hbm_peak(env.get("device_name", ""), a.hbm_gbps) if a.device == "cuda" else \
        ((a.hbm_gbps or 50.0), f"dry run: a nominal {a.hbm_gbps or 50.0:g} GB/s")
    log(f"peak HBM bandwidth: {peak[1]}")

    def on_signal(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    def on_alarm(signum, frame):
        raise Budget(f"--budget {a.budget:g} s ran out")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(a.budget - (time.monotonic() - start))))

    tmp = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    model_dir = Path(a.model_dir) if a.model_dir else tmp / "model"
    cfg = hf_config(a.shape, a.dtype)
    mesh: dict = {}
    local: dict = {}
    serve: Serve | None = None
    engine = None
    weights = sum(math.prod(d) for _, d in tensor_shapes(cfg)) * DTYPE_BYTES[a.dtype]
    outcome = 0
    try:
        if (model_dir / "model.safetensors.index.json").exists() and \
                json.loads((model_dir / "config.json").read_text()) == cfg:
            log(f"model: reusing {model_dir}")
        else:
            t0 = time.monotonic()
            weights = write_model(model_dir, a.shape, a.dtype, a.device)
            log(f"model: {a.shape}, {weights / 1e9:.3f} GB of {a.dtype} weights written to {model_dir} in "
                f"{time.monotonic() - t0:.1f} s")
        common = ["--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs),
                  "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--block-size", "16",
                  "--kv-cache-memory", str(a.kv_cache_memory)]
        if not a.skip_mesh:
            try:
                serve = Serve([str(model_dir), "--device", a.device, *common, "--served-model-name", "gpu-check",
                               "--async-scheduling" if a.async_scheduling else "--no-async-scheduling",
                               "--restart-policy", "never", "--shutdown-timeout", "5", "--log-level", "info",
                               *(["--threads", str(a.threads)] if a.threads else [])], tmp / "serve.log")
                log(f"mesh: {' '.join(serve.cmd[2:])}")
                log(f"mesh: healthy after {serve.start(a.startup_timeout):.1f} s (log {serve.log})")
                run_mesh(serve, "gpu-check", work, cfg["vocab_size"], a.request_timeout, mesh)
            except KeyboardInterrupt:
                raise
            except Exception as err:  # noqa: BLE001 - the other arm still runs; the error is printed
                outcome = failed_arm("mesh", err)
            finally:
                if serve is not None and serve.proc is not None:
                    t0 = time.monotonic()
                    serve.stop()
                    log(f"mesh: stopped in {time.monotonic() - t0:.1f} s")
        if not a.skip_inprocess:
            from stagemesh.entry.local_engine import LocalEngine

            try:
                t0 = time.monotonic()
                engine = LocalEngine.of(model_dir, device=a.device, dtype=a.dtype, block_size=16,
                                        kv_cache_memory=a.kv_cache_memory, max_num_seqs=a.max_num_seqs,
                                        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                                        async_scheduling=a.async_scheduling)
                log(f"in-process: LocalEngine ready in {time.monotonic() - t0:.1f} s")
                run_inprocess(engine, work, cfg["vocab_size"], a.request_timeout, local)
            except KeyboardInterrupt:
                raise
            except Exception as err:  # noqa: BLE001
                outcome = failed_arm("in-process", err)
    except KeyboardInterrupt as err:
        log(f"STOPPED: {type(err).__name__}: {err}; printing what was measured")
        outcome = 3
    except Exception as err:  # noqa: BLE001 - print what was measured, then the error
        outcome = failed_arm("setup", err)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one Ctrl-C stops the run, not its cleanup
        if serve is not None and serve.proc is not None:
            log("mesh: stopping the serve")
            serve.stop(grace=20)
        if engine is not None:
            signal.alarm(60)  # bounded too
            try:
                engine.close()
            except (KeyboardInterrupt, Exception) as err:  # noqa: BLE001 - after a failure it may fail too
                log(f"in-process: close failed: {err!r}")
            finally:
                signal.alarm(0)
        if serve is not None and (outcome or any(s.get("failed_requests") for s in mesh.values())):
            log(f"mesh: the serve's log ends:\n{serve.tail()}")
        if not a.model_dir:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"(work files in {tmp})")
    log("")
    log(report(env, a, cfg, work, weights, peak, mesh, local))
    log(f"\ngpu_check: {time.monotonic() - start:.1f} s in all")
    failed = any(s.get("failed_requests") for data in (mesh, local) for s in data.values())
    return outcome or (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
