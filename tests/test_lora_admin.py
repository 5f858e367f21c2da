"""A replica's run-time LoRA loads and unloads (scheduler.lora_admin): a path a client gave must resolve inside
--allowed-local-lora-path; every stage reads the adapter before it enters the table (a stage that refuses
undoes the ones before it); an adapter in use is never unloaded. The stages here are a recording double of the
gRPC pipeline's two calls (the real calls run in test_lora's serve test)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from lora_cases import make_adapter
from scheduler.lora_admin import AdapterExists, AdapterInUse, AdapterUnknown, LoRAAdmin
from scheduler.lora_table import LoRATable
from scheduler.pipeline import StageFailure
from stagemesh.core.lora import LoRAError


@dataclass
class Stages:
    """The pipeline's stages_and_spares / load_lora / unload_lora: each stage's adapters; `refuse`: a stage that
    refuses loads with this reason."""
    names: list[str]
    refuse: dict[str, str] = field(default_factory=dict)
    held: dict[str, set[str]] = field(default_factory=dict)

    def stages_and_spares(self):
        return list(self.names)

    async def load_lora(self, stage, name, path):
        if stage in self.refuse:
            raise StageFailure(stage, f"INVALID_ARGUMENT: {self.refuse[stage]}")
        self.held.setdefault(stage, set()).add(name)

    async def unload_lora(self, stage, name):
        self.held.get(stage, set()).discard(name)


@dataclass
class Request:
    lora_name: str


@pytest.fixture
def adapter(tiny_model_dir, tmp_path):
    return make_adapter(tmp_path / "allowed" / "sql", tiny_model_dir("llama"), rank=4)


def run(coro):
    return asyncio.run(coro)


def test_a_load_reaches_every_stage_before_the_table(adapter, tmp_path):
    table = LoRATable(max_loras=2, allowed_paths=(str(tmp_path / "allowed"),))
    stages, requests = Stages(["stage 0", "stage 1"]), []
    admin = LoRAAdmin(table, stages, lambda: requests)
    assert run(admin.load("sql", str(adapter))) is True
    assert table.adapters == {"sql": str(adapter)} and stages.held == {"stage 0": {"sql"}, "stage 1": {"sql"}}
    assert run(admin.load("sql", str(adapter))) is False  # the same again: nothing to do (a router's sync)
    with pytest.raises(AdapterExists, match="The lora adapter 'sql' has already been loaded"):
        run(admin.load("sql", str(make_adapter(tmp_path / "allowed" / "other", _model(adapter), rank=4))))


def _model(adapter):
    import json

    return json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]


def test_a_stage_that_refuses_undoes_the_stages_before_it(adapter, tmp_path):
    table = LoRATable(allowed_paths=(str(tmp_path / "allowed"),))
    stages = Stages(["stage 0", "stage 1"], refuse={"stage 1": "LoRA adapter 'sql': out of memory"})
    with pytest.raises(LoRAError, match="stage 1: LoRA adapter 'sql': out of memory"):
        run(LoRAAdmin(table, stages, list).load("sql", str(adapter)))
    assert table.adapters == {} and stages.held == {"stage 0": set()}


def test_paths_outside_the_allowed_directories_are_refused(adapter, tmp_path):
    outside = make_adapter(tmp_path / "outside", _model(adapter), rank=4)
    (tmp_path / "allowed" / "link").symlink_to(outside)
    stages = Stages(["stage 0"])
    admin = LoRAAdmin(LoRATable(allowed_paths=(str(tmp_path / "allowed"),)), stages, list)
    for path, message in [(str(outside), "is outside --allowed-local-lora-path"),
                          (str(tmp_path / "allowed" / "link"), "is outside --allowed-local-lora-path"),
                          (f"{tmp_path}/allowed/../outside", "is outside --allowed-local-lora-path"),
                          ("allowed/sql", "lora_path must be an absolute path"),
                          (str(tmp_path / "allowed" / "none"), "not a directory")]:
        with pytest.raises(LoRAError, match=message):
            run(admin.load("x", path))
    with pytest.raises(LoRAError, match="start the server with --allowed-local-lora-path DIR"):
        run(LoRAAdmin(LoRATable(), stages, list).load("x", str(adapter)))
    with pytest.raises(LoRAError, match="this replica runs without --enable-lora"):
        run(LoRAAdmin(None, stages, list).load("x", str(adapter)))
    assert stages.held == {}


def test_an_adapter_in_use_is_not_unloaded(adapter, tmp_path):
    table = LoRATable(allowed_paths=(str(tmp_path / "allowed"),))
    stages, requests = Stages(["stage 0"]), [Request("sql"), Request(""), Request("sql")]
    admin = LoRAAdmin(table, stages, lambda: requests)
    run(admin.load("sql", str(adapter)))
    with pytest.raises(AdapterInUse, match="LoRA adapter 'sql' is in use by 2 request"):
        run(admin.unload("sql"))
    assert "sql" in table and stages.held == {"stage 0": {"sql"}}
    requests.clear()
    run(admin.unload("sql"))
    assert "sql" not in table and stages.held == {"stage 0": set()}
    with pytest.raises(AdapterUnknown, match="The lora adapter 'sql' cannot be found"):
        run(admin.unload("sql"))
