"""Pooling models (vLLM's --runner pooling): what a server pools and how (PoolerConfig: --convert, --pooler-config,
a sentence-transformers pooling config, the checkpoint's score head), what one request asks (PoolingParams, carried
on SamplingParams.pooling), and the pooled output as it crosses processes (Pooled: float32 bytes, never pickled).

The tasks are vLLM's (0.11): embed (one vector per input), classify (the score head's probabilities), score (a
cross-encoder's relevance: classify's head, sigmoid on a single label), token_embed and token_classify (one row per
prompt token, or per step tag with STEP pooling). Imports no torch: the router and the scheduler use it.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagemesh.core.errors import StagemeshError

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
POOLING_TYPES = ("LAST", "MEAN", "CLS", "ALL", "STEP")
TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")
# the tasks each conversion serves (vLLM 0.11's table; score: a cross-encoder's single label only)
TASKS_OF = {"embed": ("embed", "token_embed"), "classify": ("classify", "score", "token_classify"),
            "reward": ("token_classify",)}
# --pooler-config keys honoured; vLLM's others are refused by name (not built here)
POOLER_KEYS = ("pooling_type", "normalize", "dimensions", "activation", "softmax", "step_tag_id",
               "returned_token_ids")
POOLER_REFUSED = ("enable_chunked_processing", "max_embed_len", "logit_bias")
_SEQ_CLS_SUFFIXES = ("ForSequenceClassification", "ClassificationModel")
_REWARD_SUFFIXES = ("ForRewardModeling", "RewardModel")
_EMBED_SUFFIXES = ("ForTextEncoding", "EmbeddingModel", "Model")


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request's task and switches (vLLM's PoolingParams), defaults settled by the router."""
    task: str
    dimensions: int | None = None  # embed: keep the first N (Matryoshka), before normalizing
    normalize: bool = True  # embed, token_embed: L2-normalized
    activation: bool = True  # classify, score, token_classify: softmax (sigmoid for a single label)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise StagemeshError(f"pooling task {self.task!r} is not one of {', '.join(TASKS)}")
        if self.dimensions is not None and not 1 <= self.dimensions < 2**31:
            raise StagemeshError("Dimensions must be greater than 0")


@dataclass(frozen=True)
class Pooled:
    """A pooled output: float32 values, little endian, row-major in `shape` ([dim], or [rows, dim] for a token
    task)."""
    shape: tuple[int, ...]
    data: bytes

    def __post_init__(self) -> None:
        count = 1
        for n in self.shape:
            count *= n
        if len(self.data) != 4 * count:
            raise StagemeshError(f"pooled output of shape {list(self.shape)} has {len(self.data)} bytes")

    def values(self) -> list:
        """As nested lists of floats."""
        flat = list(struct.unpack(f"<{len(self.data) // 4}f", self.data))
        if len(self.shape) <= 1:
            return flat
        width = self.shape[-1]
        return [flat[i:i + width] for i in range(0, len(flat), width)]


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling server pools: its conversion, pooling type and defaults, and what its model's config says
    (labels, Matryoshka dimensions). Built once per service by resolve(), the same on stages and routers."""
    convert: str  # embed | classify | reward
    pooling_type: str = "LAST"
    normalize: bool = True  # the default of embed / token_embed requests
    activation: bool = True  # the default of classify / score / token_classify requests
    dimensions: int | None = None  # the default embed dimensions (--pooler-config)
    step_tag_id: int | None = None  # STEP: the rows of the tokens equal to it (None: every token)
    returned_token_ids: tuple[int, ...] = ()  # STEP: these columns of each row (empty: all)
    hidden_size: int = 0
    id2label: dict[int, str] = field(default_factory=dict)  # classify: the score head's labels
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()  # empty with is_matryoshka: any dimensions

    @property
    def tasks(self) -> tuple[str, ...]:
        tasks = TASKS_OF[self.convert]
        if self.convert == "classify" and self.num_labels != 1:  # only a single label scores (vLLM)
            tasks = tuple(t for t in tasks if t != "score")
        return tasks

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def token_task(self) -> str:
        """/pooling's task when a request names none: the model's token-wise one (its raw hidden states)."""
        return "token_embed" if "token_embed" in self.tasks else "token_classify"


def runner_of(architectures: list[str], runner: str) -> str:
    """--runner auto: pooling for a classification, reward or embedding architecture (vLLM's rule), else generate."""
    if runner != "auto":
        return runner
    pooling = _SEQ_CLS_SUFFIXES + _REWARD_SUFFIXES
    return "pooling" if any(a.endswith(pooling) for a in architectures) else "generate"


def convert_of(architectures: list[str], convert: str) -> str:
    """--convert auto under the pooling runner: by the architecture's name, as vLLM's table; a generative model
    converts to embed."""
    if convert not in ("auto", "none"):
        return convert
    for arch in architectures:
        if arch.endswith(_SEQ_CLS_SUFFIXES):
            return "classify"
        if arch.endswith(_REWARD_SUFFIXES):
            return "reward"
    return "embed"


def resolve(model_dir: str | Path, raw: dict[str, Any], runner: str = "auto", convert: str = "auto",
            pooler_config: str | None = None) -> PoolerConfig | None:
    """The pooler a service runs (None: the generate runner), or a start-up error naming the flag or field.
    Precedence as vLLM's: the conversion's defaults, then a sentence-transformers config, then --pooler-config."""
    if runner not in RUNNERS:
        raise StagemeshError(f"--runner {runner} is not one of {', '.join(RUNNERS)}")
    if convert not in CONVERTS:
        raise StagemeshError(f"--convert {convert} is not one of {', '.join(CONVERTS)}")
    archs = list(raw.get("architectures") or [])
    if runner_of(archs, runner) == "generate":
        if convert not in ("auto", "none"):
            raise StagemeshError(f"--convert {convert} converts a model for pooling: it needs --runner pooling")
        if pooler_config is not None:
            raise StagemeshError("--pooler-config configures the pooling runner: it needs --runner pooling")
        if any(a.endswith(_SEQ_CLS_SUFFIXES + _REWARD_SUFFIXES) for a in archs):
            raise StagemeshError(f"{', '.join(archs)} has no LM head to generate with: serve it with --runner pooling")
        return None
    kind = convert_of(archs, convert)
    values: dict[str, Any] = {"pooling_type": "ALL" if kind == "reward" else "LAST"}
    values.update(_sentence_transformers(Path(model_dir)))
    values.update(_pooler_flag(pooler_config))
    return _build(kind, values, raw)


def _build(kind: str, values: dict[str, Any], raw: dict[str, Any]) -> PoolerConfig:
    pooling_type = str(values["pooling_type"]).upper()
    if pooling_type not in POOLING_TYPES:
        raise StagemeshError(f"--pooler-config pooling_type {values['pooling_type']!r} is not one of "
                             f"{', '.join(POOLING_TYPES)}")
    token_wise = pooling_type in ("ALL", "STEP")
    if kind == "reward" and not token_wise:
        raise StagemeshError(f"--convert reward pools every token (ALL or STEP); pooling_type {pooling_type} is a "
                             "sequence pooling: use --convert embed or classify for it")
    if kind != "reward" and token_wise:
        raise StagemeshError(f"pooling_type {pooling_type} pools every token: it goes with --convert reward (embed "
                             "and classify models give every token's output through /pooling's token tasks)")
    if pooling_type != "STEP" and ("step_tag_id" in values or "returned_token_ids" in values):
        raise StagemeshError("--pooler-config step_tag_id and returned_token_ids go with pooling_type STEP")
    dims = raw.get("matryoshka_dimensions")
    labels = raw.get("id2label") or ({str(i): f"LABEL_{i}" for i in range(int(raw["num_labels"]))}
                                     if "num_labels" in raw else {})
    if kind == "classify" and not labels:
        raise StagemeshError("--convert classify needs the model's labels (config.json id2label or num_labels)")
    activation = values.get("activation", values.get("softmax", True))
    return PoolerConfig(
        kind, pooling_type, normalize=bool(values.get("normalize", True)), activation=bool(activation),
        dimensions=values.get("dimensions"), step_tag_id=values.get("step_tag_id"),
        returned_token_ids=tuple(values.get("returned_token_ids") or ()), hidden_size=int(raw.get("hidden_size", 0)),
        id2label={int(k): str(v) for k, v in labels.items()} if kind == "classify" else {},
        is_matryoshka=bool(raw.get("is_matryoshka") or dims), matryoshka_dimensions=tuple(dims or ()))


def _pooler_flag(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as err:
        raise StagemeshError(f"--pooler-config must be JSON: {err}") from None
    if not isinstance(value, dict):
        raise StagemeshError(f"--pooler-config takes an object, got {text}")
    for key in value:
        if key in POOLER_REFUSED:
            raise StagemeshError(f"--pooler-config {key} is not built here (honoured: {', '.join(POOLER_KEYS)})")
        if key not in POOLER_KEYS:
            raise StagemeshError(f"--pooler-config has no field {key!r} (vLLM's honoured here: "
                                 f"{', '.join(POOLER_KEYS)})")
    for key in ("normalize", "activation", "softmax"):
        if key in value and not isinstance(value[key], bool):
            raise StagemeshError(f"--pooler-config {key} must be true or false")
    for key in ("dimensions", "step_tag_id"):
        if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < 0):
            raise StagemeshError(f"--pooler-config {key} must be a non-negative integer")
    ids = value.get("returned_token_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids)):
        raise StagemeshError("--pooler-config returned_token_ids must be a list of non-negative integers")
    return {k: v for k, v in value.items() if v is not None}


# sentence-transformers' pooling modes, in the order vLLM reads them; the others are not built here
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_REFUSED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


def _sentence_transformers(model_dir: Path) -> dict[str, Any]:
    """The pooling type and normalization a sentence-transformers model declares (modules.json: its Pooling
    module's config, and whether a Normalize module follows), as vLLM reads them; {} without one."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return {}
    try:
        modules = json.loads(modules_file.read_text())
    except ValueError as err:
        raise StagemeshError(f"{modules_file} is not JSON: {err}") from None
    found: dict[str, Any] = {}
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", ""))
        if kind.endswith("Normalize"):
            found["normalize"] = True
        elif kind.endswith("Pooling"):
            found.update(_st_pooling(model_dir / str(module.get("path", "")) / "config.json"))
    if found and "normalize" not in found:
        found["normalize"] = False
    return found


def _st_pooling(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    for mode in _ST_REFUSED:
        if config.get(mode):
            raise StagemeshError(f"{path}: sentence-transformers' {mode} is not built here (CLS, MEAN and LAST are)")
    for mode, name in _ST_MODES.items():
        if config.get(mode):
            return {"pooling_type": name}
    return {}
