"""What a MODEL argument names: a model directory, or a GGUF file whose config and tokenizer come from a
directory (vLLM's `serve ./x.gguf --tokenizer DIR`); `--quantization gguf` with no model names the
embedded model's own GGUF (its config and tokenizer: the converted directory)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from stagemesh.core.default_model import DEFAULT_MODEL_NAME, default_model_dir, gguf_path, resolve_model
from stagemesh.core.errors import StagemeshError

# gguf: a .gguf file's weights as they are; w8a16 / w8a8: int8 weights quantised at load; fp8: fp8 weights
# quantised at load, CUDA (stage_worker.quantization), or an fp8 checkpoint's; the rest name a quantised
# checkpoint's format, vLLM's names (stage_worker.quant_methods; test_quant_formats checks the two agree)
QUANTIZATION_METHODS = ("gguf", "w8a16", "w8a8", "fp8", "compressed-tensors", "fbgemm_fp8", "modelopt", "gptq",
                        "awq", "mxfp4", "gptq_marlin", "awq_marlin")
# --quantization-activations (stage_worker.activations)
ACTIVATION_MODES = ("exact", "int8")


@dataclass(frozen=True)
class ModelSource:
    model_dir: Path  # config.json and the tokenizer
    gguf_file: Path | None = None  # the weights, when they come from a GGUF
    quantization: str | None = None
    name: str = DEFAULT_MODEL_NAME  # what clients call it (vLLM: the model argument as given)
    activations: str | None = None  # --quantization-activations (None: each format's default)

    def stage_args(self) -> list[str]:
        """The MODEL and flags a stage (or any service) of this source is started with."""
        activations = ["--quantization-activations", self.activations] if self.activations else []
        if self.gguf_file is not None:
            return [str(self.gguf_file), "--tokenizer", str(self.model_dir), "--quantization", "gguf", *activations]
        method = ["--quantization", self.quantization] if self.quantization else []
        return [str(self.model_dir), *method, *activations]


def resolve_source(model: str | None, tokenizer: str | None = None, quantization: str | None = None,
                   activations: str | None = None) -> ModelSource:
    """`activations`: --quantization-activations, passed on to the stages."""
    return replace(_resolve(model, tokenizer, quantization), activations=activations)


def _resolve(model: str | None, tokenizer: str | None, quantization: str | None) -> ModelSource:
    is_gguf = model is not None and str(model).endswith(".gguf")
    if quantization == "gguf" and model is None:
        return ModelSource(_config_dir(tokenizer, default_model_dir), gguf_path(), "gguf", DEFAULT_MODEL_NAME)
    if model is not None and is_gguf:
        path = Path(model).expanduser()
        if not path.is_file():
            raise StagemeshError(f"{model} is not a file")
        if quantization not in (None, "gguf"):
            raise StagemeshError(f"--quantization {quantization} takes an fp32/bf16 model directory; {model} is a "
                                 "GGUF file (served as it is quantised: --quantization gguf)")
        embedded = _is_embedded(path)
        if tokenizer is None and not embedded:
            raise StagemeshError(f"{model}: give --tokenizer DIR, the model directory with the config.json and "
                                 "tokenizer of this GGUF (stagemesh reads only the weights from the file)")
        model_dir = _config_dir(tokenizer, default_model_dir)
        name = DEFAULT_MODEL_NAME if embedded and tokenizer is None else str(model)
        return ModelSource(model_dir, path, "gguf", name)
    if quantization == "gguf":
        raise StagemeshError(f"--quantization gguf needs a .gguf file as the model (or no model: the embedded "
                             f"model's GGUF); {model} is not one")
    if tokenizer is not None:
        raise StagemeshError("--tokenizer goes with a .gguf model (its config and tokenizer); a model directory "
                             "has its own")
    model_dir = resolve_model(model)
    from stagemesh.core.default_model import served_model_name

    return ModelSource(model_dir, None, quantization, served_model_name(model, model_dir))


def _config_dir(tokenizer: str | None, default) -> Path:
    return default() if tokenizer is None else resolve_model(tokenizer)


def _is_embedded(path: Path) -> bool:
    try:
        return path.resolve() == gguf_path().resolve()
    except StagemeshError:
        return False
