"""The decode side's kv_load_failure_policy (issue 44) in the scheduler core, and its flags: a prompt's KV that
cannot be loaded fails the request under `fail` (never computing the prompt on the decode replica) and is computed
under `recompute`; a request that ends before its KV was loaded has its prefill replica release it at once; a
policy other than fail or recompute is refused at start-up, naming the flag. (The processes: test_disaggregated.)"""
from __future__ import annotations


import pytest

from scheduler.config import SchedulerConfig
from scheduler.kv_transfer import KVLoadFailed
from stagemesh.core.engine_request import KVSourceInfo
from scheduler.scheduler import Scheduler
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from mesh import run_stagemesh

PROMPT = list(range(3, 13))  # 10 tokens: 3 blocks of 4


def make(policy: str = "fail") -> Scheduler:
    return Scheduler(SchedulerConfig(num_kv_blocks=64, max_model_len=256, block_size=4, eos_token_ids=(2,),
                                     kv_load_failure_policy=policy))


def source(request_id: str = "r", block_size: int = 4, num_tokens: int = len(PROMPT)) -> KVSourceInfo:
    return KVSourceInfo("10.0.0.1:5000", request_id, 3, tuple(range(-(-num_tokens // block_size))), block_size,
                        num_tokens, (("10.0.0.1:6000", 0, 4),))


def add(s: Scheduler, request_id: str = "r", src: KVSourceInfo | None = None) -> bool:
    return s.add_request(EngineRequest(request_id, PROMPT, SamplingParams(max_tokens=5), [42],
                                       kv_source=src or source(request_id)))


def test_the_default_policy_is_fail_as_vllms():
    assert SchedulerConfig().kv_load_failure_policy == "fail"
    with pytest.raises(StagemeshError, match="--kv-load-failure-policy must be fail or recompute, got 'retry'"):
        SchedulerConfig(kv_load_failure_policy="retry")
    with pytest.raises(StagemeshError, match="--kv-load-timeout must be > 0"):
        SchedulerConfig(kv_load_timeout_s=0)


def test_under_fail_a_failed_load_ends_the_request_and_under_recompute_its_prompt_is_computed():
    for policy in ("fail", "recompute"):
        s = make(policy)
        add(s)
        assert s.schedule() is None  # the request waits for its KV
        [pull] = s.transfers.take_pulls()
        outputs = s.kv_pulled(pull.request_id, False, "its KV could not be loaded")
        if policy == "fail":
            [out] = outputs
            assert (out.finish_reason, out.kv_load_failed, out.error) == ("error", True, "its KV could not be loaded")
            assert not s.has_unfinished() and s.kv.usage == 0 and s.schedule() is None
        else:
            assert outputs == []
            out = s.schedule()  # its prompt, computed here
            assert [len(c.token_ids) for c in out.step_batch.chunks] == [len(PROMPT) + 1]


def test_kv_that_does_not_fit_fails_the_request_under_fail():
    s = make("fail")
    with pytest.raises(KVLoadFailed, match=r"\(not_fit: .*kv_load_failure_policy fail"):
        add(s, src=source(block_size=16))
    assert not s.has_unfinished()
    assert add(make("recompute"), src=source(block_size=16)) is False  # computed here


def test_a_request_that_ends_before_its_kv_is_loaded_has_it_released_at_once():
    s = make()
    add(s, "waiting")  # not pulled yet: no blocks for it
    s.abort(["waiting"])
    assert [x.request_id for x in s.transfers.take_releases()] == ["waiting"]
    add(s, "pulling")
    s.schedule()
    [pull] = s.transfers.take_pulls()
    s.abort(["pulling"])  # during its pull: released now, its blocks kept until the pull ends
    assert [x.request_id for x in s.transfers.take_releases()] == ["pulling"]
    assert "pulling" in s.transfers.released and s.kv.usage > 0
    assert s.kv_pulled("pulling", True) == [] and s.kv.usage == 0
    assert s.transfers.take_releases() == []


@pytest.mark.parametrize("command", ["scheduler", "serve"])
def test_a_policy_other_than_fail_or_recompute_is_refused_at_start_up(tiny_model_dir, command):
    done = run_stagemesh([command, str(tiny_model_dir("llama")),
                           "--kv-load-failure-policy", "retry"], timeout=120)
    assert done.returncode != 0
    assert "--kv-load-failure-policy must be fail or recompute (vLLM's kv_load_failure_policy), got 'retry'" in \
        done.stderr + done.stdout
