"""Building a stage's model slice from its settings (stage_worker.settings): the layers it may take, the dtype it
computes in, the quantization it is read with, and its weights read from the checkpoint."""
from __future__ import annotations

import torch

from kernels import cpu_ops
from stagemesh.core.errors import StagemeshError
from stagemesh.core.model_config import ModelConfig
from stage_worker.coverage import check_all_read
from stage_worker.gguf import GGUFCheckpoint
from stage_worker.kv_scales import CheckpointScales, read_checkpoint_scales
from stage_worker.model import StageModel
from stage_worker.quant_methods.loader import load_quantised
from stage_worker.quant_methods.method import QuantMethod
from stage_worker.quantization import load_gguf, quantize_at_load
from stage_worker.settings import StageSettings
from stage_worker.weights import CheckpointReader, load_weights


def check_layer_range(cfg: ModelConfig, layer_start: int, layer_end: int) -> None:
    if not 0 <= layer_start < layer_end <= cfg.num_hidden_layers:
        raise StagemeshError(
            f"layer range {layer_start}:{layer_end} is outside the model's {cfg.num_hidden_layers} layers "
            f"(use A:B with 0 <= A < B <= {cfg.num_hidden_layers})"
        )


def _cpu_auto_dtype(checkpoint_dtype: str) -> str:
    """bf16 for a bf16 or fp16 checkpoint where the CPU kernels are built (their bf16 path is faster than
    fp32, stage_worker/cpu_isa.py); fp32 otherwise (an fp32 checkpoint is never narrowed unasked)."""
    if checkpoint_dtype in ("bfloat16", "float16") and cpu_ops.load() is not None:
        return "bfloat16"
    return "float32"


def resolve_dtype(cfg: ModelConfig, dtype: torch.dtype | str | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or "auto"
    if name == "auto":  # vLLM's rule: the checkpoint's dtype; on CPU fp16 runs as bf16
        name = cfg.torch_dtype if str(device).startswith("cuda") else _cpu_auto_dtype(cfg.torch_dtype)
    aliases = {"float": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
    name = aliases.get(name, name)
    if name not in ("float32", "float16", "bfloat16"):
        raise StagemeshError(f"--dtype {dtype} is not supported (auto, float32, float16, bfloat16)")
    return getattr(torch, name)


DUMMY_LOW, DUMMY_HIGH, DUMMY_SEED = -1e-3, 1e-3, 1234  # vLLM's dummy weights


def dummy_weights(model: StageModel, quantization: str | None) -> None:
    """--load-format dummy, as vLLM's: every floating-point weight uniform in [DUMMY_LOW, DUMMY_HIGH], each drawn
    from a generator seeded DUMMY_SEED of its own (its values depend on its shape and dtype only, not on the order
    or the process it is made in). Small enough that no layer overflows; the checkpoint is never opened."""
    if quantization is not None:
        raise StagemeshError(f"--load-format dummy with quantization {quantization} is not built yet (dummy weights "
                             "are drawn in the model's dtype)")
    for param in model.parameters():
        if param.is_floating_point():
            generator = torch.Generator(device=param.device).manual_seed(DUMMY_SEED)
            param.data.uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generator)


def load_checkpoint(model: StageModel, settings: StageSettings, quantization: str | None, cfg: ModelConfig,
                    method: QuantMethod | None) -> CheckpointScales | None:
    """`method`: the checkpoint's own quantization (stage_worker.quant_methods); else `quantization` quantises
    an unquantised checkpoint at load (or names a GGUF's). Returns the KV cache scales the checkpoint holds for
    the stage's layers (stage_worker.kv_scales, every one checked; a GGUF has none)."""
    fmt = settings.load_format
    if fmt == "dummy":
        dummy_weights(model, quantization or (method.name if method is not None else None))
        return None
    if fmt != "auto" and (fmt == "gguf") != (quantization == "gguf"):
        raise StagemeshError(f"--load-format {fmt} does not read {settings.model} (a "
                             f"{'GGUF file' if quantization == 'gguf' else 'safetensors checkpoint'}: --load-format "
                             f"{'gguf' if quantization == 'gguf' else 'safetensors'}, or auto)")
    if quantization == "gguf":
        if settings.gguf_file is None:
            raise StagemeshError("--quantization gguf needs a .gguf file as the model")
        load_gguf(model, GGUFCheckpoint(settings.gguf_file, cfg))
        return None
    assert settings.model_dir is not None  # (only a runner that loads nothing has no model)
    reader = CheckpointReader(settings.model_dir)
    filled = load_quantised(model, method, reader) if method is not None else frozenset()
    load_weights(model, reader, filled)
    scales = read_checkpoint_scales(reader, cfg, model.layer_start, model.layer_end)  # (read before the check)
    check_all_read(reader.files, reader.read, model)
    if quantization is not None and method is None:
        quantize_at_load(model, quantization)
    return scales
