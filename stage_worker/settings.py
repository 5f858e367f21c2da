"""What a stage's model slice runs with (StageSettings): the flags of `stagemesh stage` that every TP rank of the
stage reads, declared here once (stagemesh.core.flags; stage_worker.options.StageOptions nests them), built once
when the stage starts and handed whole to every rank of it: rank 0's StageRunner, and each follower over its pipe
as JSON (stage_worker.follower). A field is named as its flag, so adding a stage setting is its field here, its
use, and its test.

Five fields are not flags of this group but what the stage's other flags resolve to: `model`, `tokenizer`,
`quantization` and `quantization_activations` are the model's source (stagemesh.core.model_source: the embedded
model found, a GGUF's config directory named), and `layers` is --layers, or the stage's share of
--pipeline-parallel-size's split, as (start, end).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from stagemesh.core.common_flags import BLOCK_SIZE, KV_CACHE_DTYPE, SKIP_SERVER_WARMUP, LoRAOptions, PoolingOptions
from stagemesh.core.flags import GROUP, Flag, from_args, group

RESOLVED = ("model", "tokenizer", "quantization", "quantization_activations", "layers")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class StageSettings:
    model: str | None = None  # MODEL: the model directory, or a .gguf file (then `tokenizer` is the directory)
    layers: tuple[int, int] = (0, 0)  # [start, end)
    tokenizer: str | None = None
    quantization: str | None = None  # stage_worker.quantization.METHODS
    quantization_activations: str | None = None  # stage_worker.activations
    tensor_parallel_size: int = Flag(("--tensor-parallel-size", "-tp"), type=int, default=1).field()
    decode_context_parallel_size: int = Flag(("--decode-context-parallel-size", "-dcp"), type=int, default=1, help=(
        "vLLM's DCP: each group of this many TP ranks holds the same KV heads (sharded as if TP were tp / dcp) and "
        "each a share of every sequence's tokens, so a replica holds dcp times the tokens where TP alone would "
        "replicate KV heads (TP > KV heads); must divide --tensor-parallel-size and --block-size "
        "(docs/context-parallelism.md)")).field()
    prefill_context_parallel_size: int = Flag(("--prefill-context-parallel-size", "-pcp"), type=int, default=1, help=(
        "vLLM's PCP: the stage runs as tp x pcp processes, each PCP group of pcp ranks holding the stage's weights "
        "(TP-sharded over the groups) and each rank computing the tokens whose KV it keeps (block_size / pcp of "
        "every block), so a long prompt's prefill is split over them and a sequence's KV too; must divide "
        "--block-size (docs/context-parallelism.md)")).field()
    device: str = Flag(("--device",), default="cpu", choices=("cpu", "cuda")).field()  # cuda: rank t on cuda:t
    block_size: int = BLOCK_SIZE.field()
    kv_cache_dtype: str = KV_CACHE_DTYPE.field()
    calculate_kv_scales: bool = Flag(("--calculate-kv-scales",), kind="switch", help=(
        "vLLM's: with --kv-cache-dtype fp8, each layer's k_scale and v_scale from the first forward's keys and values "
        "(max|K| / 200, max|V| / 100, over the stage's ranks), in place of the checkpoint's or 1.0")).field()
    dtype: str | None = Flag(("--dtype",), help="auto, float32, bfloat16, float16").field()
    enforce_eager: bool = Flag(("--enforce-eager",), kind="switch",
                               help="no CUDA graphs for decode steps (as vLLM)").field()
    disable_hybrid_kv_cache_manager: bool = Flag(("--disable-hybrid-kv-cache-manager",), kind="switch", help=(
        "vLLM's: a model with sliding-window layers (Gemma 3, gpt-oss) keeps every layer's KV for every position, "
        "the window only a mask; by default its layers are grouped and a sliding group's blocks out of the window "
        "go back to the pool (stagemesh.core.kv_groups). serve sets it with --kv-offloading-size, "
        "--prefill-replicas and a draft model, which do not carry the groups yet")).field()
    skip_server_warmup: bool | None = SKIP_SERVER_WARMUP.field()
    enable_expert_parallel: bool = Flag(("--enable-expert-parallel",), kind="switch", help=(
        "MoE models: whole experts spread over the stage's TP ranks (EP size = TP size) instead of every expert "
        "sharded over them; attention stays TP; with --data-parallel-size > 1 over the replicas' stages "
        "(data-parallel attention)")).field()
    enable_eplb: bool = Flag(("--enable-eplb",), kind="switch", help=(
        "with --enable-expert-parallel: balance the experts' load over the TP ranks (vLLM's EPLB): redundant copies "
        "of hot experts, re-placed every step_interval steps (stage_worker.eplb)")).field()
    eplb_config: str | None = Flag(("--eplb-config",), metavar="JSON", help=(
        'vLLM\'s EPLB settings: {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 0, '
        '"log_balancedness": false}')).field()
    load_format: str = Flag(("--load-format",), default="auto", choices=LOAD_FORMATS, help=(
        "vLLM's: how the weights are read. auto: the model's safetensors, or its .gguf file; safetensors, gguf: "
        "that format only (the other is refused); dummy: none read, every weight drawn uniform in [-1e-3, 1e-3] "
        "from a seed of its own (vLLM's), the same on every run, for benchmarks and profiling without a "
        "checkpoint: the model's config.json is all it needs")).field()
    threads: int = Flag(("--threads",), type=int, default=0,
                        help="torch threads per process (0: torch's default)").field()
    lora: LoRAOptions = group(LoRAOptions)  # stage_worker.lora
    pooling: PoolingOptions = group(PoolingOptions)  # stage_worker.pooler

    @classmethod
    def from_flags(cls, args: Any, source: Any, layers: tuple[int, int]) -> StageSettings:
        """The settings the parsed flags `args` give, with the model's resolved `source`
        (stagemesh.core.model_source.ModelSource) and the stage's `layers`."""
        gguf = source.gguf_file is not None
        return dataclasses.replace(
            from_args(cls, args), model=str(source.gguf_file if gguf else source.model_dir),
            tokenizer=str(source.model_dir) if gguf else None, quantization=source.quantization,
            quantization_activations=source.activations, layers=(layers[0], layers[1]))

    @classmethod
    def of(cls, model: Any, start: int, end: int, **flags: Any) -> StageSettings:
        """Settings from keyword flags (tests, benchmarks, the in-process engine), LoRA's and pooling's flat as on
        the command line; a torch dtype by its name; gguf_file=F: MODEL F with --tokenizer `model`, as the
        command line gives a GGUF's weights."""
        if flags.get("gguf_file") is not None:
            flags["tokenizer"], model = str(model), flags.pop("gguf_file")
        flags.pop("gguf_file", None)
        if flags.get("dtype") is not None:
            flags["dtype"] = str(flags["dtype"]).removeprefix("torch.")
        resolved = {k: flags.pop(k) for k in RESOLVED if k in flags}
        return dataclasses.replace(from_args(cls, None, **flags), model=None if model is None else str(model),
                                   layers=(start, end), **resolved)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON's data (a follower's start message: stage_worker.follower)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageSettings:
        data = dict(data)
        groups = {f.name: from_args(f.metadata[GROUP], None, **data.pop(f.name))
                  for f in dataclasses.fields(cls) if GROUP in f.metadata}
        resolved = {k: data.pop(k) for k in RESOLVED}
        return dataclasses.replace(from_args(cls, None, **data, **groups), **{**resolved,
                                                                            "layers": tuple(resolved["layers"])})

    @property
    def layer_start(self) -> int:
        return self.layers[0]

    @property
    def layer_end(self) -> int:
        return self.layers[1]

    @property
    def gguf_file(self) -> str | None:
        """The weights, where MODEL is a .gguf file."""
        return self.model if self.model is not None and self.model.endswith(".gguf") else None

    @property
    def model_dir(self) -> str | None:
        """The directory of the model's config.json and tokenizer (a GGUF's: --tokenizer)."""
        return self.tokenizer if self.gguf_file is not None else self.model

    @property
    def ranks(self) -> int:
        """The stage's processes: its TP ranks, times its PCP ranks."""
        return self.tensor_parallel_size * self.prefill_context_parallel_size
