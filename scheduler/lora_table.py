"""--enable-lora on a replica: the adapters it serves, name -> directory. Its --lora-modules to start with, then
those loaded and unloaded at run time (scheduler.lora_admin). One table, shared: the scheduler admits a request
for an adapter in it, the rendezvous refuses a stage with fewer slots, RegisterStage tells a stage the adapters it
must serve, and the stats tell the routers."""
from __future__ import annotations

from dataclasses import dataclass, field

from stagemesh.core.errors import StagemeshError


@dataclass
class LoRATable:
    max_loras: int = 1  # adapters running at once (the stages' slots)
    max_lora_rank: int = 16
    allowed_paths: tuple[str, ...] = ()  # --allowed-local-lora-path: where run-time loads may read from
    adapters: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise StagemeshError(f"--max-loras must be >= 1, got {self.max_loras}")

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    def lacking(self, served: tuple[str, ...] | list[str]) -> list[str]:
        """The adapters of the table a stage that serves `served` lacks."""
        return [name for name in self.adapters if name not in served]
