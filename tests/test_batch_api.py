"""The Batch API online (/v1/files, /v1/batches) through the official openai client: gateways in this process over
fake replicas (tests/fake_replicas.py: "w5" answers " w6 w7 ..."), then a router process SIGKILLed mid-batch
over a real mesh and started again on the same --batch-dir."""
from __future__ import annotations

import asyncio
import io
import json
import signal
import time

import openai
import pytest

from fake_replicas import FakeReplica, FakeRouter
from mesh import Mesh, Router
from tiny_models import make_tiny_model, with_word_tokenizer

M = "fake-model"


class SlowReplica(FakeReplica):
    """0.1 s a request: batches long enough to cancel or to stop mid-way."""

    async def _outputs(self, prompt, sampling, num_generated):
        await asyncio.sleep(0.1)
        async for out in super()._outputs(prompt, sampling, num_generated):
            yield out


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_word_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("batch") / "tok")


def chat_line(custom_id: str, word: str, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": M, "messages": [{"role": "user", "content": word}], "max_tokens": 3,
                                "temperature": 0, **body}})


def upload(client, lines: list[str]):
    return client.files.create(file=("in.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())), purpose="batch")


def wait_batch(client, batch_id: str, statuses=("completed", "failed", "cancelled"), timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.05)
    raise TimeoutError(f"batch {batch_id} still {batch.status}")


def jsonl(client, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_batch_answers_as_direct_calls_and_bad_lines_go_to_the_error_file(model_dir, tmp_path):
    with FakeRouter(model_dir, M, batch_dir=str(tmp_path)) as router:
        client = router.client()
        good = [chat_line(f"req-{i}", f"w{5 + i}") for i in range(5)]
        bad = ["{not json", json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}),
               chat_line("bad-temp", "w5", temperature=5)]
        f = upload(client, good[:2] + bad + good[2:])
        assert f.purpose == "batch" and f.bytes > 0 and client.files.retrieve(f.id).filename == "in.jsonl"
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                      metadata={"job": "nightly"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
        done = wait_batch(client, batch.id)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 5, 3)
        out = jsonl(client, done.output_file_id)
        assert [r["custom_id"] for r in out] == [f"req-{i}" for i in range(5)]  # input order
        for i, record in enumerate(out):
            direct = client.chat.completions.create(model=M, messages=[{"role": "user", "content": f"w{5 + i}"}],
                                                    max_tokens=3, temperature=0)
            assert record["response"]["status_code"] == 200
            assert record["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        errors = jsonl(client, done.error_file_id)
        assert [e["custom_id"] for e in errors] == [None, "x", "bad-temp"]
        assert errors[0]["error"]["code"] == "invalid_json" and errors[1]["error"]["code"] == "invalid_url"
        with pytest.raises(openai.BadRequestError) as direct_error:
            client.chat.completions.create(model=M, messages=[{"role": "user", "content": "w5"}], max_tokens=3,
                                           temperature=5)
        assert errors[2]["response"]["status_code"] == 400
        assert errors[2]["response"]["body"]["error"] == direct_error.value.body  # the same error as a direct call
        assert batch.id in [b.id for b in client.batches.list()]
        assert {f.id, done.output_file_id} <= {x.id for x in client.files.list()}
        assert client.files.delete(f.id).deleted and f.id not in [x.id for x in client.files.list()]
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(f.id)


def test_oversized_files_are_413_with_the_limit_and_the_api_is_off_without_a_dir(model_dir, tmp_path):
    with FakeRouter(model_dir, M, batch_dir=str(tmp_path), batch_max_file_bytes=1000) as router:
        with pytest.raises(openai.APIStatusError) as err:
            upload(router.client(), [chat_line(f"r{i}", "w5") for i in range(20)])
        assert err.value.status_code == 413 and "1,000 bytes (--batch-max-file-bytes)" in err.value.message
        assert list((tmp_path / "files").iterdir()) == []  # nothing half-written is left
        with pytest.raises(openai.BadRequestError, match="'endpoint' must be one of"):
            router.client().batches.create(input_file_id="file-0", endpoint="/v1/responses",
                                           completion_window="24h")
    with FakeRouter(model_dir, M) as router, pytest.raises(openai.BadRequestError, match="--batch-dir"):
        router.client().batches.list()


def test_cancel_stops_what_has_not_started(model_dir, tmp_path):
    with FakeRouter(model_dir, M, replica_class=SlowReplica, batch_dir=str(tmp_path), batch_concurrency=2) as r:
        client = r.client()
        f = upload(client, [chat_line(f"r{i}", "w5") for i in range(40)])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < 4:
            time.sleep(0.02)
        assert client.batches.cancel(batch.id).status == "cancelling"
        done = wait_batch(client, batch.id)
        assert done.status == "cancelled" and done.request_counts.total == 40
        assert 4 <= done.request_counts.completed < 12 and len(r.replica.submitted) == done.request_counts.completed
        assert len(jsonl(client, done.output_file_id)) == done.request_counts.completed


def test_a_batch_goes_on_after_its_router_stops(model_dir, tmp_path):
    """A router stops mid-batch; another on the same --batch-dir takes the batch up and runs only the lines the
    first did not finish: every line's answer once, in input order."""
    lines = [chat_line(f"r{i}", f"w{5 + i}") for i in range(20)]
    with FakeRouter(model_dir, M, replica_class=SlowReplica, batch_dir=str(tmp_path), batch_concurrency=2) as a:
        f = upload(a.client(), lines)
        batch = a.client().batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
        while a.client().batches.retrieve(batch.id).request_counts.completed < 5:
            time.sleep(0.02)
    with FakeRouter(model_dir, M, batch_dir=str(tmp_path)) as b:
        done = wait_batch(b.client(), batch.id)
        out = jsonl(b.client(), done.output_file_id)
        assert done.status == "completed" and done.request_counts.completed == 20
        assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(20)]
        assert [r["response"]["body"]["choices"][0]["message"]["content"] for r in out] == \
            [f" w{6 + i} w{7 + i} w{8 + i}" for i in range(20)]
        assert 5 <= len(a.replica.submitted) and len(b.replica.submitted) <= 15


@pytest.mark.slow
def test_a_router_sigkilled_mid_batch_loses_nothing(tmp_path):
    """A real router process SIGKILLed while its batch runs, started again on the same --batch-dir over the same
    mesh: the batch completes with every line's answer equal to a direct call's."""
    model = with_word_tokenizer(make_tiny_model(tmp_path / "raw", "llama"), tmp_path / "model")
    flags = ("--batch-dir", str(tmp_path / "batches"), "--batch-concurrency", "2")
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": str(model), "prompt": f"w{5 + i} w9", "max_tokens": 40, "temperature": 0,
                                  "ignore_eos": True}}) for i in range(16)]
    with Mesh(model, [4], log_dir=tmp_path) as mesh:
        with Router(model, [mesh.address], extra=flags, log_dir=tmp_path) as first:
            client = first.client()
            f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            while client.batches.retrieve(batch.id).request_counts.completed < 3:
                time.sleep(0.05)
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
        with Router(model, [mesh.address], extra=flags, log_dir=tmp_path) as second:
            client = second.client(timeout=120)
            done = wait_batch(client, batch.id, timeout=240)
            out = jsonl(client, done.output_file_id)
            assert done.status == "completed" and done.request_counts.completed == 16 and done.error_file_id is None
            assert [r["custom_id"] for r in out] == [f"r{i}" for i in range(16)]
            for i in (0, 7, 15):
                direct = client.completions.create(model=str(model), prompt=f"w{5 + i} w9", max_tokens=40,
                                                   temperature=0, extra_body={"ignore_eos": True})
                assert out[i]["response"]["body"]["choices"][0]["text"] == direct.choices[0].text


def test_a_batchs_lines_run_as_its_tenants_requests(model_dir, tmp_path):
    """Under --api-keys-file, a batch's lines run as requests of the tenant that created it (no key of it kept):
    they answer, and count against its requests_per_minute as its direct calls do; another tenant's are not."""
    from router.limits import MemoryWindows, TenantLimits
    from router.tenants import Tenants

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": {"alpha": {"keys": ["ka"]},
                                            "gamma": {"keys": ["kc"], "requests_per_minute": 3}}}))
    with FakeRouter(model_dir, M, batch_dir=str(tmp_path / "batches"), tenants=Tenants.from_file(str(keys)),
                    limits=TenantLimits(MemoryWindows())) as router:
        client = router.client(api_key="kc")
        f = upload(client, [chat_line(f"req-{i}", f"w{5 + i}") for i in range(3)])
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_batch(client, batch.id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 0)
        assert "stagemesh_tenant" not in done.model_dump()
        assert {r["response"]["status_code"] for r in jsonl(client, done.output_file_id)} == {200}
        with pytest.raises(openai.RateLimitError):  # gamma's 3 a minute went to its batch
            client.chat.completions.create(model=M, messages=[{"role": "user", "content": "w5"}], max_tokens=2)
        other = router.client(api_key="ka")
        assert other.chat.completions.create(model=M, messages=[{"role": "user", "content": "w5"}], max_tokens=2)
        # a tenant's files and batches are not there for another: 404 to every call, and out of its lists
        for call in (lambda: other.files.retrieve(f.id), lambda: other.files.content(done.output_file_id),
                     lambda: other.files.delete(f.id), lambda: other.batches.retrieve(batch.id),
                     lambda: other.batches.cancel(batch.id),
                     lambda: other.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert [x.id for x in other.files.list()] == [] and [x.id for x in other.batches.list()] == []
        assert {x.id for x in client.files.list()} == {f.id, done.output_file_id}
        assert [x.id for x in client.batches.list()] == [batch.id]
        assert client.files.retrieve(done.output_file_id).model_dump().get("stagemesh_owner") is None
