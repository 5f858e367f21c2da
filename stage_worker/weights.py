"""Read a stage's own tensors, and only its TP shard of each, from safetensors.

Single files and sharded checkpoints (model.safetensors.index.json) alike;
every read is a safetensors slice, so no process materialises a tensor it
does not keep.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from stagemesh.core.errors import StagemeshError
from stage_worker.layers import shards_of


class CheckpointReader:
    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self.files = self._index()
        self._stack = ExitStack()
        self._handles: dict[Path, safe_open] = {}  # by file
        self.read: set[str] = set()  # the tensors read so far (stage_worker.coverage: none may be left unread)

    def _index(self) -> dict[str, Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.model_dir / file for name, file in weight_map.items()}
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise StagemeshError(f"{self.model_dir} has no *.safetensors weights (only safetensors are loaded)")
        names: dict[str, Path] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                names.update({name: file for name in f.keys()})
        return names

    def _handle(self, file: Path) -> safe_open:
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(safe_open(file, framework="pt"))
        return self._handles[file]

    def has(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """How the file stores `name`: safetensors' dtype name (F32, BF16, F8_E4M3, I32, U8 ...)."""
        return str(self._slice(name).get_dtype())

    def read_whole(self, name: str) -> torch.Tensor:
        """A small tensor whole (scales of a tensor, a g_idx)."""
        self.read.add(name)
        return self._handle(self.files[name]).get_tensor(name) if name in self.files else self._slice(name)[:]

    def _slice(self, name: str):
        if name not in self.files:
            raise StagemeshError(f"the checkpoint in {self.model_dir} has no tensor {name}")
        return self._handle(self.files[name]).get_slice(name)

    def read_slice(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        tensor = self._slice(name)
        self.read.add(name)
        index = [slice(None)] * len(tensor.get_shape())
        index[dim] = slice(start, start + length)
        return tensor[tuple(index)]

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()


def load_weights(model: nn.Module, source, filled: frozenset[int] = frozenset()) -> None:
    """Fill every parameter of `model` from its `shards` (see stage_worker.layers), but those whose id is in
    `filled` (a quantised checkpoint's, dequantised already). `source`: a model directory of safetensors, or a
    reader with the same read_slice (stage_worker.gguf.GGUFCheckpoint)."""
    reader = CheckpointReader(source) if isinstance(source, (str, Path)) else source
    try:
        for param in model.parameters():
            if id(param) not in filled:
                fill(param.data, shards_of(param), reader)
    finally:
        reader.close()


def fill(data: torch.Tensor, shards, reader: CheckpointReader) -> None:
    """Copy each shard's checkpoint slice into its place in `data` (a parameter's tensor)."""
    for shard in shards:
        part = reader.read_slice(shard.name, shard.dim, shard.start, shard.length)
        # (a packed format's bytes go only where its layer declares them so: MXFP4's uint8 blocks and scales)
        if (not part.is_floating_point() or part.element_size() == 1) and part.dtype != data.dtype:
            raise StagemeshError(f"{shard.name} is stored as {part.dtype}: quantised, and nothing in config.json's "
                                 "quantization_config says how to read it (a dense tensor is float32, bfloat16 or "
                                 "float16)")
        target = data if shard.stack is None else data[shard.stack]
        target = target.narrow(shard.dim, shard.dest, shard.length)
        if part.shape != target.shape:
            raise StagemeshError(f"{shard.name}: the checkpoint gives {list(part.shape)} where the model's config "
                                 f"wants {list(target.shape)}")
        target.copy_(part)


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights made where the model lives (benchmarks without a checkpoint). A CPU stage's fp32 linears are
    packed for oneDNN already (stage_worker.layers.pack_weights_for_cpu), whose tensors take no normal_: theirs are
    drawn dense and packed again."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            param.data.fill_(1.0)
        elif param.is_mkldnn:
            from stage_worker.layers import repack_onednn

            param.data = repack_onednn(torch.empty(param.shape, dtype=param.dtype).normal_(0.0, std, generator=gen))
        else:
            param.data.normal_(0.0, std, generator=gen)
