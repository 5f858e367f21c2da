"""CUDA graphs of a stage's forward for decode-only steps (one token per sequence).

At batch 1 a decode step is ~10 kernels per layer; launched one by one from
Python the GPU idles between them. Here the forward is captured once per
padded batch size (1, 2, 4, 8, 16, 24, 32, ... like vLLM's) over static input
buffers, and a decode step copies its inputs in and replays the graph.
On the last stage the LM head is in the graph too. Padding rows have slot -1 (the KV write skips them) and
context length 0 (the attention reads nothing); their outputs are dropped. Prefill and mixed steps
run eagerly. The graphs capture the KV cache's addresses: they are made after
the cache is allocated and again when it is reallocated. ``--enforce-eager``
turns them off, as in vLLM.
"""
from __future__ import annotations

import logging
import time
from typing import cast

import torch

from stage_worker.attention_metadata import AttentionMetadata
from stage_worker.model import StageModel

log = logging.getLogger("stagemesh.stage")


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 513, 16))
    return [s for s in sizes if s <= max_batch] or [1]


class DecodeGraphs:
    def __init__(self, model: StageModel, kv_caches, num_kv_blocks: int, block_size: int, max_batch: int = 256):
        cfg, dev = model.cfg, cast(torch.Tensor, model.cos_sin).device  # (a buffer: torch types it Tensor | Module)
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.width = min(num_kv_blocks, -(-cfg.max_position_embeddings // block_size))
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.hidden: torch.Tensor | None = None
        if not model.is_first:
            param = next(model.parameters())
            self.hidden = torch.zeros(n, cfg.hidden_size, dtype=param.dtype, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, self.width, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(self.positions[:size], self.slots[:size], self.block_tables[:size],
                                 self.context_lens[:size], self.query_start_loc[:size + 1])
        ids = self.input_ids[:size] if self.model.is_first else None
        hidden = self.hidden[:size] if self.hidden is not None else None
        out = self.model(ids, hidden, meta, self.kv_caches)
        return self.model.compute_logits(out) if self.model.is_last else out

    @torch.inference_mode()
    def _capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # the largest first, so the smaller ones reuse its memory
                for _ in range(2):  # compile the Triton kernels, settle the allocator
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured CUDA graphs for decode batches of 1..%d (%d sizes) in %.1fs", self.max_batch,
                 len(self.sizes), time.perf_counter() - start)

    def can_run(self, num_seqs: int, num_tokens: int, max_blocks: int) -> bool:
        return num_seqs == num_tokens and num_seqs <= self.max_batch and max_blocks <= self.width

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor | None, hidden: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states (the logits of every row, on the last stage) in the graph's own output buffer."""
        n = meta.context_lens.shape[0]
        size = next(s for s in self.sizes if s >= n)
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if hidden is not None:
            assert self.hidden is not None  # (a stage after the first)
            self.hidden[:n].copy_(hidden, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slots[n:size].fill_(-1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.context_lens, non_blocking=True)
        self.context_lens[n:size].fill_(0)
        self.graphs[size].replay()
        return self.outputs[size][:n]
