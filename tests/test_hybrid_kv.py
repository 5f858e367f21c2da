"""The hybrid KV cache manager (stagemesh.core.kv_groups, scheduler.block_manager): a model with sliding-window
layers keeps a block table per group of layers, a block holds one layer of every group, and a sliding group's
blocks out of its window go back to the pool. Its groups as vLLM forms them, the pool's accounting, prefix hits
that need the window before them, and a real mesh serving a tiny Gemma 3 whose contexts the all-global cache of
the same memory could not hold, token-exact with transformers."""
from __future__ import annotations

import re

import pytest

from mesh import Mesh
from parity import prompts
from scheduler.block_manager import BlockManager
from stagemesh.core.kv_groups import FULL, NULL_BLOCK, kv_groups, tokens_held
from stagemesh.core.model_config import ModelConfig
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2
from tiny_models import TINY, reference_model, reference_tokens, save_random_model

WINDOW = 8
FIVE_TO_ONE = ["sliding_attention"] * 5 + ["full_attention"]  # Gemma 3's pattern
GEMMA6 = dict(TINY, head_dim=16, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=24,
              tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh", layer_types=FIVE_TO_ONE,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def _config(model_type: str, layer_types: list[str] | None, window: int = 1024) -> ModelConfig:
    raw = dict(TINY, model_type=model_type, num_hidden_layers=len(layer_types or [0] * 4), sliding_window=window,
               head_dim=16)
    if layer_types is not None:
        raw["layer_types"] = layer_types
    return ModelConfig.from_dict(raw)


def test_groups_are_formed_as_vllm_forms_them():
    """Gemma-3-27B's 62 layers (10 global): groups of 10, the global one first, so a block holds 10 layers of 62;
    gpt-oss's alternating 24: two groups of 12. Llama, or the flag, keeps one group of every layer."""
    gemma = kv_groups(_config("gemma3_text", (FIVE_TO_ONE * 11)[:62]))
    assert gemma.windows == (FULL,) + (1024,) * 6
    assert [gemma.layer_group[i] for i in (5, 11, 59)] == [0, 0, 0] and gemma.layer_group[0] == 1
    assert gemma.num_slots(0, 62) == 10 and gemma.hybrid
    assert [gemma.layer_group.count(g) for g in range(7)] == [10, 9, 9, 9, 9, 8, 8]  # (52 sliding dealt in turn)
    assert gemma.num_slots(0, 31) == 5  # (a pipeline stage's half: each group's layers span the depth)
    oss = kv_groups(_config("gpt_oss", ["sliding_attention", "full_attention"] * 12, window=128))
    assert oss.windows == (FULL, 128) and oss.num_slots(0, 24) == 12
    off = kv_groups(_config("gemma3_text", FIVE_TO_ONE), disable_hybrid=True)
    for plain in (off, kv_groups(_config("llama", None))):
        assert plain.windows == (FULL,) and not plain.hybrid and plain.slots(2, 6) == [0, 1, 2, 3]


def _decode(kv: BlockManager, request_id: str, tokens: int, start: int = 1) -> None:
    """The request computes positions start .. tokens - 1 one at a time, as the scheduler runs it."""
    for p in range(start, tokens):
        kv.free_outside_window(request_id, p)
        assert kv.allocate(request_id, p + 1) is not None


def test_a_sliding_group_holds_only_its_window():
    kv = BlockManager(100, 4, windows=(FULL, 8, 8))
    assert kv.allocate("a", 1) is not None and len(kv.tables["a"]) == 1
    _decode(kv, "a", 60)
    full, first, second = kv.group_tables["a"]
    assert len(full) == len(first) == len(second) == 15 and NULL_BLOCK not in full
    # position 59's query reads 52..59: blocks 13 and 14; the rest of each sliding table went back
    assert first[:13] == [NULL_BLOCK] * 13 and NULL_BLOCK not in first[13:] + second[13:]
    assert kv.num_free_blocks == 99 - 15 - 2 * 2
    kv.free_request("a")
    assert kv.num_free_blocks == 99 and NULL_BLOCK not in kv.free


def test_the_blocks_a_window_gives_back_run_another_request():
    """A pool of 20 blocks: two long requests fit only because their sliding blocks come back as they go."""
    kv = BlockManager(21, 4, windows=(FULL, 8))
    assert tokens_held((FULL, 8), 21, 4, chunk=1) == 17 * 4  # 17 full blocks + the 3 a window of 8 may span
    for r in ("a", "b"):
        assert kv.allocate(r, 1) is not None
    for p in range(1, 28):
        for r in ("a", "b"):
            kv.free_outside_window(r, p)
            assert kv.allocate(r, p + 1) is not None, (r, p)
    # each: 7 full blocks, and of its sliding table the 2 that position 27's window (20..27) reads; all-global,
    # the two would need 28 blocks
    assert 20 - kv.num_free_blocks == 2 * 7 + 2 * 2


def test_a_prefix_hit_needs_every_full_block_and_the_window_before_it():
    kv = BlockManager(64, 4, windows=(FULL, 8))
    prompt = list(range(100, 133))  # 33 tokens: 8 blocks may hit (one token is left to compute)
    assert kv.allocate("a", 33) is not None
    kv.cache_full_blocks("a", prompt, 33)
    _decode(kv, "a", 40, start=33)
    kv.cache_full_blocks("a", prompt + [7] * 7, 40)
    kv.free_request("a")
    hit = kv.find_cached_prefix(prompt)
    full, sliding = hit[:8], hit[8:]
    assert kv.hit_tokens(hit) == 32 and NULL_BLOCK not in full
    # a query at position 32 reads 25..32: blocks 6 and 7 of the sliding group, none before
    assert sliding[:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in sliding[6:]
    assert kv.allocate("b", 33, hit) is not None and kv.group_tables["b"][1][:8] == sliding
    kv.free_request("b")
    # block 7 of the sliding group evicted: the hit falls back to 7 blocks, whose window (blocks 5 and 6) is there
    kv.group_cached[1].pop(kv.blocks[sliding[7]].block_hash)
    kv.blocks[sliding[7]].block_hash = None
    hit = kv.find_cached_prefix(prompt)
    assert kv.hit_tokens(hit) == 28 and hit[7:][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in hit[7:][5:]


@pytest.mark.parametrize("pool", range(19, 31))
def test_a_hits_blocks_are_never_handed_out_again_as_free_ones(pool):
    """A hit's sliding blocks sit in the free list (freed as the window moved on), often at its front: taking the
    hit's free blocks before its groups' new ones must not give the same block twice."""
    kv = BlockManager(pool, 4, windows=(FULL, 8))
    prompt = list(range(100, 141))
    assert kv.allocate("a", 33) is not None
    kv.cache_full_blocks("a", prompt, 33)
    _decode(kv, "a", 48, start=33)  # (in a full pool its growth takes the sliding blocks freed before the hit's)
    kv.free_request("a")
    hit = kv.find_cached_prefix(prompt[:33])
    for tokens in range(33, 61, 4):
        if kv.allocate("b", tokens, hit) is None:
            continue
        held = [b for table in kv.group_tables["b"] for b in table if b != NULL_BLOCK]
        assert len(held) == len(set(held)) and kv.group_tables["b"][1][:8] == hit[8:], (pool, tokens)
        kv.free_request("b")


def test_the_null_block_is_never_handed_out():
    kv = BlockManager(9, 4, windows=(FULL, 8))
    assert kv.num_blocks == 8 and kv.allocate("a", 16) is not None
    assert NULL_BLOCK not in kv.tables["a"] + kv.group_tables["a"][1] and kv.allocate("b", 1) is None


# -- a mesh ------------------------------------------------------------------------------------------------------

LAYER_BLOCK = 2 * 16 * TINY["num_key_value_heads"] * 16 * 4  # one layer's k and v of a 16-token block, fp32
MEMORY = 12 * 6 * LAYER_BLOCK  # --kv-cache-memory of each stage: 12 blocks of all 6 layers (192 tokens) on one


@pytest.fixture(scope="module")
def gemma6_dir(tmp_path_factory):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**GEMMA6)
    config.architectures = ["Gemma3ForCausalLM"]
    return save_random_model(tmp_path_factory.mktemp("gemma3-6"), config)


@pytest.mark.slow
@pytest.mark.parametrize("split,async_scheduling", [([6], False), ([3, 3], True)])
def test_a_mesh_holds_what_an_all_global_cache_could_not(gemma6_dir, tmp_path, split, async_scheduling):
    """Each stage's memory holds 72 blocks of one layer per group: at least twice the tokens of all-global blocks
    (on one stage 4.25x: 816 tokens, where 192 would not take the 308 of the longest request). Prompts of up to 300
    tokens, four at once with preemptions, give transformers' tokens; a prompt sent again hits the prefix cache
    (its full blocks and the sliding blocks of the window before the hit) and gives them again."""
    batch = prompts(384, lengths=(300, 290, 150, 40))
    alone = prompts(384, lengths=(200,), seed=1)
    ref = reference_model(gemma6_dir)
    want = [reference_tokens(ref, p, 8) for p in batch + alone]
    scheduler_args = ("--max-num-batched-tokens", "32", *(("--async-scheduling",) if async_scheduling else ()))
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    with Mesh(gemma6_dir, split, log_dir=tmp_path, stage_args=("--kv-cache-memory", str(MEMORY)),
              scheduler_args=scheduler_args) as mesh:
        got = mesh.generate(batch, sampling)
        before = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        got += mesh.generate(alone, sampling) + mesh.generate(alone, sampling)
        stats = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
    assert got == want + want[-1:]
    assert stats.num_kv_blocks == 72 - 1  # (less the null block)
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 192  # (12 blocks: the 200th token is computed)
    log = (tmp_path / "scheduler.log").read_text()
    assert "hybrid KV cache manager: 6 groups of layers (sliding windows full, 8, 8, 8, 8, 8)" in log
    held = int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))
    all_global = MEMORY // (6 // len(split) * LAYER_BLOCK) * 16
    assert held >= 2 * all_global and (len(split) > 1 or held > 308 > all_global), (held, all_global)


DRAFT = '{"model": "%s", "num_speculative_tokens": 2}'
NGRAM = '{"method": "ngram", "num_speculative_tokens": 2}'


@pytest.mark.parametrize("flags,off", [
    ((), False), (("--disable-hybrid-kv-cache-manager",), True), (("--kv-offloading-size", "1"), True),
    (("-dp", "2", "--prefill-replicas", "1"), True), (("--speculative-config", DRAFT), True),
    (("--speculative-config", NGRAM), False)])
def test_serve_turns_the_groups_off_where_the_mesh_carries_kv_blocks(flags, off, tiny_model_dir):
    """As vLLM with a KV connector: the KV tiers, disaggregated prefill and a draft model read one table."""
    import argparse

    from stagemesh.entry.serve import add_arguments, plan_commands

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = tuple(f % tiny_model_dir("llama") if f == DRAFT else f for f in flags)
    children = plan_commands(p.parse_args(["-pp", "2", *flags]), "/m", 4, cuda=False)
    stages = [c.argv for c in children if c.name.startswith("stage")]
    assert stages and all(("--disable-hybrid-kv-cache-manager" in argv) == off for argv in stages)


def test_the_scheduler_refuses_stages_whose_groups_differ_or_make_no_sense():
    from dataclasses import replace

    from scheduler.rendezvous import ModelIdentity, Rendezvous, StageInfo
    from stagemesh.core.errors import StagemeshError

    model = ModelIdentity("gemma3_text", 6, 64, 384, 4, 2)
    first = StageInfo(0, 0, 3, 1, "cpu", 100, 16, model, "127.0.0.1:1", "grpc", kv_group_windows=(FULL, 8, 8))
    r = Rendezvous(2, 16, model)
    r.register(first)
    second = replace(first, stage_index=1, layer_start=3, layer_end=6, address="127.0.0.1:2")
    with pytest.raises(StagemeshError, match=r"has the KV cache groups \[0\] .*; the other stages have \[0, 8, 8\]"):
        r.register(replace(second, kv_group_windows=(FULL,)))
    for hostile in ((), (8, FULL), (FULL, -1), (FULL,) + (8,) * 6):
        with pytest.raises(StagemeshError, match="KV cache groups"):
            r.register(replace(second, kv_group_windows=hostile))
    assert r.register(second) == 0 and r.plan().kv_group_windows == (FULL, 8, 8)


def test_a_replica_with_groups_refuses_disaggregated_requests_by_name():
    from scheduler.admission import check_engine_request
    from scheduler.config import SchedulerConfig
    from stagemesh.core.engine_request import EngineRequest
    from stagemesh.core.errors import StagemeshError

    cfg = SchedulerConfig(num_kv_blocks=100, max_model_len=512, kv_group_windows=(FULL, 8))
    check_engine_request(cfg, EngineRequest("a", [5, 6], SamplingParams(max_tokens=4)))
    with pytest.raises(StagemeshError, match="--disable-hybrid-kv-cache-manager"):
        check_engine_request(cfg, EngineRequest("b", [5, 6], SamplingParams(max_tokens=4), prefill_only=True))


def test_gpt_oss_in_an_engine_holds_more_tokens_and_gives_transformers_tokens(tmp_path):
    """gpt-oss's alternating layers make two groups of half of them: the memory of 8 all-layer blocks (128 tokens)
    holds 16 blocks of two layers, 192 tokens once a window's 3 blocks are set aside; prompts several windows long,
    under preemption, give transformers' tokens either way."""
    from transformers import GptOssConfig

    from stagemesh.entry.local_engine import LocalEngine
    from test_family_gpt_oss import GPT_OSS

    config = GptOssConfig(**GPT_OSS)
    config.architectures = ["GptOssForCausalLM"]
    model_dir = save_random_model(tmp_path / "gpt-oss", config)
    ref = reference_model(model_dir)
    batch = prompts(384, lengths=(100, 90, 30))
    want = [reference_tokens(ref, p, 12) for p in batch]
    memory = 8 * 4 * LAYER_BLOCK  # (its 4 layers, 2 KV heads of 16, fp32)
    held = {}
    for disable in (False, True):
        with LocalEngine.of(model_dir, kv_cache_memory=memory, max_num_batched_tokens=16,
                            disable_hybrid_kv_cache_manager=disable) as engine:
            assert engine.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True)) == want
            held[disable] = engine.driver.epochs.scheduler.config.kv_cache_tokens
    assert (held[True], held[False]) == (8 * 16, 12 * 16)
