"""Where a step's tokens sit in the paged KV cache: what every attention layer reads (kernel API in
kernels.dispatch), the plain layer (stage_worker.model), MLA (stage_worker.mla) and the families' own alike."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stage_worker.context import CPMetadata, TokenSplit


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache (kernel API in kernels.dispatch)."""

    positions: torch.Tensor  # [tokens] int64
    slot_mapping: torch.Tensor  # [tokens] int64
    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    context_lens: torch.Tensor  # [seqs] int32, after this step
    query_start_loc: torch.Tensor  # [seqs + 1] int32
    cp: CPMetadata | None = None  # with context parallelism (DCP or PCP): this rank's share (stage_worker.context)
    split: TokenSplit | None = None  # with prefill context parallelism: this rank's rows of the step's tokens
    # with KV cache groups (stagemesh.core.kv_groups): each group's view, its block tables and slots; () for one
    groups: tuple[AttentionMetadata, ...] = ()

    def of_group(self, group: int) -> AttentionMetadata:
        """What a layer of KV cache group `group` reads and writes."""
        return self.groups[group] if self.groups else self
