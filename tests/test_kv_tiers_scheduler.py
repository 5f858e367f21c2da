"""The scheduler's side of the KV tiers (scheduler/tiers.py): what it stores, what it loads back, what it
does when a load fails, with the stages' answers given by hand (the stages' side and the whole path through
real stages: tests/test_kv_tiers.py)."""
from __future__ import annotations

from scheduler import handover
from scheduler.config import SchedulerConfig
from scheduler.kv_events import BlockRemoved, BlockStored
from scheduler.scheduler import Scheduler
from scheduler.status import Status
from scheduler.tiers import FROM_DISK
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.core.step import SampledToken

BS = 4


def make(num_kv_blocks=8, host=16, disk=0, disk_hashes=()) -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=num_kv_blocks, max_model_len=64, block_size=BS,
                                     eos_token_ids=(2,), num_host_kv_blocks=host, num_disk_kv_blocks=disk),
                     disk_hashes)


def finish(s: Scheduler, request_id: str, prompt: list[int], max_tokens: int = 1) -> list:
    """Run one request to its end (made-up tokens), every step's stores acknowledged as stored."""
    s.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    outs = []
    while s.has_unfinished():
        out = s.schedule()
        if out is None:  # waiting for a load: the caller answers it
            break
        sampled = [SampledToken(c.seq_id, 9) for c in out.step_batch.chunks if c.sample]
        outs += s.update_from_output(out, sampled)
        job = s.kv.tiers.take_store()
        if job is not None:
            s.kv.tiers.stored(job, True)
    return outs


def evict_everything(s: Scheduler) -> None:
    """Hand every block of the pool out once (nothing new cached), so that every cached block leaves it."""
    assert s.kv.allocate("filler", BS * s.kv.num_blocks) is not None
    s.kv.free_request("filler")


def test_blocks_that_enter_the_prefix_cache_are_stored_in_the_host_tier_and_pinned_until_stored():
    s = make()
    s.add_request(EngineRequest("a", list(range(10, 19)), SamplingParams(max_tokens=1)))  # 9 tokens: 2 full blocks
    out = s.schedule()
    s.update_from_output(out, [SampledToken(out.step_batch.chunks[0].seq_id, 9)])
    job = s.kv.tiers.take_store()
    assert job is not None and len(job.block_ids) == 2 and job.to_disk == [False, False]
    assert s.kv.tiers.take_store() is None  # one store in flight at a time
    pinned = set(job.block_ids)
    assert not pinned & set(s.kv.free)  # the request ended, but its blocks wait for the copy
    s.kv.tiers.stored(job, True)
    assert pinned <= set(s.kv.free) and len(s.kv.tiers.host) == 2


def test_a_prefix_evicted_from_the_pool_is_loaded_back_from_the_host_tier_and_counted_as_cached():
    s = make()
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks
    finish(s, "a", prompt)
    evict_everything(s)
    assert not s.kv.find_cached_prefix(prompt)
    s.add_request(EngineRequest("b", prompt + [1], SamplingParams(max_tokens=1)))
    assert s.schedule() is None  # b waits for its load
    assert s.requests["b"].status is Status.WAITING_FOR_REMOTE_KV and not s.waiting
    [load] = s.kv.tiers.take_loads()
    assert len(load.block_ids) == 3 and FROM_DISK not in load.host_slots
    s.kv_tier_loaded(load, [True, True, True])
    assert s.requests["b"].status is Status.WAITING and list(s.waiting) == [s.requests["b"]]
    out = s.schedule()
    chunk = out.step_batch.chunks[0]
    assert chunk.start_position == 3 * BS and chunk.token_ids == [22, 1]
    assert chunk.new_block_ids[:3] == load.block_ids  # the stages get the loaded blocks in its table
    [result] = s.update_from_output(out, [SampledToken(chunk.seq_id, 9)])
    assert result.num_cached_tokens == 3 * BS


def test_a_block_that_does_not_load_is_computed_from_there_and_leaves_its_tier():
    s = make()
    prompt = list(range(10, 23))
    finish(s, "a", prompt)
    evict_everything(s)
    s.kv.start_events()
    s.add_request(EngineRequest("b", prompt + [1], SamplingParams(max_tokens=1)))
    s.schedule()
    [load] = s.kv.tiers.take_loads()
    s.kv_tier_loaded(load, [True, False, True])
    chunk = s.schedule().step_batch.chunks[0]
    assert chunk.start_position == BS  # block 0 loaded; blocks 1 and 2 computed
    assert load.hashes[1] not in s.kv.tiers.host and load.hashes[2] in s.kv.tiers.host
    removed = [e for e in s.kv.drain_events() if isinstance(e, BlockRemoved) and e.medium == "host"]
    assert removed == [BlockRemoved([load.hashes[1]], medium="host")]


def test_disk_tier_keeps_the_newest_blocks_and_deletes_the_rest_on_the_next_store():
    s = make(num_kv_blocks=16, host=16, disk=2)
    s.kv.start_events()
    finish(s, "a", list(range(10, 23)))  # 3 blocks: one too many for the disk tier
    assert len(s.kv.tiers.disk) == 2
    events = s.kv.drain_events()
    assert any(isinstance(e, BlockStored) and e.medium == "disk" for e in events)
    [evicted] = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "disk"]
    s.add_request(EngineRequest("b", list(range(50, 55)), SamplingParams(max_tokens=1)))
    out = s.schedule()
    s.update_from_output(out, [SampledToken(out.step_batch.chunks[0].seq_id, 9)])
    job = s.kv.tiers.take_store()
    assert job.disk_evictions == evicted.block_hashes  # the stages delete the files


def test_blocks_on_disk_from_before_are_loaded_at_once_by_a_new_scheduler():
    first = make(num_kv_blocks=16, host=16, disk=16)
    prompt = list(range(10, 23))
    finish(first, "a", prompt)
    on_disk = list(first.kv.tiers.disk)
    s = make(num_kv_blocks=16, host=16, disk=16, disk_hashes=on_disk)  # a restart on the same directory
    s.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=1)))
    s.schedule()
    [load] = s.kv.tiers.take_loads()
    assert load.host_slots == [FROM_DISK] * 3 and load.hashes == on_disk


def test_a_request_that_ends_during_its_load_frees_its_blocks_only_when_the_load_ends():
    s = make()
    prompt = list(range(10, 23))
    finish(s, "a", prompt)
    evict_everything(s)
    s.add_request(EngineRequest("b", prompt + [1], SamplingParams(max_tokens=1)))
    s.schedule()
    [load] = s.kv.tiers.take_loads()
    s.abort(["b"])
    assert not set(load.block_ids) & set(s.kv.free)  # the stages may be writing into them
    s.kv_tier_loaded(load, [True] * 3)
    assert set(load.block_ids) <= set(s.kv.free)


def test_a_host_slot_being_read_is_not_given_to_another_block():
    s = make(num_kv_blocks=8, host=3)
    prompt = list(range(10, 23))
    finish(s, "a", prompt)  # fills the 3 host slots
    evict_everything(s)
    s.add_request(EngineRequest("b", prompt + [1], SamplingParams(max_tokens=1)))
    s.schedule()
    [load] = s.kv.tiers.take_loads()
    finish(s, "c", list(range(60, 73)))  # 3 new blocks want slots: every slot is being read
    assert s.kv.tiers.stats.skipped_stores == 3 and set(load.hashes) <= set(s.kv.tiers.host)


def test_requests_loading_when_the_pipeline_breaks_are_kept_for_the_next_epoch():
    s = make()
    prompt = list(range(10, 23))
    finish(s, "a", prompt)
    evict_everything(s)
    s.add_request(EngineRequest("b", prompt + [1], SamplingParams(max_tokens=1)))
    s.schedule()
    kept = handover.requeue_all(s)
    assert [r.request_id for r in kept] == ["b"] and not kept[0].tiers_checked


def test_a_loaded_request_behind_a_preempted_one_gives_its_blocks_back_rather_than_wait_for_ever():
    """Found by benchmarks/bench_kv_tiers.py on a small pool: b's prefix comes back from the host tier into blocks
    of its own; d, running, cannot grow and is preempted in front of b; d's prompt needs more blocks than are
    free while b holds its own, and nothing runs: without a way out, no step is ever scheduled again."""
    s = make(num_kv_blocks=8, host=16)
    prompt = list(range(10, 23))  # 3 full blocks, into the host tier
    finish(s, "a", prompt)
    evict_everything(s)
    s.add_request(EngineRequest("d", list(range(100, 119)),
                                SamplingParams(max_tokens=12, ignore_eos=True)))  # up to 8 blocks
    out = s.schedule()
    s.update_from_output(out, [SampledToken(out.step_batch.chunks[0].seq_id, 9)])
    s.add_request(EngineRequest("b", prompt + [1], SamplingParams(max_tokens=4, ignore_eos=True)))
    out = s.schedule()  # b goes loading; d decodes
    s.update_from_output(out, [SampledToken(c.seq_id, 9) for c in out.step_batch.chunks if c.sample])
    [load] = s.kv.tiers.take_loads()
    s.kv_tier_loaded(load, [True] * 3)
    for _ in range(100):
        job = s.kv.tiers.take_store()  # (the driver's stores and loads end in their own time: here before a step)
        if job is not None:
            s.kv.tiers.stored(job, True)
        for load in s.kv.tiers.take_loads():
            s.kv_tier_loaded(load, [True] * len(load.block_ids))
        out = s.schedule()
        if out is None:  # a request went loading (its load ends before the next step), or nothing can run
            assert s.kv.tiers.loading, f"stuck: waiting {[r.request_id for r in s.waiting]}, " \
                                       f"{s.kv.num_free_blocks} blocks free"
            continue
        s.update_from_output(out, [SampledToken(c.seq_id, 9) for c in out.step_batch.chunks if c.sample])
        if not s.has_unfinished():
            break
    assert not s.has_unfinished() and s.num_preemptions > 0
