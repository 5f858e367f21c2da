"""LoRA adapters loaded and unloaded at run time on one replica (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, which the router serves and passes to every replica).

A load is checked here first (a sane name; a path a client gave resolved inside --allowed-local-lora-path; its
adapter_config.json), then every stage of the replica, spares too, reads and checks the weights; only then does
the adapter enter the table (scheduler.lora_table), so no request runs before every stage serves it. A stage that
fails undoes the stages before it. A stage that joins later learns the table from its RegisterStage reply.

An unload is refused while a request of the replica (running, waiting, or kept for a resume) uses the adapter;
otherwise the adapter leaves the table (new requests for it are refused from then on) before the stages forget
it. One load or unload at a time.
"""
from __future__ import annotations

import asyncio
import logging

from scheduler.lora_table import LoRATable
from scheduler.pipeline import StageFailure
from stagemesh.core.lora import LoRAError, allowed_path, check_adapter_name, read_adapter_config

log = logging.getLogger("stagemesh.scheduler")


class AdapterExists(LoRAError):
    """A load of a name the replica serves from another path."""


class AdapterUnknown(LoRAError):
    """An unload of a name the replica does not serve."""


class AdapterInUse(LoRAError):
    """An unload of an adapter requests still use."""


class LoRAAdmin:
    def __init__(self, table: LoRATable | None, pipeline, requests):
        """pipeline: scheduler.grpc_pipeline.GrpcPipeline; requests(): the replica's requests now (each with its
        lora_name)."""
        self.table, self.pipeline, self.requests = table, pipeline, requests
        self._lock = asyncio.Lock()

    def _table(self, name: str) -> LoRATable:
        if self.table is None:
            raise LoRAError(f"LoRA adapter {name[:64]!r}: this replica runs without --enable-lora")
        check_adapter_name(name)
        return self.table

    async def load(self, name: str, path: str) -> bool:
        """Serve the adapter; False when it was served from this path already."""
        table = self._table(name)
        real = allowed_path(path, table.allowed_paths, name)
        async with self._lock:
            known = table.adapters.get(name)
            if known is not None:
                if known == real:
                    return False
                raise AdapterExists(f"The lora adapter '{name}' has already been loaded (from {known})")
            await asyncio.to_thread(read_adapter_config, name, real, table.max_lora_rank)
            done = []
            try:
                for stage in self.pipeline.stages_and_spares():
                    await self.pipeline.load_lora(stage, name, real)
                    done.append(stage)
            except StageFailure as err:
                for stage in done:
                    await self.pipeline.unload_lora(stage, name)
                raise LoRAError(str(err).replace(" failed: INVALID_ARGUMENT: ", ": ")) from None
            table.adapters[name] = real
            # a stage that registered meanwhile was told the table before the adapter was in it
            for stage in self.pipeline.stages_and_spares():
                if stage not in done:
                    try:
                        await self.pipeline.load_lora(stage, name, real)
                    except StageFailure as err:  # its next heartbeat tells it again
                        log.warning("LoRA adapter %r: %s", name, err)
        log.info("LoRA adapter %r loaded at run time from %s (%d stage(s))", name, real, len(done))
        return True

    async def unload(self, name: str) -> None:
        table = self._table(name)
        async with self._lock:
            if name not in table:
                raise AdapterUnknown(f"The lora adapter '{name}' cannot be found.")
            using = sum(1 for r in self.requests() if r.lora_name == name)
            if using:
                raise AdapterInUse(f"LoRA adapter {name!r} is in use by {using} request(s) of this replica; "
                                   f"unload it once they have finished")
            del table.adapters[name]  # no new request for it from here on (nothing awaited since the count)
            for stage in self.pipeline.stages_and_spares():
                await self.pipeline.unload_lora(stage, name)
        log.info("LoRA adapter %r unloaded", name)
