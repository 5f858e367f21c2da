"""A model's generation_config.json, read once for every service: the router takes its recommended sampling
(router.generation_config), every service its end-of-sequence ids, which vLLM adds to config.json's."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stagemesh.core.errors import StagemeshError

FILE = "generation_config.json"


def read(path: Path) -> dict[str, Any]:
    """The fields of a generation_config.json ({} where there is none); one that cannot be read as a JSON object
    stops start-up, naming the file (vLLM would skip it silently)."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise StagemeshError(f"{path} is not valid JSON ({err}): fix it, or move it away") from None
    if not isinstance(config, dict):
        raise StagemeshError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The end-of-sequence ids the model's generation_config.json names (eos_token_id: one or a list), which end
    a sequence as config.json's do (vLLM adds them to every request's stop ids unless it ignores EOS)."""
    path = Path(model_dir) / FILE
    eos = read(path).get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else [] if eos is None else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise StagemeshError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)
