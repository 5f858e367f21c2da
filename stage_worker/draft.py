"""A draft model on the last stage (speculative decoding's draft_model method), on its TP rank 0.

Its KV cache mirrors the target's: the same block ids and slots, written by running the draft over every
chunk the target computes (mirror: KV only, no LM head), so a prefix-cache hit, a preemption or a new
epoch needs nothing of its own. After the step has verified a sequence's drafts, the draft feeds the
sequence's last token and then its own guesses, one position at a time, writing their KV past the target's
(the scheduler allocates those slots: Speculator.lookahead; the next chunk covers them again), and returns
its k next drafts. They reach the scheduler in the step's result.

Drafts are the draft's argmax (vLLM's default draft_sample_method "greedy"): the stage verifies them as it
verifies prompt lookup's, by drawing the target's own token at each position (stage_worker.sampler). With
"probabilistic", an unseeded sampled sequence's drafts are drawn from the draft's distribution (the request's
temperature, top-k, top-p, min-p), kept here until the next step verifies them by rejection sampling against
it (stage_worker.rejection): more of them are accepted than argmax drafts when both models are uncertain.
A seeded request keeps argmax drafts and the seeded draws (its tokens are those without speculation).
"""
from __future__ import annotations

import logging

import torch

from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.speculative import SpeculativeConfig
from stagemesh.core.step import ScheduledChunks
from stage_worker.logits_processors import SequenceState, ends
from stage_worker.attention_metadata import AttentionMetadata
from stage_worker.host_copy import to_host
from stage_worker.rejection import draw, sampling_probs

log = logging.getLogger("stagemesh.stage")


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, device: str | torch.device,
                 dtype: torch.dtype | str | None, block_size: int):
        from stage_worker.runner import StageRunner

        assert spec.model is not None  # (a draft_model spec names its model: stagemesh.core.speculative)
        cfg = ModelConfig.from_path(spec.model)
        if cfg.vocab_size != target.vocab_size:
            raise StagemeshError(f"the draft model {spec.model} has a vocabulary of {cfg.vocab_size} tokens; the "
                                 f"target's has {target.vocab_size} (they must share the tokenizer)")
        self.k = spec.num_speculative_tokens
        self.probabilistic = spec.draft_sample_method == "probabilistic"
        # probabilistic drafts of each sequence's next step: (tokens, the distribution each was drawn from)
        self.proposals: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        self._gen = torch.Generator(device="cpu").manual_seed(torch.initial_seed() % (2**63))
        self.runner = StageRunner.of(spec.model, 0, cfg.num_hidden_layers, device=str(device), dtype=dtype,
                                     block_size=block_size, config=cfg, enforce_eager=True,
                                     disable_hybrid_kv_cache_manager=True)  # (it reads the target's one table)
        self.block_size, self.device = block_size, self.runner.device
        self.max_positions = cfg.max_position_embeddings
        self.kv_bytes_per_block = self.runner.kv_bytes_per_block
        log.info("draft model %s: %d layers, %d tokens per step, %s", spec.model, cfg.num_hidden_layers, self.k,
                 str(self.runner.dtype).removeprefix("torch."))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.kv_caches = []
        self.runner.allocate_kv_cache(num_blocks)
        self.proposals.clear()

    def forget(self, seq_id: int) -> None:
        self.proposals.pop(seq_id, None)

    def probs_for(self, seq_ids: list[int], drafts: list[list[int]]) -> list[list[torch.Tensor] | None] | None:
        """The distributions the step's drafts were drawn from, where this draft drew them (the scheduler may
        send fewer); None for the others."""
        if not self.proposals:
            return None
        out = []
        for seq_id, draft in zip(seq_ids, drafts):
            tokens, probs = self.proposals.pop(seq_id, ([], []))
            out.append(probs[:len(draft)] if draft and tokens[:len(draft)] == draft else None)
        return out

    @torch.inference_mode()
    def mirror(self, chunks: ScheduledChunks, meta: AttentionMetadata, hidden: torch.Tensor | None = None) -> None:
        """Write the draft's KV of the step's tokens where the target wrote its own (the target's hidden states are
        not the draft's business)."""
        ids = torch.tensor(chunks.token_ids, dtype=torch.int64, device=self.device)
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
            if want > 0 and not ends(state, eos_token_ids):
                position = len(state.prompt) + len(state.output) - 1
                limit = min(len(tables[seq_id]) * self.block_size, self.max_positions)
                active.append([seq_id, state.output[-1], position, min(position + want, limit)])
        drafts: dict[int, list[int]] = {a[0]: [] for a in active}
        for seq_id in seq_ids:
            self.proposals.pop(seq_id, None)
        while True:
            active = [a for a in active if a[2] < a[3]]  # a position to write, a draft still wanted
            if not active:
                return drafts
            logits = self._decode([a[1] for a in active], [a[2] for a in active], [tables[a[0]] for a in active])
            # the drawn rows' distributions on the device, and one copy of them and the argmaxes to the host
            drawn = {row: sampling_probs(logits[row], seqs[a[0]].params) for row, a in enumerate(active)
                     if self._draws(seqs[a[0]].params)}
            host = to_host([logits.argmax(dim=-1)] + ([torch.stack(list(drawn.values()))] if drawn else []))
            on_host = dict(zip(drawn, host[1])) if drawn else {}
            for row, (a, token) in enumerate(zip(active, host[0].tolist())):
                if row in drawn:
                    token = self._draw(drawn[row], on_host[row], a[0])
                drafts[a[0]].append(token)
                a[1], a[2] = token, a[2] + 1

    def _draws(self, params) -> bool:
        """Whether the sequence's drafts are drawn from the draft's distribution (else its argmax)."""
        return self.probabilistic and not params.greedy and params.seed is None

    def _draw(self, q: torch.Tensor, q_on_host: torch.Tensor, seq_id: int) -> int:
        """A draft drawn from the draft's distribution q, which is kept for the verification."""
        token = draw(q_on_host, self._gen)
        tokens, probs = self.proposals.setdefault(seq_id, ([], []))
        tokens.append(token)
        probs.append(q)
        return token

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


def make_drafter(spec: SpeculativeConfig, target: ModelConfig, model_dir, device, dtype: torch.dtype | str | None,
                 block_size: int, load_format: str = "auto"):
    """The last stage's drafter of a spec that proposes there: a draft model, or the target's MTP layer."""
    if load_format == "dummy":  # (both read a checkpoint: the draft model's, the target's MTP layer)
        raise StagemeshError("--load-format dummy with a drafting --speculative-config (a draft model or MTP) is not "
                             "built yet: the drafter would read its checkpoint")
    if spec.is_mtp:
        from stage_worker.mtp import MTPDrafter
        from stage_worker.loading import resolve_dtype

        return MTPDrafter(spec, target, model_dir, device, resolve_dtype(target, dtype, str(device)), block_size)
    return DraftModel(spec, target, device, dtype, block_size)
