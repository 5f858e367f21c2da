"""Run one pipeline step of one stage: StepBatch in, hidden states or sampled tokens out.

The runner keeps each sequence's block table (steps carry only new blocks), builds the stage's model slice from
its settings (stage_worker.settings, stage_worker.loading), runs it on each step's inputs (stage_worker.step_inputs)
and, on the last stage, computes the logits of the sequences to sample and samples them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from stagemesh.core.common_flags import skip_server_warmup
from stagemesh.core.errors import StagemeshError
from stagemesh.core.grammar import lazy_compiler
from stagemesh.core.kv_groups import kv_groups
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.step import PromptLogprobs, SampledToken, StepBatch
from stage_worker import prompt_logprobs
from stage_worker.layers import pack_weights_for_cpu
from stage_worker.loading import check_layer_range, load_checkpoint, resolve_dtype
from stage_worker.lora import LoRAManager, LoRASettings
from stage_worker.kv_cache import (allocate_kv_cache, check_kv_cache_device, check_kv_cache_dtype, kv_bytes_per_block,
                                   resolve_kv_cache_dtype)
from stage_worker.kv_scales import CheckpointScales, KVScales, stage_scales
from stage_worker.model import Attention, AttentionMetadata, build as build_stage_model
from stage_worker.activations import choose_activations
from stage_worker.quantization import check_quantization
from stage_worker.context import check_context_parallel
from stage_worker.parallel import HeadShard, stage_groups
from stage_worker import pooler as pooling_runner
from stage_worker.sampler import Sampler
from stage_worker.settings import StageSettings
from stage_worker.step_inputs import step_inputs

if TYPE_CHECKING:
    from stage_worker.cuda_graphs import DecodeGraphs
    from stage_worker.eplb import EPLBConfig

# StageRunner's parameters that are not settings (StageRunner.of)
RUNTIME = ("tp_rank", "tp_group", "shard_group", "ep", "config", "load", "max_graph_batch")


@dataclass
class StageOutput:
    hidden_states: torch.Tensor | None = None  # non-last stages: [num_tokens, hidden]
    sampled: list[SampledToken] = field(default_factory=list)  # last stage, TP rank 0
    logits: torch.Tensor | None = None  # [num_sampled, vocab] fp32, when asked
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # last stage, TP rank 0
    drafts: dict[int, list[int]] = field(default_factory=dict)  # a draft model's proposals (last stage, rank 0)


def eplb_of(settings: StageSettings, cfg: ModelConfig) -> EPLBConfig | None:
    """--enable-eplb's balancing (--eplb-config), the same on every rank (the stage's CLI checked it)."""
    if not settings.enable_eplb:
        return None
    from stage_worker.eplb import EPLBConfig

    return EPLBConfig.parse(settings.eplb_config, cfg.num_experts, settings.tensor_parallel_size)


class StageRunner:
    def __init__(self, settings: StageSettings, *, tp_rank: int = 0, tp_group=None, shard_group=None, ep=None,
                 config: ModelConfig | None = None, load: bool = True, max_graph_batch: int = 256):
        """The slice `settings` say, as TP rank `tp_rank` of the stage; `tp_group` / `shard_group`: its process
        groups (stage_worker.parallel), `ep`: its stage_worker.ep_group.EPGroup when its experts are spread over
        the replicas; `config`: the model's, already read (settings.model is None only then, with load=False)."""
        s = self.settings = settings
        self.config = cfg = config or ModelConfig.from_path(s.model_dir)  # type: ignore[arg-type]
        tp_size, device = s.tensor_parallel_size, f"cuda:{tp_rank}" if s.device == "cuda" else s.device
        check_layer_range(cfg, s.layer_start, s.layer_end)
        cfg.check_tp_size(tp_size)
        check_context_parallel(cfg, tp_size, s.decode_context_parallel_size, s.prefill_context_parallel_size,
                               s.block_size, s.enable_expert_parallel, s.lora.enable_lora)
        # the stage's group (its processes: `tp_rank` is this one's place) and the group its weights are sharded over
        self.tp, shard = stage_groups(tp_rank, tp_size, s.decode_context_parallel_size,
                                      s.prefill_context_parallel_size, tp_group, shard_group)
        if s.enable_expert_parallel:
            cfg.check_expert_parallel(tp_size)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(cfg, s.dtype, device)
        check_kv_cache_dtype(s.kv_cache_dtype, cfg)
        check_kv_cache_device(s.kv_cache_dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(s.kv_cache_dtype, self.dtype)  # the cache's torch dtype
        self.block_size = s.block_size  # the scheduler's blocks
        # the tokens of a block this rank keeps (stage_worker.context)
        self.kv_block_size = s.block_size // self.tp.cp_size
        quantization = s.quantization or ("gguf" if s.gguf_file is not None else None)
        self.quant_method = check_quantization(quantization, cfg, self.device)
        self.quantization = quantization or (self.quant_method.name if self.quant_method else None)
        self.eplb = eplb_of(s, cfg)
        self.model = build_stage_model(cfg, s.layer_start, s.layer_end, shard, self.dtype, self.device,
                                       expert_parallel=s.enable_expert_parallel, ep=ep, eplb=self.eplb,
                                       cp=self.tp if self.tp.cp_size > 1 else None)
        self.model_dir, self.gguf_file = s.model_dir, s.gguf_file
        lora = LoRASettings.from_args(s.lora)
        self._attach_pooler(s, cfg, lora)
        # adapters per sequence (multi-LoRA): its linears become LoRALinear before the weights load
        self.lora = LoRAManager(self.model, cfg, lora, self.dtype, self.device) if lora is not None else None
        self.seq_adapters: dict[int, str] = {}  # sequences that use an adapter: its name
        self.activations: str | None = None  # --quantization-activations as it runs (stage_worker.activations)
        found = None  # the checkpoint's KV cache scales
        if load:
            found = load_checkpoint(self.model, s, quantization, cfg, self.quant_method)
            self.activations = choose_activations(self.model, s.quantization_activations, self.quantization,
                                                  self.device)
        if self.device.type == "cpu":
            pack_weights_for_cpu(self.model, warm=not skip_server_warmup(s.skip_server_warmup))
        if self.lora is not None and load:
            self.lora.check_adapters()
        self._set_kv_layout(s, found)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}  # tokens of each sequence whose KV the steps so far compute
        # drafts of each sequence's last chunk: its next chunk may start that much earlier (those rejected)
        self.num_drafts: dict[int, int] = {}
        grammars = lazy_compiler(s.model_dir, cfg.vocab_size, list(cfg.eos_token_ids)) if s.model_dir else None
        self.sampler = Sampler(self.device, cfg.eos_token_ids, grammars) \
            if self.is_last_stage and self.pooler is None else None
        if self.sampler is not None and self.tp.rank == 0:  # (the rank that samples)
            self.sampler.warm()
        # decode steps replay CUDA graphs (TP=1 on CUDA; TP>1 and CPU run eagerly: see stage_worker/cuda_graphs.py)
        # (not with MLA, whose step plan reads the batch's layout on the host: stage_worker.mla)
        self.use_cuda_graphs = (not s.enforce_eager and self.device.type == "cuda" and tp_size == 1 and ep is None
                                and self.lora is None and self.pooler is None  # (never DCP: its TP size is > 1)
                                and self.model.cuda_graphs and cfg.family.attention == "mha")
        self.max_graph_batch = max_graph_batch
        self.graphs: DecodeGraphs | None = None
        self.graph_scales: list[tuple[float, float]] = []  # the KV scales the graphs were captured with
        self.drafter = None  # stage_worker.draft.DraftModel: a draft model on the last stage's TP rank 0

    @classmethod
    def of(cls, model: Any, start: int, end: int, **kw: Any) -> StageRunner:
        """A runner from keyword flags (StageSettings.of) and the parameters that are not settings (RUNTIME):
        tests', benchmarks' and the in-process engine's."""
        runtime = {k: kw.pop(k) for k in list(kw) if k in RUNTIME}
        return cls(StageSettings.of(model, start, end, **kw), **runtime)

    def _attach_pooler(self, s: StageSettings, cfg: ModelConfig, lora: LoRASettings | None) -> None:
        """--runner pooling: the last stage pools its prompts instead of sampling (no LM head, no sampler)."""
        pooling = s.pooling.resolve(s.model_dir, cfg.raw)
        if pooling is not None and lora is not None:
            raise StagemeshError("--enable-lora does not run with --runner pooling yet")
        self.pooler = None if pooling is None else pooling_runner.attach(self.model, pooling, s.model_dir,
                                                                         self.dtype, self.device)
        self.pooling_tasks = pooling.tasks if pooling is not None else ()  # (every stage says them: describe)

    def _set_kv_layout(self, s: StageSettings, found: CheckpointScales | None) -> None:
        """This rank's KV heads, its KV cache groups (each layer's slot in a block), its bytes per block, and each
        layer's KV cache scales (`found`: the checkpoint's)."""
        layers = s.layer_end - s.layer_start
        self.kv_groups = kv_groups(self.config, s.disable_hybrid_kv_cache_manager)
        self.kv_slots = self.kv_groups.slots(s.layer_start, s.layer_end)
        self.model.kv_groups = self.kv_groups.layer_group[s.layer_start:s.layer_end]
        # the tables of the groups after the first (each sequence's), which steps grow as they grow the first's
        self.group_tables: list[dict[int, list[int]]] = [{} for _ in self.kv_groups.windows[1:]]
        self.num_kv_heads = HeadShard.for_rank(self.config, self.tp).num_kv_heads
        self.kv_bytes_per_block = kv_bytes_per_block(self.kv_groups.num_slots(s.layer_start, s.layer_end),
                                                     self.num_kv_heads, self.config.head_dim, self.kv_block_size,
                                                     self.kv_cache_dtype)
        self.kv_scales: KVScales = stage_scales(layers, found, s.kv_cache_dtype, s.calculate_kv_scales,
                                                s.layer_start, self.tp)
        for layer, scale in zip(self.model.layers, self.kv_scales.layers):
            attention = getattr(layer, "self_attn", None)
            if isinstance(attention, Attention):  # (MLA's latent cache is not built in fp8: check_kv_cache_dtype)
                attention.kv_scale = scale

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
        if self.kv_groups.hybrid:
            raise StagemeshError("speculative decoding with a draft model does not run with the hybrid KV cache "
                                 "manager yet (the draft mirrors one block table): start the stages with "
                                 "--disable-hybrid-kv-cache-manager (serve does so with a draft model)")
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
                                           self.config.head_dim, self.kv_cache_dtype, self.device, self.kv_slots)
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
        for tables in self.group_tables:
            tables.clear()
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
        input_ids, meta, sample_rows, sample_ids, drafts = step_inputs(
            batch, self.block_tables, self.block_size, self.device, self.tp, self.is_first_stage, self.group_tables)
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
            for tables in self.group_tables:
                tables.pop(seq_id, None)
            self.seq_adapters.pop(seq_id, None)
            self.seq_lens.pop(seq_id, None)
            self.num_drafts.pop(seq_id, None)
            if self.sampler is not None:
                self.sampler.remove_sequence(seq_id)
            if self.drafter is not None:
                self.drafter.forget(seq_id)
        for seq in batch.new_sequences:
            self.block_tables[seq.seq_id] = []
            for tables in self.group_tables:
                tables[seq.seq_id] = []
            if seq.lora_name:
                self.seq_adapters[seq.seq_id] = seq.lora_name
            if self.sampler is not None:
                self.sampler.add_sequence(seq)
        c, tables, lens, b = batch.chunks, self.block_tables, self.seq_lens, 0
        for seq_id, n, start, count, d in zip(c.seq_ids, c.num_tokens, c.start_positions, c.num_new_blocks,
                                              c.draft_counts()):
            lens[seq_id] = start + n
            self.num_drafts[seq_id] = d
            if count:  # (with groups: each group's blocks in turn, as many for each)
                each = count // (len(self.group_tables) + 1)
                tables[seq_id].extend(c.new_block_ids[b:b + each])
                for g, group in enumerate(self.group_tables, 1):
                    group[seq_id].extend(c.new_block_ids[b + g * each:b + (g + 1) * each])
                b += count
