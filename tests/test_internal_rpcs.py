"""Internal RPCs trust no caller: crafted Forward, PushActivations and JoinPipeline calls, and calls without
the internal token, each get an error status, and the replica serves as before afterwards."""
from __future__ import annotations

import time

import grpc
import pytest

from mesh import Mesh, free_port, internal_channel
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from stagemesh.core.wire import sampling_to_pb

pytestmark = pytest.mark.slow
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def forward(step_id=1000, epoch=1, seq_ids=(900,), num_tokens=(3,), token_ids=(5, 6, 7), start_positions=(0,),
            num_new_blocks=(1,), new_block_ids=(3,), sample=(True,), new=True) -> stage_pb2.ForwardRequest:
    step = stage_pb2.StepBatch(step_id=step_id, chunks=stage_pb2.ScheduledChunks(
        seq_ids=seq_ids, num_tokens=num_tokens, token_ids=token_ids, start_positions=start_positions,
        num_new_blocks=num_new_blocks, new_block_ids=new_block_ids, sample=sample))
    if new:
        step.new_sequences.add(seq_id=seq_ids[0], prompt_token_ids=[5, 6, 7],
                               sampling=sampling_to_pb(SamplingParams(max_tokens=4)))
    return stage_pb2.ForwardRequest(epoch=epoch, step=step)


def push(step_id=1000, epoch=1, shape=(3, 64), nbytes=None, dtype="float32") -> stage_pb2.PushActivationsRequest:
    size = shape[0] * (shape[1] if len(shape) > 1 else 1) * 4
    return stage_pb2.PushActivationsRequest(epoch=epoch, step_id=step_id, hidden_states=common_pb2.Tensor(
        dtype=dtype, shape=shape, data=b"\0" * (size if nbytes is None else nbytes)))


CASES = [
    ("position 10**6", "Forward", forward(start_positions=(10**6,)), INVALID, "outside [0, 512)"),
    ("negative position", "Forward", forward(start_positions=(-16,)), INVALID, "outside [0, 512)"),
    ("block id past the cache", "Forward", forward(new_block_ids=(10**9,)), INVALID, "outside the KV cache"),
    ("block table longer than a sequence holds", "Forward",
     forward(num_new_blocks=(40,), new_block_ids=tuple(range(40))), INVALID, "more blocks than a sequence"),
    ("no token", "Forward", forward(num_tokens=(0,), token_ids=()), INVALID, "a chunk has no token"),
    ("token id past the vocabulary", "Forward", forward(token_ids=(5, 6, 10**6)), INVALID, "outside the vocabulary"),
    ("columns that do not line up", "Forward", forward(sample=(True, False)), INVALID, "columns differ"),
    ("a bad sampling value", "Forward", None, INVALID, "'temperature'"),
    ("a step far ahead of the order", "Forward", forward(step_id=10**6, new=False, seq_ids=(0,)), PRECONDITION,
     "steps ahead of step"),
    # the scheduler's step path: a step that fails ends the stream with the status Forward would have had
    ("position 10**6 on the step stream", "ForwardStream", forward(start_positions=(10**6,)), INVALID,
     "outside [0, 512)"),
    ("a step far ahead on the step stream", "ForwardStream", forward(step_id=10**6, new=False, seq_ids=(0,)),
     PRECONDITION, "steps ahead of step"),
    ("bytes that do not match the shape", "PushActivations", push(nbytes=10), INVALID, "need 768 bytes"),
    ("a wrong hidden size", "PushActivations", push(shape=(3, 32)), INVALID, "this model's are [tokens, 64]"),
    ("a huge tensor", "PushActivations", push(shape=(1 << 20, 64), nbytes=16), INVALID, "a step has 1 to"),
    ("a dtype that is not a float", "PushActivations", push(dtype="int64"), INVALID, "dtype 'int64'"),
    ("a step far ahead", "PushActivations", push(step_id=10**6), PRECONDITION, "each once"),
]


@pytest.fixture(scope="module")
def mesh(tiny_model_dir, tmp_path_factory):
    port = free_port()
    with Mesh(tiny_model_dir("llama"), [2, 2], handoff="grpc", per_stage_args={1: ["--port", str(port)]},
              log_dir=tmp_path_factory.mktemp("internal-rpcs")) as m:
        m.stage_address = f"127.0.0.1:{port}"
        yield m


def epoch_of(mesh: Mesh) -> int:
    text = (mesh.log_dir / "scheduler.log").read_text()
    return int(text.rsplit("pipeline formed (epoch ", 1)[1].split(")")[0])


@pytest.mark.parametrize("name,method,request_,code,words", CASES, ids=[c[0] for c in CASES])
def test_crafted_internal_calls_are_refused_and_the_replica_still_serves(mesh, name, method, request_, code, words):
    if request_ is None:  # a NaN temperature cannot be built through SamplingParams: set it on the message
        request_ = forward()
        request_.step.new_sequences[0].sampling.temperature = float("nan")
    request_.epoch = epoch_of(mesh)  # the current epoch: only the checks can refuse it
    with internal_channel(mesh.stage_address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            call(stage_pb2_grpc.StageStub(channel), method, request_)
    assert err.value.code() == code and words in err.value.details(), err.value.details()
    tokens, _ = mesh.submit(f"after-{name}", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), timeout=60)
    assert len(tokens) == 4


def call(stub: stage_pb2_grpc.StageStub, method: str, request):
    """A unary call's reply, or a stream's replies to the one request."""
    if method == "ForwardStream":
        return list(stub.ForwardStream(iter([request]), timeout=10))
    return getattr(stub, method)(request, timeout=10)


def join(**fields) -> stage_pb2.JoinPipelineRequest:
    base = dict(epoch=99, store_host="127.0.0.1", store_port=1, world_size=2, rank_offset=1, tp_sizes=[1, 1],
                num_kv_blocks=10, max_model_len=64, max_num_batched_tokens=64)
    return stage_pb2.JoinPipelineRequest(**{**base, **fields})


@pytest.mark.parametrize("request_,words", [
    (join(num_kv_blocks=2**31 - 1), "num_kv_blocks 2147483647: this stage holds 1 to"),
    (join(tp_sizes=[1, 2], world_size=3), "gives stage 1 TP=2; it has TP=1"),
    (join(world_size=5), "world_size and rank_offset do not match"),
    (join(rank_offset=0), "world_size and rank_offset do not match"),
    (join(tp_sizes=[1]), "do not give stage 1 a place"),
    (join(tp_sizes=[1, 1, 1], world_size=3), "is the last stage of its model, unlike in this pipeline of 3"),
    (join(max_model_len=10**6), "outside the model's 512 positions"),
    (join(store_host=""), "the store's host and port are required"),
], ids=["kv-blocks", "tp-size", "world-size", "rank-offset", "no-place", "not-last", "max-model-len", "no-store"])
def test_a_join_that_does_not_fit_the_stage_is_refused_and_the_epoch_goes_on(mesh, request_, words):
    with internal_channel(mesh.stage_address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            stage_pb2_grpc.StageStub(channel).JoinPipeline(request_, timeout=10)
    assert err.value.code() == INVALID and words in err.value.details(), err.value.details()
    tokens, _ = mesh.submit(f"after-join-{words[:10]}", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(tokens) == 4


def test_forty_steps_from_the_future_are_refused_without_wedging_the_stage(mesh):
    epoch = epoch_of(mesh)
    with internal_channel(mesh.stage_address) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        calls = [stub.Forward.future(forward(step_id=10**6 + i, epoch=epoch, seq_ids=(0,), new=False), timeout=60)
                 for i in range(40)]
        codes = [c.exception().code() if c.exception() else None for c in calls]
    assert codes == [PRECONDITION] * 40
    start = time.monotonic()
    tokens, _ = mesh.submit("after-the-future", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), timeout=60)
    assert len(tokens) == 4 and time.monotonic() - start < 30


def test_calls_without_the_internal_token_are_refused_but_health_stays_open(mesh):
    with grpc.insecure_channel(mesh.stage_address) as plain:
        stub = stage_pb2_grpc.StageStub(plain)
        join = stage_pb2.JoinPipelineRequest(epoch=99, store_host="127.0.0.1", store_port=1, world_size=1,
                                             tp_sizes=[1], num_kv_blocks=10, max_model_len=64,
                                             max_num_batched_tokens=64)
        for method, request in (("JoinPipeline", join), ("Describe", stage_pb2.DescribeRequest()),
                                ("Forward", forward()), ("ForwardStream", forward()), ("PushActivations", push())):
            with pytest.raises(grpc.RpcError) as err:
                call(stub, method, request)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        status = health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    tokens, _ = mesh.submit("after-the-strangers", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(tokens) == 4


def test_every_port_of_the_replica_listens_on_loopback_only(mesh):
    """gRPC, the torch.distributed store and gloo bind where the services were told to (127.0.0.1)."""
    import shutil
    import subprocess

    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")
    pids = {proc.pid for proc in (mesh.scheduler, *mesh.stages)}
    lines = [line for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
             if any(f"pid={pid}," in line for pid in pids)]
    assert len(lines) >= 4  # the scheduler's gRPC port and store, each stage's gRPC port
    local = [line.split()[3] for line in lines]
    assert all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:", "[::1]:")) for a in local), local
