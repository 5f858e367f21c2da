"""The pooling runner's last stage (vLLM's --runner pooling): no LM head and no sampling; each pooling sequence's
prompt is pooled from the final normed hidden states as its chunks are computed (so chunked prefill and
preemption need nothing of the scheduler), and the pool is finished, through the task's head, when its last chunk
is: one SampledToken carrying it (stagemesh.core.step), which ends the request.

Pooling types as vLLM's: LAST (the last token), MEAN (in fp32), CLS (the first), ALL (every token), STEP (ALL, then
the returned_token_ids columns and the step_tag_id rows). Heads: embed keeps the first `dimensions` values and
L2-normalizes; classify and score apply the checkpoint's score head (`score.weight`, a *ForSequenceClassification
checkpoint's) then softmax (classify; sigmoid for a single label) or, for score, sigmoid on a single label;
token_classify applies the head (classify models) and softmax per row; a reward model's rows are its hidden
states, softmaxed per row, as vLLM's converted reward models give them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from stagemesh.core.errors import StagemeshError
from stagemesh.core.pooling import TOKEN_TASKS, Pooled, PoolerConfig, PoolingParams
from stagemesh.core.step import NewSequence, SampledToken, StepBatch
from stage_worker.layers import Module, full, new_param


class ScoreHead(Module):
    """A classification checkpoint's score head (hidden -> labels, no bias), replicated on every TP rank."""

    def __init__(self, num_labels: int, hidden_size: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = new_param((num_labels, hidden_size), dtype, device, full("score.weight", num_labels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


def attach(model: Module, config: PoolerConfig, model_dir: str | Path | None, dtype: torch.dtype,
           device) -> StagePooler | None:
    """Make a stage model a pooling one before its weights load: its last stage loses the LM head (never read)
    and, for classify, gains the score head. None on the other stages, which run as they are."""
    if not model.is_last:
        return None
    model.lm_head = None
    head = None
    if config.convert == "classify":
        if model_dir is not None:
            _check_score_head(Path(model_dir))
        head = model.score = ScoreHead(config.num_labels, config.hidden_size, dtype, device)
    return StagePooler(config, head)


def _check_score_head(model_dir: Path) -> None:
    from stage_worker.weights import CheckpointReader

    reader = CheckpointReader(model_dir)
    try:
        if "score.weight" not in reader.files:
            raise StagemeshError(f"--convert classify needs a classification checkpoint's score head (score.weight, "
                                 f"as *ForSequenceClassification saves it); {model_dir} has none")
    finally:
        reader.close()


@dataclass
class _Pool:
    """One sequence's pool so far."""
    params: PoolingParams
    prompt_token_ids: list[int]
    mode: str  # the pooling type it runs: the server's for sequence tasks, ALL (or STEP) for token tasks
    first: torch.Tensor | None = None
    last: torch.Tensor | None = None
    total: torch.Tensor | None = None  # MEAN: the fp32 sum of the rows so far
    count: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)  # ALL, STEP

    def add(self, rows: torch.Tensor, start: int) -> None:
        if self.mode == "MEAN":
            part = rows.float().sum(0)
            self.total = part if self.total is None else self.total + part
            self.count += rows.shape[0]
        elif self.mode in ("ALL", "STEP"):
            self.rows.append(rows.float())
        elif self.mode == "CLS" and start == 0:
            self.first = rows[0].float()
        self.last = rows[-1].float()


class StagePooler:
    """Pools the sequences of the last stage's steps (TP rank 0 keeps the results, as it keeps sampled tokens)."""

    def __init__(self, config: PoolerConfig, head: ScoreHead | None) -> None:
        self.config, self.head = config, head
        self.pools: dict[int, _Pool] = {}

    def update(self, batch: StepBatch) -> None:
        for seq_id in batch.finished_seq_ids:
            self.pools.pop(seq_id, None)
        for seq in batch.new_sequences:
            self.pools.pop(seq.seq_id, None)
            if seq.sampling.pooling is not None:
                self.pools[seq.seq_id] = self._pool_of(seq)

    def reset(self) -> None:
        self.pools.clear()

    def _pool_of(self, seq: NewSequence) -> _Pool:
        params, pooling_type = seq.sampling.pooling, self.config.pooling_type
        assert params is not None
        token_wise = params.task in TOKEN_TASKS
        mode = ("STEP" if pooling_type == "STEP" else "ALL") if token_wise else pooling_type
        return _Pool(params, list(seq.prompt_token_ids), mode)

    @torch.inference_mode()
    def pool(self, batch: StepBatch, hidden: torch.Tensor) -> list[SampledToken]:
        """Each chunk's rows of `hidden` (the step's final normed hidden states) into its sequence's pool; the
        pooled output of each sequence whose prompt is complete. A sequence that is not a pooling one fails alone:
        this runner does not generate."""
        out: list[SampledToken] = []
        c, at = batch.chunks, 0
        for seq_id, n, start, sample in zip(c.seq_ids, c.num_tokens, c.start_positions, c.sample):
            rows, at = hidden[at:at + n], at + n
            state = self.pools.get(seq_id)
            if state is None:
                if sample:
                    out.append(SampledToken(seq_id, 0, error="this replica runs --runner pooling: it pools "
                                                            "prompts and generates no tokens"))
                continue
            state.add(rows, start)
            if sample:
                out.append(self._finish(seq_id, state))
        return out

    def _finish(self, seq_id: int, state: _Pool) -> SampledToken:
        task = state.params.task
        if task not in self.config.tasks:
            return SampledToken(seq_id, 0, error=f"this --convert {self.config.convert} model does not serve the "
                                                 f"{task} task (it serves {', '.join(self.config.tasks)})")
        values = self._head(state, self._pooled(state))
        return SampledToken(seq_id, 0, pooled=Pooled(tuple(values.shape),
                                                     values.contiguous().cpu().numpy().astype("<f4").tobytes()))

    def _pooled(self, state: _Pool) -> torch.Tensor:
        mode = state.mode
        if mode == "MEAN":
            assert state.total is not None
            return state.total / state.count
        if mode == "CLS":
            assert state.first is not None, "CLS pooling met a sequence whose first chunk it did not see"
            return state.first
        if mode == "LAST":
            assert state.last is not None
            return state.last
        rows = torch.cat(state.rows)
        if mode == "STEP":
            cfg = self.config
            if cfg.returned_token_ids:
                rows = rows[:, list(cfg.returned_token_ids)]
            if cfg.step_tag_id is not None:
                ids = torch.tensor(state.prompt_token_ids[:rows.shape[0]], device=rows.device)
                rows = rows[ids == cfg.step_tag_id]
        return rows

    def _head(self, state: _Pool, pooled: torch.Tensor) -> torch.Tensor:
        p = state.params
        if p.task in ("embed", "token_embed"):
            if p.dimensions is not None:
                pooled = pooled[..., :p.dimensions]
            return F.normalize(pooled, p=2, dim=-1) if p.normalize else pooled
        if self.head is not None:
            pooled = self.head(pooled)
        if not p.activation:
            return pooled
        if pooled.shape[-1] < 2:
            return torch.sigmoid(pooled)
        return pooled if p.task == "score" else torch.softmax(pooled, dim=-1)

