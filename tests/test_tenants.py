"""Tenants at the router (router.tenants): the keys file and its refusals, each naming the line; a key of no
tenant is a 401, a tenant's key in either header form is taken; the tenant and its weight travel with every
engine request, continuations included, and own its resumable requests; the file is read again (SIGHUP, the
control port) without a restart, a bad file keeping the tenants it had. Over fake replicas: no model runs."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
import requests

from fake_replicas import FakeRouter
from router.state import tenant_owner
from router.tenants import Tenants, key_of, parse
from stagemesh.core.errors import StagemeshError
from tiny_models import with_word_tokenizer

M = "llama-tiny"
FILE = {"tenants": {
    "alpha": {"keys": ["ka1", "ka2"], "weight": 3},
    "beta": {"keys": ["kb"], "requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrency": 2},
}}


def write(path, doc) -> str:
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=2))
    return str(path)


@pytest.mark.parametrize("text,words", [
    ('{"tenants": {\n  "a": {"keys": ["k"]},\n  "b": {"keys": ["j"],}\n}}', "line 3: not JSON"),
    ('{"tenants": {\n  "a": {"keys": ["k"]},\n  "b": {\n    "keys": ["k"]}}}', "line 4: tenant 'b': a key is listed "
                                                                             "also under tenant 'a'"),
    ('{"tenants": {\n  "a": {"keys": ["k"], "weight": 0}}}', "line 2: tenant 'a': \"weight\" must be a number > 0"),
    ('{"tenants": {\n  "a": {"keys": ["k"]},\n  "b": {"keys": ["j"],\n    "weight": -1}}}', "line 4: tenant 'b'"),
    ('{"tenants": {\n  "a": {"keys": ["k"]},\n  "a": {"keys": ["j"]}}}', "line 3: 'a' appears twice"),
    ('{"tenants": {\n  "a": {"keys": ["k"], "rate": 5}}}', "line 2: tenant 'a': unknown field 'rate'"),
    ('{"tenants": {"a": {"keys": []}}}', "\"keys\" must be a non-empty list"),
    ('{"tenants": {"a": {"keys": ["has space"]}}}', "without spaces"),
    ('{"tenants": {"a": {"keys": ["k"], "max_concurrency": 0}}}', "'max_concurrency' must be an integer >= 1"),
    ('{"tenants": {"a": {"keys": ["k"], "weight": true}}}', "\"weight\" must be a number > 0"),
    ('{"users": {}}', "must be a JSON object {\"tenants\""),
])
def test_a_bad_keys_file_is_refused_naming_the_line(text, words):
    with pytest.raises(StagemeshError) as err:
        parse(text, "keys.json")
    assert words in str(err.value) and "keys.json" in str(err.value)


def test_keys_in_the_header_forms_vllm_and_anthropic_clients_send():
    assert key_of({"Authorization": "Bearer k1"}) == "k1"
    assert key_of({"Authorization": "bearer k1"}) == "k1"  # (vLLM reads the scheme in any case)
    assert key_of({"x-api-key": "k2"}) == "k2"
    assert key_of({"Authorization": "Basic k1"}) is None and key_of({}) is None


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("tenants") / "tok")


def complete(router, headers: dict, max_tokens: int = 4) -> requests.Response:
    return requests.post(f"{router.base_url}/v1/completions", headers=headers, timeout=30,
                         json={"model": M, "prompt": [5, 6, 7], "max_tokens": max_tokens})


def test_each_tenant_key_is_taken_in_either_form_and_any_other_is_401(model_dir, tmp_path):
    tenants = Tenants.from_file(write(tmp_path / "keys.json", FILE))
    with FakeRouter(model_dir, M, tenants=tenants, num_replicas=2, grpc_frontend=True) as router:
        for headers in ({}, {"Authorization": "Bearer nobody"}, {"x-api-key": "nobody"}):
            resp = complete(router, headers)
            assert resp.status_code == 401 and "API key" in resp.json()["error"]["message"]
        assert complete(router, {"Authorization": "Bearer ka2"}).status_code == 200
        assert complete(router, {"x-api-key": "kb"}).status_code == 200
        sent = [r for replica in router.replicas for r in replica.requests]
        assert [(r.tenant, r.tenant_weight) for r in sent] == [("alpha", 3.0), ("beta", 1.0)]
        assert sent[0].owner == tenant_owner("alpha")  # the tenant, not the key, owns its requests
        assert requests.get(f"{router.base_url}/health", timeout=10).status_code == 200  # (open)
        _grpc_door(router)


def _grpc_door(router) -> None:
    from stagemesh.client import Client

    with Client(f"127.0.0.1:{router.grpc_port}", api_key="kb") as client:
        assert len(client.generate([5, 6, 7], max_tokens=3).token_ids) == 3
    assert router.replicas[0].requests[-1].tenant == "beta" or router.replicas[1].requests[-1].tenant == "beta"
    with Client(f"127.0.0.1:{router.grpc_port}", api_key="nobody") as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate([5, 6, 7], max_tokens=3)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_continuation_keeps_its_tenant(model_dir, tmp_path):
    tenants = Tenants.from_file(write(tmp_path / "keys.json", FILE))
    with FakeRouter(model_dir, M, tenants=tenants, num_replicas=2) as router:
        a, b = router.replicas
        a.fail_after = 2  # (least load: it starts on the first)
        resp = complete(router, {"Authorization": "Bearer ka1"}, max_tokens=6)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 6
    continued = [r for r in (*a.requests, *b.requests) if r.generated_token_ids]
    assert continued and {(r.tenant, r.tenant_weight) for r in continued} == {("alpha", 3.0)}


def test_api_key_is_one_tenant_and_cannot_go_with_a_file(model_dir, tmp_path):
    with FakeRouter(model_dir, M, api_key="sekret") as router:
        assert complete(router, {"x-api-key": "sekret"}).status_code == 200
        assert router.replica.requests[-1].tenant == "default"
    with pytest.raises(StagemeshError, match="cannot both be given"):
        FakeRouter(model_dir, M, api_key="sekret", tenants=Tenants.from_file(write(tmp_path / "k.json", FILE)))


def test_reload_takes_a_new_key_and_a_bad_file_keeps_the_tenants(tmp_path):
    path = tmp_path / "keys.json"
    tenants = Tenants.from_file(write(path, FILE))
    write(path, {"tenants": {**FILE["tenants"], "gamma": {"keys": ["kc"]}}})
    assert "3 tenant(s)" in tenants.reload() and tenants.tenant({"x-api-key": "kc"}).name == "gamma"
    write(path, '{"tenants": {"gamma": {"keys": ["kc"], "weight": 0}}}')
    with pytest.raises(StagemeshError, match="weight"):
        tenants.reload()
    assert tenants.tenant({"x-api-key": "kc"}).name == "gamma" and tenants.tenant({"x-api-key": "ka1"}) is not None


def test_a_router_reads_its_keys_file_again_on_sighup_and_refuses_a_bad_one_at_start(model_dir, tmp_path):
    """The real process: refused at start-up naming the line; on SIGHUP, or the control port's ReloadApiKeys (serve's
    admin call), a new tenant's key works, no restart; a bad file keeps the tenants, and says why."""
    from stagemesh.core.internal_token import ENV
    from stagemesh.entry.ops.rpc import MeshRPC

    bad = write(tmp_path / "bad.json", '{"tenants": {\n  "a": {"keys": ["k"],\n   "weight": 0}}}')
    args = [sys.executable, "-m", "stagemesh", "router", str(model_dir), "--replica", "127.0.0.1:1", "--port", "0",
            "--host", "127.0.0.1"]
    refused = subprocess.run([*args, "--api-keys-file", bad], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "bad.json, line 3" in refused.stderr
    path = tmp_path / "keys.json"
    write(path, FILE)
    log = tmp_path / "router.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*args, "--api-keys-file", str(path), "--control-port", "0"], stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, ENV: "tenants-test-t0ken"})
    rpc = MeshRPC("tenants-test-t0ken")
    try:
        port, control = _wait_for_port(log, proc, "on http://127.0.0.1:"), _wait_for_port(log, proc, "127.0.0.1:")
        url = f"http://127.0.0.1:{port}/v1/models"
        assert requests.get(url, headers={"x-api-key": "kc"}, timeout=10).status_code == 401
        write(path, {"tenants": {**FILE["tenants"], "gamma": {"keys": ["kc"]}}})
        proc.send_signal(signal.SIGHUP)
        assert _eventually(lambda: requests.get(url, headers={"x-api-key": "kc"}, timeout=10).status_code == 200)
        write(path, "{oops")
        proc.send_signal(signal.SIGHUP)
        assert _eventually(lambda: "not reloaded" in log.read_text())
        reloaded, said = rpc.reload_api_keys(f"127.0.0.1:{control}")
        assert not reloaded and "line 1: not JSON" in said
        assert requests.get(url, headers={"x-api-key": "kc"}, timeout=10).status_code == 200
        write(path, {"tenants": {"delta": {"keys": ["kd"]}}})
        assert rpc.reload_api_keys(f"127.0.0.1:{control}") == (True, "1 tenant(s), 1 key(s): delta (weight 1)")
        assert requests.get(url, headers={"x-api-key": "kc"}, timeout=10).status_code == 401
        assert requests.get(url, headers={"x-api-key": "kd"}, timeout=10).status_code == 200
        assert proc.poll() is None
    finally:
        rpc.close()
        proc.terminate()
        proc.wait(30)


def _wait_for_port(log, proc, said: str) -> int:
    """The port the router's log names after `said` (its HTTP port; its control port: "... RouterControl) on ")."""
    listening = re.compile(re.escape(said) + r"(\d+)" if said.startswith("on") else
                           r"RouterControl\) on 127\.0\.0\.1:(\d+)")
    assert _eventually(lambda: listening.search(log.read_text()) or proc.poll() is not None, 120)
    assert proc.poll() is None, log.read_text()
    return int(listening.search(log.read_text()).group(1))


def _eventually(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False




def test_a_tenants_flood_spreads_over_the_replicas_and_a_light_tenant_follows_the_policy():
    """router.replica_set.tenant_spread: a replica holding TENANT_SLACK more of a tenant's requests than another
    is left out for that tenant only; the policy (here: always the first) picks among the rest."""
    from fake_replicas import FakeReplica
    from router.replica_set import TENANT_SLACK, ReplicaSet
    from stagemesh.core.engine_request import EngineRequest

    class First:
        def pick(self, replicas, prompt, root=None):
            return replicas[0]

    a, b = (FakeReplica(M, 512, 100, address=f"fake:{i}") for i in range(2))
    replicas = ReplicaSet([], First())
    replicas.replicas = [a, b]
    picks = []
    for _ in range(3 * TENANT_SLACK):
        replica = replicas.pick(EngineRequest("r", [1, 2], tenant="alpha"))
        replica.tenants["alpha"] += 1
        picks.append(replica.address)
    assert abs(a.tenants["alpha"] - b.tenants["alpha"]) <= TENANT_SLACK + 1 and b.tenants["alpha"] > 0
    assert replicas.pick(EngineRequest("r", [1, 2], tenant="beta")) is a  # (beta has none anywhere)
