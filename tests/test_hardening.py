"""No request can hurt another: poison inputs sent through every entry point while 16 greedy streams run
get a 4xx (or, for what vLLM serves, a correct answer), and every stream ends with transformers' tokens.

The tiny model's token 7 has a NaN embedding, so a prompt holding it makes the model's own logits NaN
for that sequence: a failure that no validation can catch, which the sampler must keep to its row.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from mesh import Mesh, Router
from parity import prompts
from stagemesh.core.sampling_params import SamplingParams
from stagemesh.v1 import frontend_pb2, frontend_pb2_grpc, scheduler_pb2_grpc
from stagemesh.core.wire import sampling_to_pb
from tiny_models import reference_model, reference_tokens, with_word_tokenizer

pytestmark = pytest.mark.slow
M = "llama-tiny"
NAN_TOKEN = 7
STREAM_TOKENS = 200  # long enough that the streams outlast the poison on a loaded machine


def poisoned_model(model_dir: Path, target: Path) -> Path:
    """A copy of the tiny model whose token NAN_TOKEN embeds as NaN."""
    target = with_word_tokenizer(model_dir, target)
    weights = load_file(target / "model.safetensors")
    weights["model.embed_tokens.weight"][NAN_TOKEN] = float("nan")
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    return poisoned_model(tiny_model_dir("llama"), tmp_path_factory.mktemp("poisoned") / "model")


@pytest.fixture(scope="module")
def references(model):
    """16 prompts whose greedy continuations never meet the NaN token, with transformers' tokens."""
    ref = reference_model(model)
    chosen = []
    for prompt in prompts(384, lengths=[9 + 3 * i for i in range(40)], seed=1):
        prompt = [t for t in prompt if t != NAN_TOKEN]
        tokens = reference_tokens(ref, prompt, STREAM_TOKENS)
        if NAN_TOKEN not in tokens and not torch.isnan(torch.tensor(tokens, dtype=torch.float)).any():
            chosen.append((prompt, tokens))
        if len(chosen) == 16:
            return chosen
    pytest.fail("not enough prompts avoid the NaN token")


def stream_ids(base_url: str, prompt: list[int]) -> list[int]:
    body = {"model": M, "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    ids = []
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=300) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                ids += chunk["choices"][0]["token_ids"]
    return ids


def post(base_url: str, body, path: str = "/v1/completions") -> requests.Response:
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    return requests.post(base_url + path, timeout=120, headers={"Content-Type": "application/json"}, **kwargs)


def http_poison(base_url: str, greedy: tuple[list[int], list[int]]) -> None:
    """Each poison input through HTTP: a 4xx with OpenAI's error shape, or (what vLLM serves) the right answer."""
    prompt, want = greedy
    ok = {"model": M, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    for served in ({"temperature": 1e-45}, {"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-45}):
        resp = post(base_url, {**ok, **served})
        assert resp.status_code == 200 and resp.json()["choices"][0]["token_ids"] == want[:8], (served, resp.text)
    refused = [
        ({**ok, "top_k": 2**31}, 400, "'top_k'"),
        ({**ok, "presence_penalty": 1e30}, 400, "'presence_penalty'"),
        ({**ok, "repetition_penalty": 1e30}, 400, "'repetition_penalty'"),
        ({**ok, "frequency_penalty": -1e308}, 400, "'frequency_penalty'"),
        ({**ok, "stop_token_ids": [2**31]}, 400, "'stop_token_ids'"),
        ({**ok, "stop_token_ids": [999]}, 400, "outside the vocabulary"),
        ({**ok, "prompt": [5, 999]}, 400, "outside the vocabulary"),
        ({**ok, "prompt": [5, NAN_TOKEN, 6]}, 400, "not finite"),
        ({**ok, "prompt": "w5 \ud800"}, 400, "lone UTF-16 surrogate"),
        (b'{"model": "x", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "deeper than 64"),
        (b'{"model": "x", "prompt": "' + b"a" * (40 * 2**20) + b'"}', 413, ""),
    ]
    for body, status, words in refused:
        resp = post(base_url, body if isinstance(body, bytes) else json.dumps(body).encode())
        assert resp.status_code == status, (str(body)[:80], resp.text[:300])
        error = resp.json()["error"]
        assert words in error["message"] and set(error) == {"message", "type", "param", "code"}


def frontend_poison(grpc_port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        nan = sampling_to_pb(SamplingParams(max_tokens=4))
        nan.temperature = float("nan")
        cases = [frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[5, 999]),
                                              sampling=sampling_to_pb(SamplingParams(max_tokens=4))),
                 frontend_pb2.GenerateRequest(text="w5 w6", sampling=nan),
                 frontend_pb2.GenerateRequest(text="w5 w6", sampling=sampling_to_pb(
                     SamplingParams(max_tokens=4, stop_token_ids=(999,)))),
                 frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[5, NAN_TOKEN]),
                                              sampling=sampling_to_pb(SamplingParams(max_tokens=4)))]
        for request in cases:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def submit_poison(mesh: Mesh) -> None:
    nan = sampling_to_pb(SamplingParams(max_tokens=4))
    nan.top_p = float("nan")
    cases = [([5, 999], sampling_to_pb(SamplingParams(max_tokens=4))), ([5, 6], nan),
             ([5, NAN_TOKEN], sampling_to_pb(SamplingParams(max_tokens=4)))]
    for i, (prompt, sampling) in enumerate(cases):
        with pytest.raises(grpc.RpcError) as err:
            mesh.submit(f"poison-{i}", prompt, sampling, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    with grpc.insecure_channel(mesh.address) as plain:  # no internal token
        with pytest.raises(grpc.RpcError) as err:
            mesh.submit_stream([("x", [5], SamplingParams(max_tokens=1))], timeout=10,
                               stub=scheduler_pb2_grpc.SchedulerStub(plain))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def under_load(base_url: str, references, poison) -> None:
    """16 greedy streams, the poison sent while they run; every stream gets transformers' tokens."""
    with ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(stream_ids, base_url, prompt) for prompt, _ in references]
        poison()
        running = sum(not s.done() for s in streams)
        got = [s.result(timeout=300) for s in streams]
    assert running, "the streams ended before the poison was through: the test proves nothing"
    assert got == [tokens for _, tokens in references]


def test_poison_through_every_entry_point_hurts_no_stream_pp2(model, references, tmp_path):
    with Mesh(model, [2, 2], handoff="nccl", log_dir=tmp_path) as mesh:
        with Router(model, [mesh.address], ("--served-model-name", M), log_dir=tmp_path, grpc_frontend=True) as r:
            def poison():
                http_poison(r.base_url, references[0])
                frontend_poison(r.grpc_port)
                submit_poison(mesh)

            under_load(r.base_url, references, poison)
            assert requests.get(f"{r.base_url}/health", timeout=5).status_code == 200  # the router is alive
            assert requests.get(f"{r.base_url}/ready", timeout=5).status_code == 200  # and its replica serves
        # while the mesh still runs: as it stops, a stage may exit before its scheduler, which logs that
        assert not _broken([tmp_path])


def test_a_request_that_fails_for_its_own_data_is_not_retried_on_another_replica(model, references, tmp_path):
    logs = [tmp_path / "a", tmp_path / "b"]
    for log in logs:
        log.mkdir()
    with Mesh(model, [4], log_dir=logs[0]) as a, Mesh(model, [4], log_dir=logs[1]) as b:
        with Router(model, [a.address, b.address], ("--served-model-name", M), log_dir=tmp_path) as r:
            def poison():
                for _ in range(3):
                    resp = post(r.base_url, {"model": M, "prompt": [5, NAN_TOKEN], "max_tokens": 4})
                    assert resp.status_code == 400 and "not finite" in resp.json()["error"]["message"]

            under_load(r.base_url, references, poison)
            health = requests.get(f"{r.base_url}/health", timeout=5).json()
            assert [rep["healthy"] for rep in health["replicas"]] == [True, True]
        assert not _broken(logs)  # while the meshes still run (see above)
    failed = sum((log / "scheduler.log").read_text().count("finished: error") for log in logs)
    assert failed == 3  # each poison request ran once, on one replica


def _broken(logs) -> list[str]:
    """The schedulers' "pipeline broken" lines (with their reasons), from the log directories."""
    return [line for log in logs for line in (log / "scheduler.log").read_text().splitlines()
            if "pipeline broken" in line]
