"""DeepSeek-V3's multi-token prediction as speculative decoding (vLLM's deepseek_mtp), on the last stage's TP rank 0
where a draft model runs (stage_worker.draft), and verified as a draft model's drafts are.

The checkpoint's MTP layer (model.layers.{num_hidden_layers}) reads, at position j, the target's final hidden
state h_j and token j+1: x = eh_proj(cat(enorm(embed(t_{j+1})), hnorm(h_j))), through one decoder layer (latent
attention over a KV cache of its own, in the target's block ids and slots, and the experts); shared_head (its
norm and head) then gives the logits of token j+2, the first draft. Further drafts run the layer again on its own
output and the draft before (vLLM's way with one MTP layer and k drafts), writing KV past the target's in the
slots the scheduler allocates for a draft model's lookahead.

After each step's tokens are sampled the layer catches up on every position of the step whose next token is known
(a prompt chunk's; a decode chunk's accepted drafts and the token sampled after them), so that its KV holds what
later steps attend to. Drafts are the layer's argmax; the tokens are the target's whatever the drafts are.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

import kernels
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.speculative import SpeculativeConfig
from stagemesh.core.step import ScheduledChunks
from stage_worker.kv_cache import allocate_kv_cache, kv_bytes_per_block
from stage_worker.layers import (Linear, Module, ParallelLMHead, RMSNorm, VocabParallelEmbedding, full, new_param,
                                 pack_weights_for_cpu)
from stage_worker.logits_processors import SequenceState, ends
from stage_worker.attention_metadata import AttentionMetadata
from stage_worker.model import DecoderLayer, attention_class
from stage_worker.parallel import TPGroup
from stage_worker.quant_methods import checkpoint_method
from stage_worker.quant_methods.loader import load_quantised
from stage_worker.weights import CheckpointReader, load_weights

log = logging.getLogger("stagemesh.stage")


def mtp_tensor_names(cfg: ModelConfig, model_dir) -> dict[str, str]:
    """The MTP layer's embedding and head as the checkpoint holds them (its own copies, as DeepSeek-V3's has, else
    the model's); a StagemeshError naming what is missing where the checkpoint has no MTP layer."""
    key, n = cfg.family.mtp_layers, cfg.num_hidden_layers
    flag = "--speculative-config method deepseek_mtp"
    if key is None:
        raise StagemeshError(f"{flag}: {cfg.model_type} has no multi-token-prediction layer")
    reader = CheckpointReader(model_dir)
    try:
        held = set(reader.files)
    finally:
        reader.close()
    prefix, count = f"model.layers.{n}", int(cfg.raw.get(key) or 0)
    if count < 1 or f"{prefix}.eh_proj.weight" not in held:
        raise StagemeshError(f"{flag}: the checkpoint in {model_dir} has no MTP layer ({key} {count}; no tensor "
                             f"{prefix}.eh_proj.weight)")
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return {"embed": next(n for n in (f"{prefix}.embed_tokens.weight", "model.embed_tokens.weight") if n in held),
            "head": next(n for n in (f"{prefix}.shared_head.head.weight", head) if n in held)}


def _load(model: MTPModel, cfg: ModelConfig, model_dir) -> None:
    """The layer's weights as the checkpoint holds them (DeepSeek-V3's: its decoder layer in block FP8 through the
    quantization method, eh_proj, norms, embedding and head dense), every tensor of it read."""
    reader = CheckpointReader(model_dir)
    method = checkpoint_method(cfg, None)
    filled = load_quantised(model, method, reader) if method is not None else frozenset()
    names, read = list(reader.files), reader.read
    load_weights(model, reader, filled)  # (closes the reader)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    unread = sorted(n for n in names if n.startswith(prefix) and n not in read)
    if unread:
        raise StagemeshError("deepseek_mtp: the MTP layer has tensors stagemesh does not read: "
                             f"{', '.join(unread[:6])}")


class MTPModel(Module):
    """The MTP layer whole (TP=1): its input projection, decoder layer and shared head."""

    def __init__(self, cfg: ModelConfig, names: dict[str, str], dtype, device, max_positions: int):
        super().__init__()
        tp, h, eps, n = TPGroup(), cfg.hidden_size, cfg.rms_norm_eps, cfg.num_hidden_layers
        prefix = f"model.layers.{n}"
        self.embed_tokens = VocabParallelEmbedding(names["embed"], cfg.vocab_size, h, tp, dtype, device)
        self.enorm = RMSNorm(f"{prefix}.enorm.weight", h, eps, dtype, device)
        self.hnorm = RMSNorm(f"{prefix}.hnorm.weight", h, eps, dtype, device)
        self.eh_proj = Linear(new_param((h, 2 * h), dtype, device, full(f"{prefix}.eh_proj.weight", h)))
        self.layers = nn.ModuleList([DecoderLayer(cfg, n, tp, dtype, device)])  # (a list: as kv tiers count layers)
        self.norm = RMSNorm(f"{prefix}.shared_head.norm.weight", h, eps, dtype, device)
        self.lm_head = ParallelLMHead(names["head"], cfg.vocab_size, h, tp, dtype, device)
        self.register_buffer("cos_sin", kernels.build_cos_sin_cache(
            attention_class(cfg).rotary_dim(cfg), max_positions, cfg.rope_theta, cfg.rope_scaling,
            dtype=torch.float32, device=device), persistent=False)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The layer's output (before its shared head's norm) at each row: token j+1's id and h_j."""
        e = kernels.rms_norm(self.embed_tokens(input_ids), self.enorm.weight, self.enorm.eps)[0]
        h = kernels.rms_norm(hidden.to(e.dtype), self.hnorm.weight, self.hnorm.eps)[0]
        x, residual = self.layers[0](self.eh_proj(torch.cat([e, h], -1)), None, meta, kv_cache, self.cos_sin)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(kernels.rms_norm(hidden, self.norm.weight, self.norm.eps)[0]).float()


class MTPRunner:
    """The MTP layer's model and KV cache, as the KV tiers read a draft's (stage_worker.kv_tiers: its config,
    dtype, kv_cache_dtype, model.layers, kv_block_size, num_kv_heads and kv_caches)."""

    def __init__(self, cfg: ModelConfig, model_dir, device, dtype: torch.dtype, block_size: int):
        self.config, self.model_dir, self.device, self.dtype = cfg, model_dir, torch.device(device), dtype
        self.kv_cache_dtype = dtype  # (its cache in the weights' dtype: an fp8 cache refuses a drafter, runner.py)
        self.kv_block_size, self.num_kv_heads = block_size, cfg.num_key_value_heads
        self.model = MTPModel(cfg, mtp_tensor_names(cfg, model_dir), dtype, self.device, cfg.max_position_embeddings)
        _load(self.model, cfg, model_dir)
        if self.device.type == "cpu":
            pack_weights_for_cpu(self.model)
        self.kv_bytes_per_block = kv_bytes_per_block(1, self.num_kv_heads, cfg.head_dim, block_size, dtype)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_cache(1, num_blocks, self.kv_block_size, self.num_kv_heads, self.config.head_dim,
                                           self.dtype, self.device)


class MTPDrafter:
    """deepseek_mtp's drafts, with a draft model's interface (stage_worker.runner.StageRunner.attach_drafter)."""

    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, model_dir, device, dtype: torch.dtype,
                 block_size: int):
        self.k, self.block_size = spec.num_speculative_tokens, block_size
        self.runner = MTPRunner(target, model_dir, device, dtype, block_size)
        self.device, self.kv_bytes_per_block = self.runner.device, self.runner.kv_bytes_per_block
        self.max_positions = target.max_position_embeddings
        self.proposals: dict = {}  # (a draft model's probabilistic drafts: MTP's are argmax, none kept)
        self._step: tuple[ScheduledChunks, AttentionMetadata, torch.Tensor] | None = None
        log.info("deepseek_mtp: the MTP layer model.layers.%d proposes %d tokens per step", target.num_hidden_layers,
                 self.k)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self._step = None

    def forget(self, seq_id: int) -> None:
        pass

    def probs_for(self, seq_ids: list[int], drafts: list[list[int]]) -> None:
        return None

    def mirror(self, chunks: ScheduledChunks, meta: AttentionMetadata, hidden: torch.Tensor | None) -> None:
        """The step the target computed: the layer reads its hidden states once the sampled tokens are known."""
        self._step = (chunks, meta, hidden) if hidden is not None else None

    @torch.inference_mode()
    def propose(self, seqs: dict[int, SequenceState], seq_ids: list[int], tables: dict[int, list[int]],
                eos_token_ids: tuple[int, ...]) -> dict[int, list[int]]:
        """Catch up on the step, then the next drafts of each of `seq_ids` (sampled this step): up to k, none past
        its max_tokens, its KV blocks or the context; none for a sequence its last token ends."""
        step, self._step = self._step, None
        if step is None:
            return {}
        first = self._catch_up(*step, seqs, tables)
        drafts: dict[int, list[int]] = {}
        active = []  # [sequence, the layer's last output, its last draft, the next position to write, the end]
        for seq_id in seq_ids:
            state = seqs[seq_id]
            want = min(self.k, state.params.max_tokens - len(state.output) - 1)
            if seq_id not in first or want <= 0 or ends(state, eos_token_ids):
                continue
            hidden, position, token = first[seq_id]
            drafts[seq_id] = [token]
            limit = min(len(tables[seq_id]) * self.block_size, self.max_positions)
            active.append([seq_id, hidden, token, position + 1, min(position + want, limit)])
        while active := [a for a in active if a[3] < a[4]]:
            out = self._forward([a[2] for a in active], torch.stack([a[1] for a in active]),
                                [[a[3]] for a in active], [tables[a[0]] for a in active])
            for a, row, token in zip(active, out, self.runner.model.compute_logits(out).argmax(-1).tolist()):
                drafts[a[0]].append(token)
                a[1], a[2], a[3] = row, token, a[3] + 1
        return drafts

    def _catch_up(self, chunks: ScheduledChunks, meta: AttentionMetadata, hidden: torch.Tensor,
                  seqs: dict[int, SequenceState], tables: dict[int, list[int]]) -> dict[int, tuple]:
        """The layer over each position of the step whose next token is known; for each sequence whose newest
        token it read: (its output there, that position, the first draft)."""
        starts = meta.query_start_loc.tolist()
        rows: list[int] = []
        ids: list[int] = []
        positions: list[list[int]] = []
        seq_tables: list[list[int]] = []
        newest: dict[int, tuple[int, int]] = {}
        for i, (seq_id, n, p0) in enumerate(zip(chunks.seq_ids, chunks.num_tokens, chunks.start_positions)):
            tokens = seqs[seq_id].prompt + seqs[seq_id].output
            m = min(n, len(tokens) - 1 - p0)  # the chunk's positions followed by a known token
            if m <= 0:
                continue
            rows.extend(range(starts[i], starts[i] + m))
            ids.extend(tokens[p0 + 1:p0 + m + 1])
            positions.append(list(range(p0, p0 + m)))
            seq_tables.append(tables[seq_id])
            if p0 + m == len(tokens) - 1:
                newest[seq_id] = (len(rows) - 1, p0 + m - 1)
        if not rows:
            return {}
        out = self._forward(ids, hidden[torch.tensor(rows, device=hidden.device)], positions, seq_tables)
        if not newest:
            return {}
        last = torch.tensor([row for row, _ in newest.values()], device=out.device)
        firsts = self.runner.model.compute_logits(out[last]).argmax(-1).tolist()
        return {seq_id: (out[row], position, token)
                for (seq_id, (row, position)), token in zip(newest.items(), firsts)}

    def _forward(self, ids: list[int], hidden: torch.Tensor, positions: list[list[int]],
                 tables: list[list[int]]) -> torch.Tensor:
        """The layer over runs of positions, one run per sequence (its block table), each after the ones before
        it: the output row of each (token, hidden state)."""
        bs, dev = self.block_size, self.device
        width = max(len(t) for t in tables)
        flat = [p for run in positions for p in run]
        starts = [0]
        for run in positions:
            starts.append(starts[-1] + len(run))
        meta = AttentionMetadata(
            positions=torch.tensor(flat, dtype=torch.int64, device=dev),
            slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, run in zip(tables, positions) for p in run],
                                      dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([run[-1] + 1 for run in positions], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev))
        model = self.runner.model
        return model(torch.tensor(ids, dtype=torch.int64, device=dev), hidden, meta, self.runner.kv_caches[0])
