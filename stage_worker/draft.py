"""A draft model on the last stage (speculative decoding's draft_model method), on its TP rank 0.

Its KV cache mirrors the target's: the same block ids and slots, written by running the draft over every
chunk the target computes (mirror: KV only, no LM head), so a prefix-cache hit, a preemption or a new
epoch needs nothing of its own. After the step has verified a sequence's drafts, the draft feeds the
sequence's last token and then its own guesses, one position at a time, writing their KV past the target's
(the scheduler allocates those slots: Speculator.lookahead; the next chunk covers them again), and returns
its k next drafts. They reach the scheduler in the step's result.

Drafts are the draft's argmax (vLLM's default draft_sample_method "greedy"): the stage verifies them as it
verifies prompt lookup's, by drawing the target's own token at each position (stage_worker.sampler).
"""
from __future__ import annotations

import logging

import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.speculative import SpeculativeConfig
from stage_worker.logits_processors import SequenceState
from stage_worker.model import AttentionMetadata

log = logging.getLogger("stagemesh.stage")


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, device: str | torch.device,
                 dtype: torch.dtype | str | None, block_size: int):
        from stage_worker.runner import StageRunner

        cfg = ModelConfig.from_path(spec.model)
        if cfg.vocab_size != target.vocab_size:
            raise StagemeshError(f"the draft model {spec.model} has a vocabulary of {cfg.vocab_size} tokens; the "
                                 f"target's has {target.vocab_size} (they must share the tokenizer)")
        if spec.draft_sample_method != "greedy":
            raise StagemeshError(f"--speculative-config draft_sample_method {spec.draft_sample_method!r} is not "
                                 "built yet: the draft proposes its argmax (\"greedy\", vLLM's default)")
        self.k = spec.num_speculative_tokens
        self.runner = StageRunner(spec.model, 0, cfg.num_hidden_layers, device=device, dtype=dtype,
                                  block_size=block_size, config=cfg, cuda_graphs=False)
        self.block_size, self.device = block_size, self.runner.device
        self.max_positions = cfg.max_position_embeddings
        self.kv_bytes_per_block = self.runner.kv_bytes_per_block
        log.info("draft model %s: %d layers, %d tokens per step, %s", spec.model, cfg.num_hidden_layers, self.k,
                 str(self.runner.dtype).removeprefix("torch."))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.kv_caches = []
        self.runner.allocate_kv_cache(num_blocks)

    @torch.inference_mode()
    def mirror(self, token_ids: list[int], meta: AttentionMetadata) -> None:
        """Write the draft's KV of the step's tokens where the target wrote its own."""
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        self.runner.model(ids, None, meta, self.runner.kv_caches)

    @torch.inference_mode()
    def propose(self, seqs: dict[int, SequenceState], seq_ids: list[int], tables: dict[int, list[int]],
                eos_token_ids: tuple[int, ...]) -> dict[int, list[int]]:
        """The next drafts of each of `seq_ids` (sequences whose step sampled, their last token known): up to k,
        none past its max_tokens or its KV blocks; none for a sequence its last token ends."""
        active = []
        for seq_id in seq_ids:
            state = seqs[seq_id]
            want = min(self.k, state.params.max_tokens - len(state.output) - 1)
            if want > 0 and not _ends(state, eos_token_ids):
                position = len(state.prompt) + len(state.output) - 1
                limit = min(len(tables[seq_id]) * self.block_size, self.max_positions)
                active.append([seq_id, state.output[-1], position, min(position + want, limit)])
        drafts: dict[int, list[int]] = {a[0]: [] for a in active}
        while True:
            active = [a for a in active if a[2] < a[3]]  # a position to write, a draft still wanted
            if not active:
                return drafts
            logits = self._decode([a[1] for a in active], [a[2] for a in active], [tables[a[0]] for a in active])
            for a, token in zip(active, logits.argmax(dim=-1).tolist()):
                drafts[a[0]].append(token)
                a[1], a[2] = token, a[2] + 1

    def _decode(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One token per sequence through the draft: its logits after each."""
        bs, dev, n = self.block_size, self.device, len(tokens)
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, positions)],
                                      dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev))
        ids = torch.tensor(tokens, dtype=torch.int64, device=dev)
        model = self.runner.model
        return model.compute_logits(model(ids, None, meta, self.runner.kv_caches))


def _ends(state: SequenceState, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether the sequence's last token stops it (the scheduler will finish it: no drafts needed)."""
    p, token = state.params, state.output[-1]
    if len(state.output) < p.min_tokens:
        return False
    return token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)
