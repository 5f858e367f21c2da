"""Which stages make up the replica's pipeline, and whether they fit together.

Stages register with their layer range; a stage whose range overlaps a
neighbour's or leaves a gap, that serves another model, or uses another block
size or handoff is refused with the reason. When the ranges tile the model,
the pipeline can form.

A stage started with --standby that registers for an index a live stage
already serves is kept as a spare for that index; when the serving stage
fails, the pipeline promotes a spare that answers (scheduler.grpc_pipeline).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.lora_table import LoRATable
from stagemesh.core.errors import StagemeshError
from stagemesh.core.kv_cache_dtype import canonical
from stagemesh.core.kv_groups import FULL


@dataclass(frozen=True)
class ModelIdentity:
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int


@dataclass(frozen=True)
class StageInfo:
    stage_index: int
    layer_start: int
    layer_end: int
    tp_size: int
    device: str
    num_kv_blocks: int
    block_size: int
    model: ModelIdentity
    address: str
    handoff: str
    instance_id: str = ""  # new at every start of the stage process
    standby: bool = False  # may be kept as a spare for its index
    num_speculative_tokens: int = 0  # drafts its draft model proposes per step (the last stage's), 0: none
    kv_bytes_per_block: int = 0  # one KV block of its layers over its TP ranks (sizes the KV tiers)
    kv_disk_tier: bool = False  # started with --kv-offloading-disk-path
    # --enable-lora: the adapters it serves (not part of the instance's identity: they change at run time)
    lora_adapters: tuple[str, ...] = field(default=(), compare=False)
    max_loras: int = 0  # ... and how many fit its slots at once
    pooling_tasks: tuple[str, ...] = ()  # --runner pooling: the tasks it serves (empty: it generates)
    kv_cache_dtype: str = "auto"  # its --kv-cache-dtype (stagemesh.core.kv_cache_dtype.canonical)
    kv_group_windows: tuple[int, ...] = (FULL,)  # its model's KV cache groups' windows (stagemesh.core.kv_groups)

    @property
    def name(self) -> str:
        return f"stage {self.stage_index} ({self.address}, layers {self.layer_start}:{self.layer_end})"


@dataclass(frozen=True)
class PipelinePlan:
    stages: list[StageInfo]
    world_size: int
    rank_offsets: list[int]
    tp_sizes: list[int]
    num_kv_blocks: int
    num_host_kv_blocks: int = 0  # the KV tiers' (scheduler.tiers), decided when the pipeline forms
    num_disk_kv_blocks: int = 0
    kv_group_windows: tuple[int, ...] = (FULL,)  # every stage's (stagemesh.core.kv_groups)


class Rendezvous:
    def __init__(self, pipeline_parallel_size: int, block_size: int, model: ModelIdentity,
                 num_speculative_tokens: int = 0, lora: LoRATable | None = None, kv_cache_dtype: str = "auto"):
        """num_speculative_tokens: the drafts per step of the draft model the last stage must run (0: none).
        lora: --enable-lora's adapters requests may ask for, and how many may run at once. kv_cache_dtype: the
        scheduler's --kv-cache-dtype, every stage's."""
        self.pp = pipeline_parallel_size
        self.lora = lora
        self.kv_cache_dtype = canonical(kv_cache_dtype)
        self.block_size = block_size
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.stages: dict[int, StageInfo] = {}
        self.spares: dict[int, dict[str, StageInfo]] = {}  # index -> address -> standby stage

    def _check_lora(self, s: StageInfo, where: str) -> None:
        """--enable-lora: every stage serves every adapter the scheduler's requests may ask for, in as many
        slots as it runs at once."""
        if self.lora is None:
            return
        missing = self.lora.lacking(s.lora_adapters)
        if missing:  # (RegisterStage first tells a stage the adapters it lacks, which it then reads)
            raise StagemeshError(f"{where} does not serve the LoRA adapter(s) {', '.join(missing)} (its "
                                 f"--enable-lora --lora-modules); the scheduler's requests may ask for them")
        if s.max_loras < self.lora.max_loras:
            raise StagemeshError(f"{where} holds {s.max_loras} LoRA adapter(s) at once (--max-loras); the scheduler "
                                 f"runs {self.lora.max_loras}")

    def _check_draft(self, s: StageInfo, where: str) -> None:
        """Speculative decoding with a draft model: the last stage runs the draft the scheduler expects."""
        want = self.num_speculative_tokens if s.stage_index == self.pp - 1 else 0
        if s.num_speculative_tokens == want:
            return
        if not want:
            raise StagemeshError(f"{where} runs a draft model ({s.num_speculative_tokens} tokens per step), which "
                                 "this scheduler does not expect: give the scheduler the same --speculative-config "
                                 "(only the last stage runs a draft)")
        raise StagemeshError(f"{where}: this scheduler speculates with a draft model of {want} tokens per step, "
                             f"which the last stage must run (it has {s.num_speculative_tokens}): give it the same "
                             "--speculative-config")

    def register(self, stage: StageInfo) -> int:
        """Accept the stage (replacing an earlier one of the same index); returns stages still missing."""
        self.check(stage)
        self.drop_spare(stage)
        self.stages[stage.stage_index] = stage
        return self.missing

    def knows(self, stage: StageInfo) -> bool:
        """The very stage instance is registered, serving or as a spare (its registration is a heartbeat)."""
        return self.stages.get(stage.stage_index) == stage or \
            self.spares.get(stage.stage_index, {}).get(stage.address) == stage

    def add_spare(self, stage: StageInfo) -> None:
        self.check(stage)
        self.spares.setdefault(stage.stage_index, {})[stage.address] = stage

    def drop_spare(self, stage: StageInfo) -> None:
        self.spares.get(stage.stage_index, {}).pop(stage.address, None)

    def promote(self, spare: StageInfo) -> StageInfo:
        """The spare serves its index from now on; returns the stage it replaces."""
        self.drop_spare(spare)
        old, self.stages[spare.stage_index] = self.stages[spare.stage_index], spare
        return old

    def spares_for(self, index: int) -> list[StageInfo]:
        return list(self.spares.get(index, {}).values())

    @property
    def missing(self) -> int:
        return self.pp - len(self.stages)

    def check(self, s: StageInfo) -> None:
        """Raises StagemeshError (the reason) when the stage does not fit the pipeline."""
        where = f"stage {s.stage_index} (layers {s.layer_start}:{s.layer_end}, at {s.address})"
        if not 0 <= s.stage_index < self.pp:
            raise StagemeshError(f"{where}: stage index out of range for --pipeline-parallel-size {self.pp}")
        if s.model != self.model:
            raise StagemeshError(f"{where} serves another model ({_describe(s.model)}); this replica serves "
                                 f"{_describe(self.model)}")
        if s.block_size != self.block_size:
            raise StagemeshError(f"{where} uses --block-size {s.block_size}; the scheduler uses {self.block_size}")
        if s.kv_cache_dtype != self.kv_cache_dtype:
            raise StagemeshError(f"{where} uses --kv-cache-dtype {s.kv_cache_dtype}; the scheduler uses "
                                 f"{self.kv_cache_dtype}: give both the same")
        w = s.kv_group_windows
        if not 1 <= len(w) <= self.model.num_hidden_layers or min(w) < 0 or (len(w) > 1 and w[0] != FULL):
            raise StagemeshError(f"{where} describes {len(w)} KV cache groups (windows {list(w)[:8]}): 1 to one per "
                                 "layer, each window >= 0, a full-attention group first where there are several")
        others = [o for i, o in self.stages.items() if i != s.stage_index]
        if others and others[0].handoff != s.handoff:
            raise StagemeshError(f"{where} uses --handoff {s.handoff}; the other stages use {others[0].handoff}")
        if others and others[0].kv_group_windows != s.kv_group_windows:
            raise StagemeshError(f"{where} has the KV cache groups {list(s.kv_group_windows)} (sliding windows; 0: "
                                 f"full attention); the other stages have {list(others[0].kv_group_windows)}: start "
                                 "every stage with the same --disable-hybrid-kv-cache-manager")
        if s.stage_index == 0 and s.layer_start != 0:
            raise StagemeshError(f"{where}: the first stage must start at layer 0")
        if s.stage_index == self.pp - 1 and s.layer_end != self.model.num_hidden_layers:
            raise StagemeshError(f"{where}: the last stage must end at layer {self.model.num_hidden_layers}")
        self._check_draft(s, where)
        self._check_lora(s, where)
        for o in others:
            if o.layer_start < s.layer_end and s.layer_start < o.layer_end:
                raise StagemeshError(f"{where} overlaps stage {o.stage_index} (layers {o.layer_start}:{o.layer_end})")
            if o.stage_index == s.stage_index - 1 and o.layer_end != s.layer_start:
                raise StagemeshError(f"{where} leaves a gap after stage {o.stage_index}, which ends at layer "
                                     f"{o.layer_end}")
            if o.stage_index == s.stage_index + 1 and s.layer_end != o.layer_start:
                raise StagemeshError(f"{where} leaves a gap before stage {o.stage_index}, which starts at layer "
                                     f"{o.layer_start}")
            if (o.stage_index < s.stage_index) != (o.layer_start < s.layer_start):
                raise StagemeshError(f"{where} is out of order with stage {o.stage_index} "
                                     f"(layers {o.layer_start}:{o.layer_end})")

    @property
    def complete(self) -> bool:
        return len(self.stages) == self.pp

    def plan(self) -> PipelinePlan:
        stages = [self.stages[i] for i in range(self.pp)]
        sizes = [s.tp_size for s in stages]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return PipelinePlan(stages, sum(sizes), offsets, sizes, min(s.num_kv_blocks for s in stages),
                            kv_group_windows=stages[0].kv_group_windows)


def _describe(m: ModelIdentity) -> str:
    return (f"{m.model_type}, {m.num_hidden_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}, "
            f"{m.num_attention_heads}/{m.num_key_value_heads} heads")
