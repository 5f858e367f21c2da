"""Sampled tokens from the last stage back to the first, for steps scheduled ahead, over the handoff the
stages share: the grpc handoff's mailbox as a unit, then PP=2 meshes over both handoffs where every step of
a lone request runs ahead (real processes, tokens equal to transformers')."""
from __future__ import annotations

import threading

import pytest
import torch

from mesh import Mesh
from parity import prompts
from stage_worker.handoff import GrpcHandoff, HandoffAborted
from stagemesh.core.errors import StagemeshError
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import stage_pb2
from tiny_models import reference_model, reference_tokens


def tokens(step: int, ids: list[int], epoch: int = 3) -> stage_pb2.PushActivationsRequest:
    return stage_pb2.PushActivationsRequest(epoch=epoch, step_id=step, sampled_tokens=ids)


def test_the_first_stage_takes_tokens_once_in_its_window():
    first = GrpcHandoff(None, torch.device("cpu"), epoch=3, window=4)
    first.deliver(tokens(2, [5, 49151]))
    with pytest.raises(StagemeshError, match="each once"):
        first.deliver(tokens(2, [5, 49151]))
    with pytest.raises(StagemeshError, match="takes steps 0 to 3"):
        first.deliver(tokens(4, [1]))
    with pytest.raises(StagemeshError, match="not in that epoch"):
        first.deliver(tokens(1, [1], epoch=2))
    assert first.recv_tokens(2, 2) == [5, 49151]
    first.deliver(tokens(5, [7]))  # the window moved on with the step taken
    first.advance(5)  # the stage took step 5 without it (the tokens were not needed after all): they go
    with pytest.raises(StagemeshError, match="takes steps 6 to 9"):
        first.deliver(tokens(5, [7]))
    first.deliver(tokens(6, [1, 2]))
    with pytest.raises(StagemeshError, match="has 3 tokens scheduled ahead; the last stage sent 2"):
        first.recv_tokens(6, 3)


def test_a_wait_for_tokens_ends_when_they_come_or_the_epoch_does():
    first = GrpcHandoff(None, torch.device("cpu"), epoch=0)
    timer = threading.Timer(0.3, first.deliver, (tokens(1, [11], epoch=0),))
    timer.start()
    try:
        assert first.recv_tokens(1, 1) == [11]
    finally:
        timer.cancel()
    threading.Timer(0.3, first.abort).start()
    with pytest.raises(HandoffAborted):
        first.recv_tokens(2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("handoff", ["grpc", "nccl"])
def test_a_lone_request_runs_every_step_ahead_across_two_stages(tiny_model_dir, tmp_path, handoff):
    model_dir = tiny_model_dir("llama")
    prompt = prompts(384, (21,))[0]
    want = reference_tokens(reference_model(model_dir), prompt, 24)
    with Mesh(model_dir, [2, 2], handoff=handoff, log_dir=tmp_path, scheduler_args=("--async-scheduling",)) as mesh:
        got = mesh.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))
    assert got == [want]
    assert "steps scheduled ahead take their sampled tokens from the last stage" in \
        (tmp_path / "stage0.log").read_text()
