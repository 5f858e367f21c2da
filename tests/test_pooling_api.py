"""vLLM's pooling endpoints through the router over real meshes run with --runner pooling, with the official openai
client where it has the call: an embedding model on PP=2, a cross-encoder (a sequence-classification checkpoint
with one label) on TP=2, each against transformers on the same weights; a tenant's per-minute limits
(--api-keys-file) on the pooling endpoints, with OpenAI's x-ratelimit-* headers, and --max-queue-wait's 503 for a
flooding tenant while another's embeddings go through."""
from __future__ import annotations

import base64
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from mesh import Mesh, Router
from test_pooling import seq_cls_model
from tiny_models import make_tiny_model, with_word_tokenizer

pytestmark = pytest.mark.slow
POOLING = ("--runner", "pooling")
TEXTS = ["w5 w6 w7 w8", "w9 w10 w11", "w12 w13 w14 w15 w16 w17"]


@pytest.fixture(scope="module")
def embed_router(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-embed")
    model = with_word_tokenizer(make_tiny_model(root / "raw", "llama"), root / "model")
    with Mesh(model, [2, 2], stage_args=POOLING, log_dir=root) as mesh:
        with Router(model, [mesh.address], extra=POOLING, log_dir=root) as r:
            r.model_dir, r.mesh = model, mesh
            yield r


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-cls")
    model = with_word_tokenizer(seq_cls_model(root / "raw", 1), root / "model")
    with Mesh(model, [4], tp=[2], stage_args=POOLING, log_dir=root) as mesh:
        with Router(model, [mesh.address], log_dir=root) as r:  # (--runner auto: a classification checkpoint)
            r.model_dir = model
            yield r


def post(router, path: str, body: dict) -> requests.Response:
    return requests.post(f"{router.base_url}{path}", json={"model": str(router.model_dir), **body}, timeout=120)


@torch.inference_mode()
def last_hidden(model_dir, ids: list[int], normalize: bool = True) -> np.ndarray:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    h = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return (torch.nn.functional.normalize(h, dim=0) if normalize else h).numpy()


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]  # the word tokenizer: "w5" is token 5


def test_embeddings_equal_transformers_normalized_last_hidden_state(embed_router):
    client, name = embed_router.client(), str(embed_router.model_dir)
    out = client.embeddings.create(model=name, input=TEXTS)  # (the openai client asks for base64 and decodes it)
    assert [d.index for d in out.data] == [0, 1, 2]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(len(t.split()) for t in TEXTS)
    for text, d in zip(TEXTS, out.data):
        np.testing.assert_allclose(d.embedding, last_hidden(embed_router.model_dir, ids_of(text)), atol=1e-4)
    floats = post(embed_router, "/v1/embeddings", {"input": [ids_of(TEXTS[0])], "encoding_format": "float"}).json()
    np.testing.assert_allclose(floats["data"][0]["embedding"], out.data[0].embedding, atol=1e-6)
    b64 = post(embed_router, "/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, out.data[1].embedding, atol=1e-6)
    assert floats["object"] == "list" and floats["id"].startswith("embd-")


def test_embedding_errors_are_vllms(embed_router):
    name = str(embed_router.model_dir)
    r = post(embed_router, "/v1/embeddings", {"input": "w5", "dimensions": 8})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (f"Model {name!r} does not support Matryoshka embeddings; dimensions must "
                                            "be unset (received dimensions=8).")
    long = [5 + i % 300 for i in range(600)]  # token ids: the tiny model's context is 512
    r = post(embed_router, "/v1/embeddings", {"input": long})
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "This model's maximum context length is 512 tokens. However, your prompt contains 600 input tokens, which "
        "exceeds this limit even without any output tokens. Please reduce the length of the input prompt.")
    r = post(embed_router, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": 4, "encoding_format": "float"})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"],
                               last_hidden(embed_router.model_dir, long[-4:]), atol=1e-4)
    assert r.json()["usage"]["prompt_tokens"] == 4
    r = post(embed_router, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": 4, "truncation_side": "right",
                                              "use_activation": False, "encoding_format": "float"})
    raw = last_hidden(embed_router.model_dir, long[:4], normalize=False)  # the first 4 tokens, not normalized
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], raw, atol=1e-4)
    assert post(embed_router, "/classify", {"input": "w5"}).json()["error"]["message"] == \
        "The model does not support Classification API"
    chat = post(embed_router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]})
    assert chat.status_code == 400 and chat.json()["error"]["message"] == "The model does not support Chat " \
                                                                          "Completions API"


def test_a_generative_router_refuses_embeddings_with_vllms_text(embed_router):
    with Router(embed_router.model_dir, [embed_router.mesh.address]) as generative:
        generative.model_dir = embed_router.model_dir
        r = post(generative, "/v1/embeddings", {"input": "w5"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "The model does not support Embeddings API"


LIMITED = {"tenants": {"pool": {"keys": ["kp"], "requests_per_minute": 4, "tokens_per_minute": 1000},
                       "tight": {"keys": ["kt"], "tokens_per_minute": 4}}}
RATE_HEADERS = {f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset")
                for kind in ("requests", "tokens")}


def test_pooling_answers_carry_the_tenants_ratelimit_headers_as_a_generations_do(embed_router, tmp_path):
    """Each pooling answer of a limited tenant carries OpenAI's x-ratelimit-* headers and X-Request-Id, as a chat
    answer does; its tokens are its prompt's (its usage), with nothing for output; the request past a limit is a
    429 with Retry-After and the headers of that limit, as chat's."""
    import openai

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(LIMITED))
    name, texts = str(embed_router.model_dir), {"w5 w6 w7 w8": 4, "w9 w10": 2}
    with Router(name, [embed_router.mesh.address], extra=(*POOLING, "--api-keys-file", str(keys))) as router:
        raw = router.client(api_key="kp").embeddings.with_raw_response.create(model=name, input=list(texts))
        out, headers = raw.parse(), raw.headers
        assert RATE_HEADERS <= set(headers) and out.id == f"embd-{headers['x-request-id']}"
        assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("4", "3")
        assert out.usage.prompt_tokens == sum(texts.values())  # the tenant's first: the window holds it alone
        assert headers["x-ratelimit-remaining-tokens"] == str(1000 - out.usage.prompt_tokens)
        answers = [requests.post(f"{router.base_url}{path}", headers={"x-api-key": "kp"}, timeout=120,
                                 json={"model": name, **body})
                   for path, body in (("/score", {"text_1": "w5", "text_2": ["w6", "w7"]}),
                                      ("/v1/rerank", {"query": "w5", "documents": ["w6", "w7"]}),
                                      ("/pooling", {"input": "w5 w6", "task": "embed"}))]
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert all(RATE_HEADERS <= set(a.headers) for a in answers)
        assert answers[-1].headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as refused:
            router.client(api_key="kp").embeddings.create(model=name, input="w5")
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert "requests_per_minute (4)" in refused.value.response.json()["error"]["message"]
        # tokens_per_minute 4: a 4-token input fits exactly (no output counted), then one more token does not
        tight = router.client(api_key="kt").embeddings.with_raw_response.create(model=name, input="w5 w6 w7 w8")
        assert tight.headers["x-ratelimit-remaining-tokens"] == "0" and tight.parse().usage.prompt_tokens == 4
        assert "x-ratelimit-limit-requests" not in tight.headers  # (it has no requests_per_minute)
        over = requests.post(f"{router.base_url}/v1/embeddings", headers={"Authorization": "Bearer kt"}, timeout=120,
                             json={"model": name, "input": "w5"})
        assert over.status_code == 429 and "tokens_per_minute (4)" in over.json()["error"]["message"]
        assert int(over.headers["Retry-After"]) >= 1 and over.headers["x-ratelimit-limit-tokens"] == "4"
        nobody = requests.post(f"{router.base_url}/v1/embeddings", headers={"x-api-key": "nobody"}, timeout=30,
                               json={"model": name, "input": "w5"})
        assert nobody.status_code == 401


SHEDDING = {"tenants": {"flood": {"keys": ["kf"], "weight": 1}, "light": {"keys": ["kl"], "weight": 20}}}
# one flood call: 32 inputs of 500 token ids, 16,000 tokens (8 steps of the schedulers' 2,048-token budget)
FLOOD = [[5 + (7 * i + j) % 300 for j in range(500)] for i in range(32)]


def _flood(router, name: str, stop: threading.Event) -> list[int]:
    """The flooding tenant's embeddings back to back until `stop`: the status of each."""
    codes = []
    while not stop.is_set():
        r = requests.post(f"{router.base_url}/v1/embeddings", headers={"x-api-key": "kf"}, timeout=120,
                          json={"model": name, "input": FLOOD, "encoding_format": "float"})
        codes.append(r.status_code)
        if r.status_code == 503:
            stop.wait(0.1)  # (shed at once: no need to hammer the router)
    return codes


def test_max_queue_wait_sheds_a_flooding_tenants_embeddings_with_a_503(embed_router, tmp_path):
    """--max-queue-wait 2 over a pooling mesh that a tenant floods with more embedding work than it can run:
    once that tenant's waiting requests have waited past its bound (weight 1 of 20: 0.1 s), its next embeddings
    call is a 503 with Retry-After, as a chat request's, counted in the per-tenant refusals; the other tenant,
    with nothing waiting, still gets its embeddings (transformers' values) under the same flood."""
    import openai

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(SHEDDING))
    name, stop = str(embed_router.model_dir), threading.Event()
    extra = (*POOLING, "--api-keys-file", str(keys), "--max-queue-wait", "2", "--health-interval", "0.2")
    with Router(name, [embed_router.mesh.address], extra=extra) as router, ThreadPoolExecutor(2) as pool:
        floods = [pool.submit(_flood, router, name, stop) for _ in range(2)]
        try:
            deadline = time.monotonic() + 120  # (each probe that gets in waits its turn behind the flood)
            while True:
                try:
                    router.client(api_key="kf").embeddings.create(model=name, input="w5")
                except openai.APIStatusError as err:
                    refused = err
                    break
                assert time.monotonic() < deadline, "the flood never made its tenant's queue wait past 0.1 s"
            light = router.client(api_key="kl").embeddings.create(model=name, input=TEXTS[0])
        finally:
            stop.set()
        codes = [c for f in floods for c in f.result()]
        metrics = requests.get(f"{router.base_url}/metrics", headers={"x-api-key": "kl"}, timeout=30).text
    assert isinstance(refused, openai.InternalServerError) and refused.status_code == 503
    assert int(refused.response.headers["Retry-After"]) >= 1
    message = refused.response.json()["error"]["message"]
    assert re.fullmatch(r"the server is saturated: the waiting requests of tenant 'flood' have waited \d+\.\d s, "
                        r"past 0\.1 s \(--max-queue-wait 2 for its weight\)", message), message
    np.testing.assert_allclose(light.data[0].embedding, last_hidden(embed_router.model_dir, ids_of(TEXTS[0])),
                               atol=1e-4)
    assert set(codes) <= {200, 503} and 200 in codes  # the flood's own calls: run, or shed; none lost
    refusals = {(x.labels["tenant"], x.labels["code"], x.labels["reason"]): x.value
                for family in text_string_to_metric_families(metrics) for x in family.samples
                if x.name == "stagemesh:tenant_requests_refused_total"}
    assert refusals.get(("flood", "503", "max_queue_wait"), 0) >= 1 and ("light", "503", "max_queue_wait") not in \
        refusals, refusals


def test_score_and_rerank_of_an_embedding_model_are_cosines(embed_router):
    score = post(embed_router, "/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    e = [last_hidden(embed_router.model_dir, ids_of(t)) for t in TEXTS]
    np.testing.assert_allclose([d["score"] for d in score["data"]], [e[0] @ e[1], e[0] @ e[2]], atol=1e-4)
    ranked = post(embed_router, "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:]}).json()["results"]
    assert sorted(r["relevance_score"] for r in ranked) == pytest.approx(sorted(d["score"] for d in score["data"]))


@torch.inference_mode()
def classifier_logits(model_dir, pairs: list[tuple[str, str]]) -> list[float]:
    """transformers' logit of each (query, document) pair, tokenized as a pair by the model's tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [float(model(torch.tensor([tok(text=q, text_pair=d)["input_ids"]])).logits[0, 0]) for q, d in pairs]


def test_score_and_rerank_agree_with_each_other_and_the_classifier(cross_encoder):
    query, docs = "w20 w21 w22", TEXTS
    logits = classifier_logits(cross_encoder.model_dir, [(query, d) for d in docs])
    expected = torch.sigmoid(torch.tensor(logits)).tolist()
    for path, names in (("/score", ("text_1", "text_2")), ("/v1/score", ("queries", "documents"))):
        score = post(cross_encoder, path, {names[0]: query, names[1]: docs}).json()
        assert [d["index"] for d in score["data"]] == [0, 1, 2]
        assert [d["score"] for d in score["data"]] == pytest.approx(expected, abs=1e-4)
    order = sorted(range(3), key=lambda i: -expected[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(cross_encoder, path, {"query": query, "documents": docs, "top_n": 2}).json()
        assert [r["index"] for r in body["results"]] == order[:2]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[i] for i in order[:2]],
                                                                                abs=1e-4)
        assert body["results"][0]["document"]["text"] == docs[order[0]] and body["usage"]["total_tokens"] > 0
    pairwise = post(cross_encoder, "/score", {"text_1": [query, query], "text_2": docs[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(expected[:2], abs=1e-4)
    bad = post(cross_encoder, "/score", {"text_1": [query, query], "text_2": docs})
    assert bad.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"


def test_classify_and_pooling_on_the_cross_encoder(cross_encoder):
    [logit] = classifier_logits(cross_encoder.model_dir, [("w5", "w6")])  # (the pair is tokens 5, 6)
    body = post(cross_encoder, "/classify", {"input": [[5, 6]]}).json()
    assert body["data"][0]["probs"] == pytest.approx([float(torch.sigmoid(torch.tensor(logit)))], abs=1e-4)
    assert body["data"][0]["label"] == "LABEL_0" and body["data"][0]["num_classes"] == 1
    assert post(cross_encoder, "/v1/embeddings", {"input": "w5"}).json()["error"]["message"] == \
        "The model does not support Embeddings API"
    rows = post(cross_encoder, "/pooling", {"input": [[5, 6, 7]], "task": "token_classify"}).json()
    assert len(rows["data"][0]["data"]) == 3  # one row per token (the score head's, sigmoid on its one label)
