"""Run one pipeline step of one stage: StepBatch in, hidden states or sampled tokens out.

The runner keeps each sequence's block table (steps carry only new blocks),
builds the attention metadata, runs the model slice and, on the last stage,
computes the logits of the sequences to sample and samples them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.grammar import lazy_compiler
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.common_flags import PoolingOptions
from stagemesh.core.pooling import PoolerConfig
from stagemesh.core.step import PromptLogprobs, SampledToken, StepBatch
from stage_worker import prompt_logprobs
from kernels import cpu_ops
from stage_worker.layers import pack_weights_for_cpu
from stage_worker.lora import LoRAManager, LoRASettings
from stage_worker.kv_cache import (allocate_kv_cache, check_kv_cache_device, check_kv_cache_dtype, kv_bytes_per_block,
                                   resolve_kv_cache_dtype)
from stage_worker.kv_scales import CheckpointScales, KVScales, read_checkpoint_scales, stage_scales
from stage_worker.gguf import GGUFCheckpoint
from stage_worker.model import Attention, AttentionMetadata, StageModel, build as build_stage_model
from stage_worker.activations import choose_activations
from stage_worker.coverage import check_all_read
from stage_worker.quantization import check_quantization, load_gguf, quantize_at_load
from stage_worker.quant_methods.loader import load_quantised
from stage_worker.quant_methods.method import QuantMethod
from stage_worker.context import check_context_parallel, share_step
from stage_worker.parallel import HeadShard, stage_groups
from stage_worker import pooler as pooling_runner
from stage_worker.sampler import Sampler
from stage_worker.weights import CheckpointReader, load_weights

if TYPE_CHECKING:
    from stage_worker.cuda_graphs import DecodeGraphs
    from stage_worker.eplb import EPLBConfig


@dataclass
class StageOutput:
    hidden_states: torch.Tensor | None = None  # non-last stages: [num_tokens, hidden]
    sampled: list[SampledToken] = field(default_factory=list)  # last stage, TP rank 0
    logits: torch.Tensor | None = None  # [num_sampled, vocab] fp32, when asked
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # last stage, TP rank 0
    drafts: dict[int, list[int]] = field(default_factory=dict)  # a draft model's proposals (last stage, rank 0)


def check_layer_range(cfg: ModelConfig, layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start < layer_end <= cfg.num_hidden_layers:
        raise StagemeshError(
            f"layer range {layer_start}:{layer_end} is outside the model's {cfg.num_hidden_layers} layers "
            f"(use A:B with 0 <= A < B <= {cfg.num_hidden_layers})"
        )


def _cpu_auto_dtype(checkpoint_dtype: str) -> str:
    """bf16 for a bf16 or fp16 checkpoint where the CPU kernels are built (their bf16 path is faster than
    fp32, stage_worker/cpu_isa.py); fp32 otherwise (an fp32 checkpoint is never narrowed unasked)."""
    if checkpoint_dtype in ("bfloat16", "float16") and cpu_ops.load() is not None:
        return "bfloat16"
    return "float32"


def resolve_dtype(cfg: ModelConfig, dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or "auto"
    if name == "auto":  # vLLM's rule: the checkpoint's dtype; on CPU fp16 runs as bf16
        name = cfg.torch_dtype if str(device).startswith("cuda") else _cpu_auto_dtype(cfg.torch_dtype)
    aliases = {"float": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
    name = aliases.get(name, name)
    if name not in ("float32", "float16", "bfloat16"):
        raise StagemeshError(f"--dtype {dtype} is not supported (auto, float32, float16, bfloat16)")
    return getattr(torch, name)


def _load(model: StageModel, model_dir, quantization: str | None, gguf_file: str | None, cfg: ModelConfig,
          method: QuantMethod | None) -> CheckpointScales | None:
    """`method`: the checkpoint's own quantization (stage_worker.quant_methods); else `quantization` quantises
    an unquantised checkpoint at load (or names a GGUF's). Returns the KV cache scales the checkpoint holds for
    the stage's layers (stage_worker.kv_scales, every one checked; a GGUF has none)."""
    if quantization == "gguf":
        if gguf_file is None:
            raise StagemeshError("--quantization gguf needs a .gguf file as the model")
        load_gguf(model, GGUFCheckpoint(gguf_file, cfg))
        return None
    reader = CheckpointReader(model_dir)
    filled = load_quantised(model, method, reader) if method is not None else frozenset()
    load_weights(model, reader, filled)
    scales = read_checkpoint_scales(reader, cfg, model.layer_start, model.layer_end)  # (read before the check)
    check_all_read(reader.files, reader.read, model)
    if quantization is not None and method is None:
        quantize_at_load(model, quantization)
    return scales


@dataclass(frozen=True)
class SliceConfig:
    """The model slice a stage runs, as every TP rank of it (rank 0 and its followers) builds it."""
    model_dir: str
    layer_start: int
    layer_end: int
    tp_size: int = 1
    device: str = "cpu"  # "cuda": rank t takes cuda:t
    dtype: str | None = None
    block_size: int = 16
    dcp_size: int = 1  # --decode-context-parallel-size (stage_worker.context)
    pcp_size: int = 1  # --prefill-context-parallel-size (stage_worker.context.TokenSplit)
    cuda_graphs: bool = True
    expert_parallel: bool = False  # whole experts spread over the TP ranks (stage_worker.moe)
    eplb: EPLBConfig | None = None  # the experts' load balanced, with redundant copies
    quantization: str | None = None  # stage_worker.quantization.METHODS
    quantization_activations: str | None = None  # --quantization-activations (stage_worker.activations)
    gguf_file: str | None = None  # the weights (quantization gguf); model_dir then gives config and tokenizer
    lora: LoRASettings | None = None  # --enable-lora: the adapters it may serve (stage_worker.lora)
    pooling: PoolingOptions | None = None  # --runner, --convert, --pooler-config (stage_worker.pooler)
    kv_cache_dtype: str | None = None  # --kv-cache-dtype (None: auto, the model's dtype)
    calculate_kv_scales: bool = False  # an fp8 cache's scales from the first forward (stage_worker.kv_scales)

    @property
    def ranks(self) -> int:
        """The stage's processes: its TP ranks, times its PCP ranks."""
        return self.tp_size * self.pcp_size

    def runner(self, tp_rank: int, ep=None) -> "StageRunner":
        """`ep`: the stage's stage_worker.ep_group.EPGroup when its experts are spread over the replicas."""
        device = f"cuda:{tp_rank}" if self.device == "cuda" else self.device
        return StageRunner(self.model_dir, self.layer_start, self.layer_end, tp_rank=tp_rank, tp_size=self.tp_size,
                           device=device, dtype=self.dtype, block_size=self.block_size, dcp_size=self.dcp_size,
                           pcp_size=self.pcp_size, cuda_graphs=self.cuda_graphs,
                           expert_parallel=self.expert_parallel, ep=ep, eplb=self.eplb, quantization=self.quantization,
                           gguf_file=self.gguf_file, lora=self.lora,
                           quantization_activations=self.quantization_activations, pooling=self.pooler_config(),
                           kv_cache_dtype=self.kv_cache_dtype, calculate_kv_scales=self.calculate_kv_scales)

    def pooler_config(self) -> PoolerConfig | None:
        """What the pooling flags make of the model (None: it generates)."""
        if self.pooling is None:
            return None
        return self.pooling.resolve(self.model_dir, ModelConfig.from_path(self.model_dir).raw)


class StageRunner:
    def __init__(self, model_dir: str | Path | None, layer_start: int, layer_end: int, *, tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None, device: str = "cpu", dtype: torch.dtype | str | None = None,
                 block_size: int = 16, dcp_size: int = 1, pcp_size: int = 1, shard_group=None, load: bool = True,
                 config: ModelConfig | None = None,
                 cuda_graphs: bool = True, max_graph_batch: int = 256, expert_parallel: bool = False, ep=None,
                 eplb=None, quantization: str | None = None, gguf_file: str | None = None,
                 lora: LoRASettings | None = None, quantization_activations: str | None = None,
                 pooling: PoolerConfig | None = None, kv_cache_dtype: str | None = None,
                 calculate_kv_scales: bool = False):
        # (model_dir is None only where a config is given: runners made without weights, load=False)
        self.config = cfg = config or ModelConfig.from_path(model_dir)  # type: ignore[arg-type]
        check_layer_range(cfg, layer_start, layer_end)
        cfg.check_tp_size(tp_size)
        check_context_parallel(cfg, tp_size, dcp_size, pcp_size, block_size, expert_parallel, lora is not None)
        # the stage's group (its processes: `tp_rank` is this one's place) and the group its weights are sharded over
        self.tp, shard = stage_groups(tp_rank, tp_size, dcp_size, pcp_size, tp_group, shard_group)
        if expert_parallel:
            cfg.check_expert_parallel(tp_size)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(cfg, dtype, device)
        check_kv_cache_dtype(kv_cache_dtype, cfg)
        check_kv_cache_device(kv_cache_dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)  # the cache's torch dtype
        self.block_size = block_size  # the scheduler's blocks
        # the tokens of a block this rank keeps (stage_worker.context)
        self.kv_block_size = block_size // self.tp.cp_size
        if gguf_file is not None:
            quantization = quantization or "gguf"
        self.quant_method = check_quantization(quantization, cfg, self.device)
        self.quantization = quantization or (self.quant_method.name if self.quant_method else None)
        self.model = build_stage_model(cfg, layer_start, layer_end, shard, self.dtype, self.device,
                                expert_parallel=expert_parallel, ep=ep, eplb=eplb,
                                cp=self.tp if self.tp.cp_size > 1 else None)
        self.model_dir, self.gguf_file = model_dir, gguf_file
        if pooling is not None and lora is not None:
            raise StagemeshError("--enable-lora does not run with --runner pooling yet")
        # --runner pooling: the last stage pools its prompts instead of sampling (no LM head, no sampler)
        self.pooler = None if pooling is None else pooling_runner.attach(self.model, pooling, model_dir, self.dtype,
                                                                         self.device)
        self.pooling_tasks = pooling.tasks if pooling is not None else ()  # (every stage says them: describe)
        # adapters per sequence (multi-LoRA): its linears become LoRALinear before the weights load
        self.lora = LoRAManager(self.model, cfg, lora, self.dtype, self.device) if lora is not None else None
        self.seq_adapters: dict[int, str] = {}  # sequences that use an adapter: its name
        self.activations: str | None = None  # --quantization-activations as it runs (stage_worker.activations)
        found = None  # the checkpoint's KV cache scales
        if load:
            found = _load(self.model, model_dir, quantization, gguf_file, cfg, self.quant_method)
            self.activations = choose_activations(self.model, quantization_activations, self.quantization,
                                                  self.device)
        if self.device.type == "cpu":
            pack_weights_for_cpu(self.model)
        if self.lora is not None and load:
            self.lora.check_adapters()
        self.num_kv_heads = HeadShard.for_rank(cfg, self.tp).num_kv_heads
        self.kv_bytes_per_block = kv_bytes_per_block(layer_end - layer_start, self.num_kv_heads, cfg.head_dim,
                                                     self.kv_block_size, self.kv_cache_dtype)
        self.kv_scales: KVScales = stage_scales(layer_end - layer_start, found, kv_cache_dtype, calculate_kv_scales,
                                                layer_start, self.tp)
        for layer, scale in zip(self.model.layers, self.kv_scales.layers):
            attention = getattr(layer, "self_attn", None)
            if isinstance(attention, Attention):  # (MLA's latent cache is not built in fp8: check_kv_cache_dtype)
                attention.kv_scale = scale
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}  # tokens of each sequence whose KV the steps so far compute
        # drafts of each sequence's last chunk: its next chunk may start that much earlier (those rejected)
        self.num_drafts: dict[int, int] = {}
        grammars = lazy_compiler(model_dir, cfg.vocab_size, list(cfg.eos_token_ids)) if model_dir else None
        self.sampler = Sampler(self.device, cfg.eos_token_ids, grammars) \
            if self.is_last_stage and pooling is None else None
        if self.sampler is not None and self.tp.rank == 0:  # (the rank that samples)
            self.sampler.warm()
        # decode steps replay CUDA graphs (TP=1 on CUDA; TP>1 and CPU run eagerly: see stage_worker/cuda_graphs.py)
        # (not with MLA, whose step plan reads the batch's layout on the host: stage_worker.mla)
        self.use_cuda_graphs = (cuda_graphs and self.device.type == "cuda" and tp_size == 1 and ep is None
                                and self.lora is None and pooling is None  # (never DCP: its TP size is > 1)
                                and self.model.cuda_graphs and cfg.family.attention == "mha")
        self.max_graph_batch = max_graph_batch
        self.graphs: DecodeGraphs | None = None
        self.graph_scales: list[tuple[float, float]] = []  # the KV scales the graphs were captured with
        self.drafter = None  # stage_worker.draft.DraftModel: a draft model on the last stage's TP rank 0

    def attach_drafter(self, drafter) -> None:
        """Speculative decoding with a draft model: it mirrors this stage's KV cache (its blocks count in
        kv_bytes_per_block) and proposes drafts after each step's sampling."""
        if self.lora is not None or self.pooler is not None:
            flag = "--enable-lora" if self.lora is not None else "--runner pooling"
            raise StagemeshError(f"speculative decoding with a draft model does not run with {flag} yet")
        if self.kv_cache_dtype != self.dtype:
            raise StagemeshError("speculative decoding with a draft model does not run with an fp8 KV cache yet "
                                 "(--kv-cache-dtype fp8; ngram speculation does)")
        if self.tp.cp_size > 1:
            flag = "--prefill-context-parallel-size" if self.tp.pcp else "--decode-context-parallel-size"
            raise StagemeshError(f"speculative decoding with a draft model does not run with {flag} yet "
                                 "(ngram speculation does)")
        self.drafter = drafter
        self.kv_bytes_per_block += drafter.kv_bytes_per_block

    @property
    def is_first_stage(self) -> bool:
        return self.model.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.model.is_last

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.graphs = None
        self.kv_caches = allocate_kv_cache(len(self.model.layers), num_blocks, self.kv_block_size, self.num_kv_heads,
                                           self.config.head_dim, self.kv_cache_dtype, self.device)
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)
        self.capture_graphs()

    def capture_graphs(self) -> None:
        """The decode steps' CUDA graphs (where they run), captured again when an fp8 cache's scales change
        (--calculate-kv-scales, or taken from blocks brought in): a graph replays the scales it was captured with."""
        if self.use_cuda_graphs and self.kv_caches:
            from stage_worker.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.kv_caches[0][0].shape[0], self.block_size,
                                       self.max_graph_batch)
            self.graph_scales = self.kv_scales.values()

    def reset(self, num_kv_blocks: int) -> None:
        """A new pipeline epoch: forget every sequence; (re)allocate the cache if its size changed."""
        self.block_tables.clear()
        self.seq_adapters.clear()
        self.seq_lens.clear()
        self.num_drafts.clear()
        if self.sampler is not None:
            self.sampler.seqs.clear()
        if self.drafter is not None:
            self.drafter.proposals.clear()
        if self.pooler is not None:
            self.pooler.reset()
        if not self.kv_caches or self.kv_caches[0][0].shape[0] != num_kv_blocks:
            self.kv_caches = []
            self.allocate_kv_cache(num_kv_blocks)

    @torch.inference_mode()
    def execute(self, batch: StepBatch, hidden_states: torch.Tensor | None = None,
                return_logits: bool = False) -> StageOutput:
        self._update_state(batch)
        if self.pooler is not None:
            self.pooler.update(batch)
        if not batch.chunks:
            return StageOutput()
        input_ids, meta, sample_rows, sample_ids, drafts = self._prepare(batch)
        if self.lora is not None:
            self.lora.prepare([self.seq_adapters.get(s, "") for s in batch.chunks.seq_ids], batch.chunks.num_tokens)
        if self.graphs is not None and self.graph_scales != self.kv_scales.values():
            self.capture_graphs()
        graphs, num_tokens = self.graphs, meta.positions.shape[0]
        scored: list = prompt_logprobs.pieces_of(batch, self.sampler.seqs) if self.sampler is not None else []
        logits: torch.Tensor | None
        calibrating = self.kv_scales.pending  # this forward calculates them (--calculate-kv-scales)
        if not scored and not calibrating and graphs is not None and \
                graphs.can_run(len(batch.chunks), num_tokens, meta.block_tables.shape[1]):
            out = graphs.run(input_ids, hidden_states, meta)  # the next replay reuses this buffer: copy what is kept
            self._mirror(batch, meta, None)
            if not self.is_last_stage:
                return StageOutput(hidden_states=out.clone())
            logits = out if len(sample_rows) == num_tokens else out[sample_rows]
            if return_logits:
                logits = logits.clone()
        else:
            self.kv_scales.arm()
            hidden = self._forward(input_ids, hidden_states, meta)
            if calibrating:
                self.kv_scales.settle()
            self._mirror(batch, meta, hidden)
            if not self.is_last_stage:
                return StageOutput(hidden_states=hidden)
            if self.pooler is not None:  # (rank 0 keeps the pools, as it keeps sampled tokens)
                return StageOutput(sampled=self.pooler.pool(batch, hidden) if self.tp.rank == 0 else [])
            # every TP rank takes part (the LM head all-gathers); rank 0 keeps the results. With PCP only the TP group
            # of rank 0's place: the others would compute the same logits for nothing
            if self.tp.pcp and self.tp.cp_rank:
                sample_rows, scored = [], []
            logits = self.model.compute_logits(hidden[sample_rows]) if sample_rows else None
            if scored:
                scored = prompt_logprobs.compute(scored, hidden, self.model.compute_logits, self.tp.rank == 0)
        if not sample_rows:
            self._propose([])  # (an MTP layer reads the step's hidden states all the same: stage_worker.mtp)
            return StageOutput(prompt_logprobs=scored)
        sampled: list[SampledToken] = []
        if self.tp.rank == 0:
            assert self.sampler is not None and logits is not None  # (the last stage, with rows to sample)
            probs = self.drafter.probs_for(sample_ids, drafts) if self.drafter is not None else None
            sampled = self.sampler.sample(logits, sample_ids, drafts, probs)
        proposed = self._propose(sampled)
        return StageOutput(sampled=sampled, logits=logits if return_logits else None, prompt_logprobs=scored,
                           drafts=proposed)

    def _forward(self, input_ids: torch.Tensor | None, hidden_states: torch.Tensor | None,
                 meta: AttentionMetadata) -> torch.Tensor:
        split = meta.split
        if split is None:
            return self.model(input_ids, hidden_states, meta, self.kv_caches)
        # prefill context parallelism: this rank's rows through the layers, every rank's gathered after them
        mine = self.model(input_ids, None if hidden_states is None else split.rows(hidden_states), meta,
                          self.kv_caches)
        return split.gather(mine, self.tp)

    def _mirror(self, batch: StepBatch, meta: AttentionMetadata, hidden: torch.Tensor | None) -> None:
        if self.drafter is not None and self.tp.rank == 0:
            self.drafter.mirror(batch.chunks, meta, hidden)

    def _propose(self, sampled: list[SampledToken]) -> dict[int, list[int]]:
        """The drafter's next drafts for the sequences this step sampled (not those whose row failed): every step."""
        if self.drafter is None:
            return {}
        last = {t.seq_id: t for t in sampled}  # each sequence's last token
        seq_ids = [seq_id for seq_id, t in last.items() if t.error is None]
        return self.drafter.propose(self.sampler.seqs, seq_ids, self.block_tables, self.config.eos_token_ids)

    def _update_state(self, batch: StepBatch) -> None:
        for seq_id in batch.finished_seq_ids:
            self.block_tables.pop(seq_id, None)
            self.seq_adapters.pop(seq_id, None)
            self.seq_lens.pop(seq_id, None)
            self.num_drafts.pop(seq_id, None)
            if self.sampler is not None:
                self.sampler.remove_sequence(seq_id)
            if self.drafter is not None:
                self.drafter.forget(seq_id)
        for seq in batch.new_sequences:
            self.block_tables[seq.seq_id] = []
            if seq.lora_name:
                self.seq_adapters[seq.seq_id] = seq.lora_name
            if self.sampler is not None:
                self.sampler.add_sequence(seq)
        c, tables, lens, b = batch.chunks, self.block_tables, self.seq_lens, 0
        for seq_id, n, start, count, d in zip(c.seq_ids, c.num_tokens, c.start_positions, c.num_new_blocks,
                                              c.draft_counts()):
            lens[seq_id] = start + n
            self.num_drafts[seq_id] = d
            if count:
                tables[seq_id].extend(c.new_block_ids[b:b + count])
                b += count

    def _prepare(self, batch: StepBatch):
        bs, c = self.block_size, batch.chunks
        positions: list[int]
        slots: list[int]
        sample_rows: list[int]
        positions, slots, context_lens, starts = [], [], [], [0]
        sample_rows, sample_ids, drafts = [], [], []
        tables = [self.block_tables[s] for s in c.seq_ids]
        for seq_id, table, n, p0, sample, d in zip(c.seq_ids, tables, c.num_tokens, c.start_positions, c.sample,
                                                   c.draft_counts()):
            pos = range(p0, p0 + n)  # covered by the sequence's blocks (validate.check_state, for steps from outside)
            positions.extend(pos)
            if self.tp.cp_size == 1:  # (a context-parallel rank's slots are its share's: stage_worker.context)
                slots.extend(table[p // bs] * bs + p % bs for p in pos)
            context_lens.append(p0 + n)
            starts.append(starts[-1] + n)
            if sample:  # the logits of the chunk's last token, and of each draft (verified against them)
                sample_rows.extend(range(starts[-1] - 1 - d, starts[-1]))
                sample_ids.append(seq_id)
                drafts.append(c.token_ids[starts[-1] - d:starts[-1]])
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        )
        input_ids = torch.tensor(c.token_ids, dtype=torch.int64, device=dev) if self.is_first_stage else None
        if self.tp.cp_size > 1:  # this rank's share of the tokens (its slots: there, not slot_mapping's)
            input_ids = share_step(meta, input_ids, c.num_tokens, bs, self.tp)
        return input_ids, meta, sample_rows, sample_ids, drafts
