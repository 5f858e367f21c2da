"""A stage that dies and is not back within --stage-recovery-timeout fails its requests with a clear error
(tests/test_recovery.py: back in time, they go on), and the replica recovers."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from mesh import Mesh
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import scheduler_pb2

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("flag,num_requests", [(None, 4), ("--async-scheduling", 1)],
                         ids=["four-requests-cpu-default", "lone-request-run-ahead"])
def test_stage_killed_mid_generation_fails_requests_then_recovers(tiny_model_dir, tmp_path, flag, num_requests):
    # (a lone request runs ahead: stage 0 waits for its tokens from stage 1 when stage 1 dies)
    model_dir = tiny_model_dir("llama")
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    window = ("--stage-recovery-timeout", "2")
    with Mesh(model_dir, [2, 2], handoff="nccl", log_dir=tmp_path,
              scheduler_args=(*window, flag) if flag else window) as mesh:
        with ThreadPoolExecutor(num_requests) as pool:
            futures = [pool.submit(mesh.submit, f"r{i}", [5 + i] * 20, long, 60) for i in range(num_requests)]
            while mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5).num_running < num_requests:
                time.sleep(0.05)
            killed = time.monotonic()  # (before: the scheduler may see the death before kill_stage has reaped it)
            mesh.kill_stage(1)
            errors = []
            for f in futures:
                with pytest.raises(grpc.RpcError) as info:
                    f.result(timeout=60)  # bounded: a hang fails the test
                errors.append(info.value)
        assert time.monotonic() - killed >= 2, "the requests were not kept for the window"
        assert f"keeping {num_requests} request(s) for up to 2s" in (tmp_path / "scheduler.log").read_text()
        for err in errors:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "stage 1 (127.0.0.1:" in err.details() and "layers 2:4) failed" in err.details()
        mesh.wait_healthy(timeout=30, healthy=False)
        stats = mesh.stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)
        assert not stats.healthy and "stage 1" in stats.unhealthy_reason
        with pytest.raises(grpc.RpcError) as info:
            mesh.submit("while-down", [5, 6, 7], SamplingParams(max_tokens=4), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        mesh.start_stage(1)
        mesh.wait_healthy(timeout=120)
        tokens, reason = mesh.submit("after", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(tokens) == 8 and reason == "length"
    # CPU stages: no steps ahead unless asked for
    assert ("async scheduling" in (tmp_path / "scheduler.log").read_text()) == (flag == "--async-scheduling")
