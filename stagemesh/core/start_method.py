"""How stagemesh starts its worker processes: STAGEMESH_WORKER_MULTIPROC_METHOD (vLLM's VLLM_WORKER_MULTIPROC_METHOD
plays the same part). `spawn` (the default): a fresh interpreter each. `forkserver`: `serve`'s children forked from
a warm interpreter (stagemesh.entry.forkserver), and a stage's TP followers forked from the stage
(stage_worker.follower_start)."""
from __future__ import annotations

import os

from stagemesh.core.errors import StagemeshError

METHOD_ENV = "STAGEMESH_WORKER_MULTIPROC_METHOD"
METHODS = ("spawn", "forkserver")


def method() -> str:
    """The start method the environment asks for; a value that is not one of METHODS is refused by name."""
    value = os.environ.get(METHOD_ENV, "spawn") or "spawn"
    if value not in METHODS:
        raise StagemeshError(f"{METHOD_ENV}={value!r} is not one of {', '.join(METHODS)}")
    return value
