"""vLLM's --speculative-config: parsed, checked and refused by name where stagemesh does not build it.

Three methods are built (docs/speculative-decoding.md): "ngram" (prompt lookup in the request's own tokens,
proposed by the scheduler), "draft_model" (a smaller model on the last stage, with a KV cache of its own) and
"deepseek_mtp" (DeepSeek-V3's own multi-token-prediction layer on the last stage, stage_worker.mtp: a draft model
that reads the target's hidden states). Every other method and every key not listed in ACCEPTED is refused with
an error that names it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from stagemesh.core.errors import StagemeshError

MAX_NUM_SPECULATIVE_TOKENS = 32  # a bound every stage checks a step's drafts against
BUILT = ("ngram", "draft_model", "deepseek_mtp")
# vLLM's other methods: refused by name
NOT_BUILT = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix", "ngram_gpu", "custom_class",
             "extract_hidden_states", "dflash", "dspark")
ASYNC_WITH_SPECULATION = (
    "--async-scheduling with --speculative-config is not supported: a step scheduled ahead would have to "
    "guess how many of the drafts of the step in flight are accepted (run without --async-scheduling)")
ACCEPTED = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
            "draft_tensor_parallel_size", "draft_sample_method", "rejection_sample_method")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram", "draft_model" or "deepseek_mtp"
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram: the shortest suffix looked up in the request's tokens
    prompt_lookup_max: int = 0  # ngram: the longest
    model: str | None = None  # draft_model: the draft's model directory
    # draft_model: "greedy" (vLLM's default: the draft proposes its argmax, verified as one-hot) or
    # "probabilistic" (the draft samples; rejection sampling against its distribution)
    draft_sample_method: str = "greedy"

    @property
    def is_ngram(self) -> bool:
        return self.method == "ngram"

    @property
    def uses_draft_model(self) -> bool:
        """Drafts proposed on the last stage by a model with a KV cache of its own: a draft model, or the target's
        MTP layer (the scheduler and the stages treat both alike)."""
        return self.method in ("draft_model", "deepseek_mtp")

    @property
    def is_mtp(self) -> bool:
        return self.method == "deepseek_mtp"

    def to_json(self) -> str:
        """The flag's value that gives this config again (serve passes it to its children)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None and
                           not (k.startswith("prompt_lookup") and not self.is_ngram) and
                           not (k == "draft_sample_method" and not self.method == "draft_model")})

    def describe(self) -> str:
        if self.is_mtp:
            return f"deepseek_mtp (the model's MTP layer), {self.num_speculative_tokens} tokens"
        if self.is_ngram:
            return (f"ngram, {self.num_speculative_tokens} tokens, prompt lookup "
                    f"{self.prompt_lookup_min}..{self.prompt_lookup_max}")
        return f"draft model {self.model}, {self.num_speculative_tokens} tokens, {self.draft_sample_method} drafts"


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """The config of --speculative-config JSON (or a dict), None for none; raises StagemeshError naming
    what is wrong or not built."""
    if text is None or text == "":
        return None
    raw = text
    if isinstance(text, str):
        try:
            raw = json.loads(text)
        except ValueError as err:
            raise StagemeshError(f"--speculative-config is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise StagemeshError("--speculative-config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    unknown = sorted(set(raw) - set(ACCEPTED))
    if unknown:
        raise StagemeshError(f"--speculative-config key(s) {', '.join(map(repr, unknown))} are not supported "
                             f"(stagemesh takes {', '.join(ACCEPTED)})")
    method = _method(raw)
    k = _positive_int(raw, "num_speculative_tokens", required=True)
    assert k is not None  # (required)
    if k > MAX_NUM_SPECULATIVE_TOKENS:
        raise StagemeshError(f"--speculative-config num_speculative_tokens {k}: at most "
                             f"{MAX_NUM_SPECULATIVE_TOKENS} are supported")
    if raw.get("rejection_sample_method", "standard") != "standard":
        raise StagemeshError(f"--speculative-config rejection_sample_method {raw['rejection_sample_method']!r} is "
                             "not supported (only vLLM's default, \"standard\")")
    if method == "ngram":
        return _ngram(raw, k)
    if method == "deepseek_mtp":
        return _mtp(raw, k)
    return _draft_model(raw, k)


def _method(raw: dict) -> str:
    method, model = raw.get("method"), raw.get("model")
    if method is None:  # vLLM's inference: a model named ngram is the n-gram method, any other a draft model
        if model is None:
            raise StagemeshError('--speculative-config needs a "method" ("ngram") or a draft "model"')
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method == "[ngram]":
        method = "ngram"
    if method in NOT_BUILT or (isinstance(method, str) and method.endswith("_mtp") and method not in BUILT):
        raise StagemeshError(f"--speculative-config method {method!r} is not supported: stagemesh builds "
                             f"{', '.join(BUILT)} (EAGLE, other models' MTP, Medusa, MLP speculators and suffix "
                             "decoding need model heads or trees it does not have)")
    if method not in BUILT:
        raise StagemeshError(f"--speculative-config method {method!r} is unknown (stagemesh builds "
                             f"{' and '.join(BUILT)})")
    return method


def _ngram(raw: dict, k: int) -> SpeculativeConfig:
    for key in ("draft_tensor_parallel_size", "draft_sample_method"):
        if key in raw:
            raise StagemeshError(f"--speculative-config {key} applies to a draft model, not to ngram")
    if raw.get("model") not in (None, "ngram", "[ngram]"):
        raise StagemeshError("--speculative-config: method ngram takes no draft model")
    low = _positive_int(raw, "prompt_lookup_min")
    high = _positive_int(raw, "prompt_lookup_max")
    # vLLM's defaults: 5 and 5; one of them given: both that
    low, high = low or high or 5, high or low or 5
    if low > high:
        raise StagemeshError(f"--speculative-config prompt_lookup_min={low} must be <= prompt_lookup_max={high}")
    return SpeculativeConfig("ngram", k, low, high)


def _mtp(raw: dict, k: int) -> SpeculativeConfig:
    """The target's own MTP layer: no draft model to name, argmax drafts (the stage checks that the checkpoint has
    the layer: stage_worker.mtp)."""
    for key in ("prompt_lookup_min", "prompt_lookup_max", "model"):
        if key in raw:
            raise StagemeshError(f"--speculative-config {key} does not apply to deepseek_mtp (its drafts come from the "
                                 "target's own MTP layer)")
    if raw.get("draft_tensor_parallel_size", 1) != 1:
        raise StagemeshError(f"--speculative-config draft_tensor_parallel_size {raw['draft_tensor_parallel_size']!r} "
                             "is not supported: the MTP layer runs whole on the last stage's TP rank 0 (1)")
    if raw.get("draft_sample_method", "greedy") != "greedy":
        raise StagemeshError(f"--speculative-config draft_sample_method {raw['draft_sample_method']!r} is not built "
                             "for deepseek_mtp (its drafts are the MTP layer's argmax: greedy)")
    return SpeculativeConfig("deepseek_mtp", k)


def _draft_model(raw: dict, k: int) -> SpeculativeConfig:
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in raw:
            raise StagemeshError(f"--speculative-config {key} applies to the ngram method, not to a draft model")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise StagemeshError('--speculative-config method draft_model needs "model": the draft\'s model directory')
    if not (Path(model) / "config.json").is_file():
        raise StagemeshError(f"--speculative-config model {model!r} is not a model directory (no config.json); "
                             "nothing is fetched from a hub")
    tp = raw.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise StagemeshError(f"--speculative-config draft_tensor_parallel_size {tp!r} is not supported: the draft "
                             "runs whole on the last stage's TP rank 0 (1)")
    sample = raw.get("draft_sample_method", "greedy")
    if sample not in ("greedy", "probabilistic"):
        raise StagemeshError(f"--speculative-config draft_sample_method {sample!r} must be greedy or probabilistic")
    return SpeculativeConfig("draft_model", k, model=str(Path(model)), draft_sample_method=sample)


def _positive_int(raw: dict, key: str, required: bool = False) -> int | None:
    value = raw.get(key)
    if value is None:
        if required:
            raise StagemeshError(f"--speculative-config needs {key}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StagemeshError(f"--speculative-config {key} must be an integer >= 1, got {value!r}")
    return value
