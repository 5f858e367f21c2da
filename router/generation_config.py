"""The model's recommended sampling, read from its generation_config.json as vLLM reads it
(`--generation-config auto|vllm|FOLDER`, `--override-generation-config JSON`): the defaults of a request's
temperature, top_p, top_k, min_p, repetition_penalty and max_tokens (the file's max_new_tokens) wherever the
request leaves them unset. A request's own value always wins; max_tokens alone may also be capped, as vLLM
caps it (SamplingDefaults.max_tokens_cap)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagemesh.core.errors import StagemeshError
from stagemesh.core.generation_config import FILE, eos_token_ids, read
from stagemesh.core.sampling_params import InvalidParameter, check_float, check_int

log = logging.getLogger("stagemesh.router")
# the fields vLLM takes from a generation config (ModelConfig.get_diff_sampling_param), all others ignored
FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")
MODES = ("auto", "vllm")  # else a folder


@dataclass(frozen=True)
class SamplingDefaults:
    """values: each default, by SamplingParams' names (max_new_tokens is max_tokens); source: where they came from
    (for the log); max_tokens_cap: vLLM's override_max_tokens, a bound on every request's max_tokens, its own too:
    a folder's max_new_tokens (--generation-config FOLDER), else --override-generation-config's."""
    values: dict[str, Any] = field(default_factory=dict)
    source: str = "vllm"
    max_tokens_cap: int | None = None

    def fill(self, given: dict[str, Any], neutral: dict[str, Any] | None = None) -> dict[str, Any]:
        """A request's sampling values with the default of each one it leaves out: the model's, else the door's
        neutral value (`neutral`: OpenAI's temperature 1.0 for HTTP), else SamplingParams' own."""
        model = {k: v for k, v in self.values.items() if k != "max_tokens"}
        return {**(neutral or {}), **model, **given}

    @property
    def max_tokens(self) -> int | None:
        """The default max_tokens of a request that sets none (None: the room its context leaves)."""
        return self.values.get("max_tokens")

    def describe(self) -> str:
        if not self.values:
            return f"no default sampling parameters from {self.source}: vLLM's neutral defaults"
        cap = f"; every request's max_tokens capped at {self.max_tokens_cap}" if self.max_tokens_cap else ""
        return f"Using default sampling params from {self.source}: {self.values}{cap}"


def load(model_dir: str | Path, mode: str = "auto", override: str | None = None) -> SamplingDefaults:
    """The defaults `--generation-config mode` and `--override-generation-config override` give for the model in
    `model_dir`. A file or value that cannot be honoured is a start-up error naming it; a missing file is none."""
    overrides = parse_override(override)
    if mode == "vllm":
        config, source = {}, "vllm"
    else:
        folder = Path(model_dir) if mode == "auto" else _folder(mode, Path(model_dir))
        config, source = read(folder / FILE), ("model" if mode == "auto" else str(folder))
    config.update(overrides)
    values = {("max_tokens" if k == "max_new_tokens" else k): _checked(k, config[k], source)
              for k in FIELDS if config.get(k) is not None}
    # vLLM's override_max_tokens: a folder's max_new_tokens, else the override's (values hold it, applied last)
    capped = mode not in MODES or overrides.get("max_new_tokens") is not None
    cap = values.get("max_tokens") if capped else None
    if overrides:
        source += " with --override-generation-config"
    return SamplingDefaults(values, source, int(cap) if cap is not None else None)


def report(defaults: SamplingDefaults) -> SamplingDefaults:
    """The start-up log's lines on the defaults, as vLLM's (its warning, then what was taken)."""
    if defaults.values and defaults.source.startswith("model"):
        log.warning("Default sampling parameters have been overridden by the model's Hugging Face generation config "
                    "recommended from the model creator. If this is not intended, please relaunch with "
                    "`--generation-config vllm`.")
    log.info("%s", defaults.describe())
    return defaults


def parse_override(text: str | None) -> dict[str, Any]:
    """--override-generation-config: a JSON object of the fields vLLM takes from a generation config (another key
    would be ignored, so it is refused)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as err:
        raise StagemeshError(f"--override-generation-config must be JSON: {err}") from None
    if not isinstance(value, dict):
        raise StagemeshError(f"--override-generation-config takes a JSON object, got {text}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise StagemeshError(f"--override-generation-config: {', '.join(unknown)} is not a sampling default this "
                             f"server applies (it takes {', '.join(FIELDS)})")
    return value


def _folder(mode: str, model_dir: Path) -> Path:
    """--generation-config FOLDER: its file's sampling is honoured; end-of-sequence ids other than the model's
    (vLLM would stop at them too) are refused, since the schedulers stop at the model's own."""
    folder = Path(mode).expanduser()
    if not folder.is_dir():
        raise StagemeshError(f"--generation-config {mode}: not 'auto', 'vllm' or a folder")
    if not (folder / FILE).is_file():
        raise StagemeshError(f"--generation-config {mode}: the folder has no {FILE}")
    from stagemesh.core.model_config import ModelConfig

    extra = set(eos_token_ids(folder)) - set(ModelConfig.from_path(model_dir).eos_token_ids)
    if extra:
        raise StagemeshError(f"--generation-config {mode}: its eos_token_id names {sorted(extra)}, which are not "
                             "the model's end-of-sequence ids; other ids are not served yet (put them in the "
                             f"model's own {FILE}, or request them as stop_token_ids)")
    return folder


def _checked(name: str, value: Any, source: str) -> float | int:
    """A default checked by the rules a request's own value meets, so that no request fails for it."""
    try:
        if name == "max_new_tokens":
            return check_int("max_tokens", value)
        if name == "top_k":
            return check_int(name, value)
        check_float(name, value)
        return float(value)  # (as written, for the log: requests' values are rounded to the wire's float32 alike)
    except InvalidParameter as err:
        raise StagemeshError(f"the generation config ({source}) sets {name} = {value!r}, which no request may: "
                             f"{str(err).replace(repr('max_tokens'), repr(name))}") from None
