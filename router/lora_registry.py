"""The LoRA adapters a router serves (--enable-lora): its --lora-modules, those it loaded at run time (vLLM's
/v1/load_lora_adapter, router.lora_api), and those its replicas report in their stats (another router loaded
them). A request's model may name any of them; it goes only to a replica that serves its adapter."""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from stagemesh.core.lora import ALLOWED_PATH_FLAG, LoRAError, LoRAModule


@dataclass
class LoRARegistry:
    modules: tuple[LoRAModule, ...] = ()  # --lora-modules
    enabled: bool = False  # --enable-lora
    allowed_paths: tuple[str, ...] = ()  # --allowed-local-lora-path
    loaded: dict[str, str] = field(default_factory=dict)  # name -> path: loaded at run time through this router
    unloading: set[str] = field(default_factory=set)  # being unloaded: no new request takes them
    unloaded: set[str] = field(default_factory=set)  # unloaded through this router (and not loaded since)
    replica_set: object = None  # router.replica_set.ReplicaSet (its replicas report their adapters)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load or unload at a time
    sync_task: asyncio.Task | None = None  # router.lora_api.sync, when it runs

    def check_path(self, name: str, path: str) -> None:
        """A client's lora_path, checked as its words go (the schedulers resolve it where the files are)."""
        if not self.allowed_paths:
            raise LoRAError(f"LoRA adapter {name!r}: loading an adapter at run time reads a path a client gave; "
                            f"start the server with {ALLOWED_PATH_FLAG} DIR to name the directories it may read "
                            f"adapters from")
        norm = os.path.normpath(path)
        if not os.path.isabs(path) or not any(os.path.commonpath([norm, os.path.normpath(root)])
                                              == os.path.normpath(root) for root in self.allowed_paths):
            raise LoRAError(f"LoRA adapter {name!r}: lora_path {path[:256]!r} is not an absolute path under "
                            f"{ALLOWED_PATH_FLAG} ({', '.join(self.allowed_paths)})")

    def paths(self) -> dict[str, str]:
        """Every adapter a request may name now, with its directory."""
        found = {m.name: m.path for m in self.modules}
        for r in getattr(self.replica_set, "replicas", ()):
            found.update(r.lora_adapters)
        # (one this router unloaded stays so, even on a restarted replica that serves it again until the sync)
        found = {name: path for name, path in found.items() if name not in self.unloaded}
        found.update(self.loaded)
        return {name: path for name, path in found.items() if name not in self.unloading}

    def names(self) -> tuple[str, ...]:
        return tuple(self.paths())

    def parent(self, name: str) -> str | None:
        """The base model an adapter names for itself (--lora-modules' base_model_name), if any."""
        return next((m.base_model_name for m in self.modules if m.name == name), None)


def serves(replica, lora_name: str) -> bool:
    """Whether a request for `lora_name` may go to the replica: it reports the adapter, or has not reported its
    adapters yet (its first stats: the --lora-modules every replica starts with)."""
    return not lora_name or not replica.lora_reported or lora_name in replica.lora_adapters
