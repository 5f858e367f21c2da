"""--responses-store, --responses-store-size and --responses-store-ttl: checked together, and the store they name
opened. The backends stand on the interface (router.responses_api.store); this module, above both, chooses."""
from __future__ import annotations

from router.responses_api.memory_store import MemoryStore
from router.responses_api.redis_store import RedisStore, check_url
from router.responses_api.store import MEMORY, REDIS_SCHEMES, ResponseStore

DEFAULT_SIZE = 1000
DEFAULT_TTL_S = 3600.0


def check_store_options(spec: str, size: int | None, ttl_s: float | None) -> None:
    """ValueError naming the flag when --responses-store, --responses-store-size (None: not given) and
    --responses-store-ttl (None: not given) do not go together."""
    if spec == MEMORY:
        if ttl_s is not None:
            raise ValueError("--responses-store-ttl applies to a redis store: the memory store keeps the last "
                             "--responses-store-size responses")
        if size is not None and size < 1:
            raise ValueError("--responses-store-size must be >= 1")
        return
    if not spec.startswith(REDIS_SCHEMES):
        raise ValueError(f"--responses-store must be '{MEMORY}' or a Redis URL ({', '.join(REDIS_SCHEMES)}); "
                         f"got {spec!r}")
    if size is not None:
        raise ValueError("--responses-store-size bounds the memory store; a redis store is bounded by "
                         "--responses-store-ttl (and by the server's maxmemory)")
    if ttl_s is not None and not ttl_s >= 0.001:
        raise ValueError(f"--responses-store-ttl must be > 0 seconds; got {ttl_s}")
    check_url(spec)


def open_store(spec: str, size: int | None = None, ttl_s: float | None = None) -> ResponseStore:
    """The store --responses-store names (checked first: ValueError); it connects on first use."""
    check_store_options(spec, size, ttl_s)
    if spec == MEMORY:
        return MemoryStore(DEFAULT_SIZE if size is None else size)
    return RedisStore(spec, DEFAULT_TTL_S if ttl_s is None else ttl_s)
