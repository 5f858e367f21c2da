"""--kv-cache-dtype as vLLM has it: auto (the model's dtype), fp8 (= fp8_e4m3, float8_e4m3fn) or fp8_e5m2
(float8_e5m2). The names every service agrees on, without torch (the scheduler and the planner need them too);
what a stage does with them is stage_worker.kv_cache and stage_worker.kv_scales."""
from __future__ import annotations

from stagemesh.core.errors import StagemeshError

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's "fp8" is e4m3 (on CUDA and CPU alike)
TORCH_NAMES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def canonical(name: str | None) -> str:
    """auto, fp8_e4m3 or fp8_e5m2 (fp8 is fp8_e4m3); anything else is refused by name."""
    name = "auto" if name is None else name
    if name not in KV_CACHE_DTYPES:
        raise StagemeshError(f"--kv-cache-dtype {name!r} is not built; stagemesh has {', '.join(KV_CACHE_DTYPES)} "
                             "(vLLM's: auto is the model's dtype, fp8 is fp8_e4m3)")
    return ALIASES.get(name, name)


def is_fp8(name: str | None) -> bool:
    return canonical(name) != "auto"


def element_bytes(name: str | None, model_dtype_bytes: int) -> int:
    """Bytes of one cached K or V element: 1 for fp8, else the model's."""
    return 1 if is_fp8(name) else model_dtype_bytes


def check_attention(name: str | None, cfg) -> None:
    """Refuse, by name, an fp8 cache for an attention whose fp8 cache is not built (multi-head latent attention:
    its cache is a latent, not per-layer k and v tensors). cfg: a stagemesh.core.model_config.ModelConfig."""
    if is_fp8(name) and cfg.family.attention == "mla":
        raise StagemeshError(f"--kv-cache-dtype {name} with multi-head latent attention ({cfg.model_type}) is not "
                             "built yet: the fp8 cache quantises per-layer k and v tensors; MLA's latent cache takes "
                             "--kv-cache-dtype auto")
