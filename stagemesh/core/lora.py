"""LoRA adapters (vLLM's multi-LoRA serving): what a stage is told to serve, and an adapter directory's config.

An adapter is a PEFT directory: adapter_config.json (r, lora_alpha, target_modules, use_rslora, ...) and
adapter_model.safetensors (lora_A / lora_B per targeted linear). This module reads and checks the config and
the flags that name adapters, and imports no torch (the router reads it too); the weights are the stage's
(stage_worker.lora). Every error names the adapter.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from stagemesh.core.errors import StagemeshError

# vLLM's choices for --max-lora-rank
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# the linears an adapter may target: attention's and the dense MLP's (vLLM's names for Llama-family models)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


class LoRAError(StagemeshError):
    """An adapter that cannot be served as asked; the message names it and says why."""


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry: the name requests select it by (their `model`), and its directory."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str]) -> list[LoRAModule]:
    """--lora-modules entries, in vLLM's two forms: `name=path`, or JSON {"name", "path", "base_model_name"}.
    Names are unique and sane (they appear in URLs and logs)."""
    modules: list[LoRAModule] = []
    for value in values:
        value = value.strip()
        if value.startswith("{"):
            try:
                spec = json.loads(value)
            except json.JSONDecodeError as err:
                raise LoRAError(f"--lora-modules {value!r}: not valid JSON ({err.msg})") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                    or not isinstance(spec.get("path"), str) or set(spec) - {"name", "path", "base_model_name"} \
                    or not isinstance(spec.get("base_model_name", ""), (str, type(None))):
                raise LoRAError(f"--lora-modules {value!r}: the JSON form is {{\"name\": ..., \"path\": ..., "
                                f"\"base_model_name\": ... (optional)}}")
            module = LoRAModule(spec["name"], spec["path"], spec.get("base_model_name"))
        else:
            name, sep, path = value.partition("=")
            if not sep or not path:
                raise LoRAError(f"--lora-modules {value!r}: expected name=path or the JSON form")
            module = LoRAModule(name, path)
        if not _NAME.match(module.name):
            raise LoRAError(f"--lora-modules: the adapter name {module.name!r} must be 1-128 letters, digits or "
                            f"._:/@+- and start with a letter or digit")
        if any(m.name == module.name for m in modules):
            raise LoRAError(f"--lora-modules: the adapter name {module.name!r} is given twice")
        modules.append(module)
    return modules


def check_adapter_name(name: str, where: str = "lora_name") -> str:
    """A sane adapter name (it appears in URLs, logs and metrics labels), or LoRAError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise LoRAError(f"{where}: the adapter name {str(name)[:64]!r} must be 1-128 letters, digits or ._:/@+- "
                        f"and start with a letter or digit")
    return name


ALLOWED_PATH_FLAG = "--allowed-local-lora-path"


def allowed_path(path: str, roots: tuple[str, ...] | list[str], name: str) -> str:
    """A client's lora_path (a hostile input: the server would read what it names), resolved, symlinks and all,
    and inside one of the roots an operator allowed; LoRAError otherwise."""
    if not roots:
        raise LoRAError(f"LoRA adapter {name!r}: loading an adapter at run time reads a path a client gave; start "
                        f"the server with {ALLOWED_PATH_FLAG} DIR to name the directories it may read adapters from")
    if not isinstance(path, str) or not path or "\0" in path or len(path) > 4096 or not os.path.isabs(path):
        raise LoRAError(f"LoRA adapter {name!r}: lora_path must be an absolute path")
    real = os.path.realpath(path)
    for root in roots:
        top = os.path.realpath(root)
        if os.path.commonpath([real, top]) == top:
            return real
    raise LoRAError(f"LoRA adapter {name!r}: lora_path {path!r} is outside {ALLOWED_PATH_FLAG} "
                    f"({', '.join(roots)})")


@dataclass(frozen=True)
class LoRALimits:
    """--max-loras (adapters in one batch, resident on the device), --max-lora-rank, --max-cpu-loras (adapters
    kept in host memory, >= max_loras)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise LoRAError(f"--max-loras {self.max_loras}: must be at least 1")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise LoRAError(f"--max-lora-rank {self.max_lora_rank}: must be one of "
                            f"{', '.join(map(str, MAX_LORA_RANKS))}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise LoRAError(f"--max-cpu-loras {self.max_cpu_loras} must be at least --max-loras {self.max_loras}")

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class AdapterConfig:
    name: str
    path: Path
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        """What PEFT multiplies B(Ax) by: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(name: str, path: str | Path, max_lora_rank: int) -> AdapterConfig:
    """The adapter's adapter_config.json, checked against what the stages run: a rank up to --max-lora-rank,
    target modules among TARGET_MODULES, no bias, no fan-in/fan-out layout, no DoRA, no extra modules."""
    path = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    if not path.is_dir():
        raise LoRAError(f"{where}: not a directory")
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / file).is_file():
            raise LoRAError(f"{where}: no {file} (a PEFT adapter directory has {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LoRAError(f"{where}: {CONFIG_FILE} cannot be read: {err}") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {raw.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{where}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise LoRAError(f"{where}: its rank {rank} is above --max-lora-rank {max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        raise LoRAError(f"{where}: target_modules as a regular expression ({targets!r}) is not supported; "
                        f"list the modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"{where}: target_modules must be a list of module names")
    unknown = sorted(set(targets) - set(TARGET_MODULES))
    if unknown:
        raise LoRAError(f"{where}: target modules {', '.join(unknown)} are not ones the model's LoRA layers have "
                        f"({', '.join(TARGET_MODULES)})")
    refused = {"bias": ("none", None), "fan_in_fan_out": (False, None), "use_dora": (False, None),
               "modules_to_save": (None, []), "layers_to_transform": (None,), "rank_pattern": ({}, None),
               "alpha_pattern": ({}, None)}
    for key, fine in refused.items():
        if raw.get(key, fine[0]) not in fine:
            raise LoRAError(f"{where}: {key}={raw[key]!r} is not supported")
    return AdapterConfig(name, path, rank, float(alpha), tuple(dict.fromkeys(targets)), bool(raw.get("use_rslora")))


def lora_from_args(args) -> tuple[LoRALimits, tuple[LoRAModule, ...]] | None:
    """The LoRA limits and adapters the flags give, or None without --enable-lora (--lora-modules without it is
    refused, never ignored)."""
    if not args.enable_lora:
        if args.lora_modules or args.allowed_local_lora_path:
            raise LoRAError(f"{'--lora-modules' if args.lora_modules else ALLOWED_PATH_FLAG} needs --enable-lora")
        return None
    for root in args.allowed_local_lora_path:
        if not os.path.isabs(root):
            raise LoRAError(f"{ALLOWED_PATH_FLAG} {root!r}: give an absolute directory")
    limits = LoRALimits(getattr(args, "max_loras", 1), getattr(args, "max_lora_rank", 16),
                        getattr(args, "max_cpu_loras", None))
    return limits, tuple(parse_lora_modules(args.lora_modules))


