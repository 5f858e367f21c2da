"""DeepSeekMoE's gate (stagemesh.core.families.deepseek_v2.GateSettings): which experts each token takes and their
weights, as transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter compute them, in fp32 from an fp32 router
weight (transformers keeps the gate in fp32 whatever the model's dtype).

- V3 (sigmoid, noaux_tc): sigmoid scores; e_score_correction_bias is added to choose (never to weigh); the best
  topk_group of n_group groups, a group scored by the sum of its two best; the top-k of those groups weighed by
  their sigmoid scores, renormalised per norm_topk_prob.
- V2 (softmax): greedy top-k, or group-limited greedy (a group scored by its best expert; the others' scores 0).
Both then scale the weights by routed_scaling_factor. The output is what kernels.select_experts gives: fp32
weights and int64 ids, [tokens, top_k] each.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stagemesh.core.families.deepseek_v2 import gate_settings
from stagemesh.core.model_config import ModelConfig
from stage_worker.layers import Module, full, new_param


class GroupedGate(Module):
    def __init__(self, cfg: ModelConfig, block: str, device):
        super().__init__()
        self.settings = s = gate_settings(cfg)
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        e, h = cfg.num_experts, cfg.hidden_size
        self.weight = new_param((e, h), torch.float32, device, full(f"{block}.gate.weight", e))
        self.correction_bias = (new_param((e,), torch.float32, device, full(f"{block}.gate.e_score_correction_bias", e))
                                if s.correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)
        if self.settings.scoring_func == "sigmoid":
            weights, ids = self._sigmoid(logits)
        else:
            weights, ids = self._softmax(logits)
        return weights * self.settings.routed_scaling_factor, ids

    def _sigmoid(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.sigmoid()
        choice = scores if self.correction_bias is None else scores + self.correction_bias
        groups = choice.view(choice.shape[0], self.settings.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~self._group_mask(groups), float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids

    def _softmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.softmax(dim=-1)
        if self.settings.topk_method == "group_limited_greedy":
            groups = scores.view(scores.shape[0], self.settings.n_group, -1).max(dim=-1).values
            scores = scores.masked_fill(~self._group_mask(groups), 0.0)
        return torch.topk(scores, self.top_k, dim=-1, sorted=False)

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] bool: the experts of each token's topk_group best groups."""
        best = torch.topk(group_scores, self.settings.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return mask.repeat_interleave(self.weight.shape[0] // self.settings.n_group, dim=1)
