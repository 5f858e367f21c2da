"""vLLM's pooling endpoints (--runner pooling): /v1/embeddings, /pooling, /classify, /score (/v1/score) and
/rerank (/v1/rerank, /v2/rerank), with vLLM's shapes and errors. A model serves the endpoints of its tasks
(stagemesh.core.pooling); the others answer vLLM's 400 ("The model does not support ... API"), as every pooling
endpoint does on a generative model. Score and rerank run the cross-encoder (a classify model with one label) on
each pair, else embed both sides and take the cosine, as vLLM does."""
from __future__ import annotations

import base64
import math
import time
import uuid

from aiohttp import web

from router.admission import admit_engine, shed
from router.errors import bad_request
from router.http_body import read_json
from router.pooling_protocol import (REFUSED_POOLING, ClassificationRequest, EmbeddingRequest, PoolingRequest,
                                     RerankRequest, ScoreRequest)
from router.pooling_run import PoolingJob, fit, run, tokenize
from router.protocol import validate
from router.request_builder import check_model
from router.state import CONFIG, REPLICAS, TENANT, TOKENIZER, checked_request_id
from stagemesh.core.pooling import TASKS, Pooled, PoolerConfig, PoolingParams

API_NAMES = {"embed": "Embeddings API", "classify": "Classification API", "score": "Score API",
             "rerank": "Rerank (Score) API", "pooling": "Pooling API"}


def _pooler(request: web.Request, api: str, *tasks: str) -> PoolerConfig:
    """The server's pooler when its model serves one of `tasks`, else vLLM's refusal of the API."""
    pooler = request.app[CONFIG].pooler
    if pooler is None or not set(tasks) & set(pooler.tasks):
        raise bad_request(f"The model does not support {API_NAMES[api]}")
    return pooler


async def _body(request: web.Request, model):
    body = validate(model, await read_json(request), refused=REFUSED_POOLING)
    config = request.app[CONFIG]
    check_model(body.model, config.served_model_name, ())
    return body


def _first(*values):
    """The first value given (vLLM 0.32's name before 0.11's, then the server's default)."""
    return next((v for v in values if v is not None), None)


def _usage(prompts: list[list[int]]) -> dict:
    n = sum(map(len, prompts))
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


async def _pool(request: web.Request, body, prompts: list[list[int]], params: PoolingParams, prefix: str
                ) -> tuple[str, list[list[int]], list[Pooled], dict[str, str]]:
    """(answer id, the prompts as run, their pooled outputs, the answer's headers: X-Request-Id and, for a tenant
    with per-minute limits, OpenAI's x-ratelimit-*, as a generation's answer carries them)."""
    replicas, config, tenant = request.app[REPLICAS], request.app[CONFIG], request.get(TENANT)
    max_len = admit_engine(replicas, body.priority, config.max_model_len)
    shed(tenant, replicas, config)  # --max-queue-wait holds for pooling work as for a generation's
    prompts = fit(prompts, max_len, body.truncate_prompt_tokens, body.truncation_side)
    given = request.headers.get("X-Request-Id") or body.request_id
    base = uuid.uuid4().hex if given is None else checked_request_id(given)
    limits = config.limits
    headers = {"X-Request-Id": base}
    # its tenant's limits, as a generation's (router.admission, router.choices): one request, its prompt tokens
    # (what its usage says: OpenAI and vLLM count an embedding's input only), one running while it runs
    if limits is not None and tenant is not None:
        headers.update(await limits.admit(tenant, sum(map(len, prompts))))
    ticket = await limits.enter(tenant) if limits is not None and tenant is not None else None
    try:
        pooled = await run(PoolingJob(f"{prefix}-{base}", prompts, params, body.priority, tenant), replicas)
    finally:
        if limits is not None and tenant is not None:
            await limits.leave(tenant, ticket)
    return f"{prefix}-{base}", prompts, pooled, headers


def _embed_params(pooler: PoolerConfig, model_name: str, dimensions: int | None, normalize: bool | None,
                  task: str = "embed") -> PoolingParams:
    """vLLM's checks of `dimensions` (0.32's words): only a Matryoshka model changes its output size, within its
    hidden size and to the sizes its config lists (when it lists any)."""
    dimensions = dimensions if dimensions is not None else pooler.dimensions
    if dimensions is not None:
        if not pooler.is_matryoshka:
            raise bad_request(f"Model {model_name!r} does not support Matryoshka embeddings; dimensions must be unset "
                              f"(received dimensions={dimensions}).", "dimensions")
        if not 1 <= dimensions <= pooler.hidden_size:
            raise bad_request(f"Model {model_name!r} only supports dimensions in range [1, {pooler.hidden_size}], "
                              f"got {dimensions}.", "dimensions")
        allowed = pooler.matryoshka_dimensions
        if allowed and dimensions not in allowed:
            raise bad_request(f"Model {model_name!r} only supports Matryoshka dimensions {list(allowed)}, got "
                              f"{dimensions}.", "dimensions")
    return PoolingParams(task, dimensions, pooler.normalize if normalize is None else normalize)


def _encoded(p: Pooled, encoding_format: str):
    if encoding_format == "base64":  # the float32 bytes, as vLLM and OpenAI send them
        return base64.b64encode(p.data).decode()
    return p.values()


async def embeddings(request: web.Request) -> web.Response:
    pooler = _pooler(request, "embed", "embed")
    body = await _body(request, EmbeddingRequest)
    name = request.app[CONFIG].served_model_name
    params = _embed_params(pooler, name, body.dimensions, _first(body.use_activation, body.normalize))
    prompts = await tokenize(body.input, request.app[TOKENIZER], body.add_special_tokens)
    answer_id, prompts, pooled, headers = await _pool(request, body, prompts, params, "embd")
    data = [{"index": i, "object": "embedding", "embedding": _encoded(p, body.encoding_format)}
            for i, p in enumerate(pooled)]
    return web.json_response({"id": answer_id, "object": "list", "created": int(time.time()), "model": name,
                              "data": data, "usage": _usage(prompts)}, headers=headers)


async def pooling(request: web.Request) -> web.Response:
    pooler = _pooler(request, "pooling", *TASKS)
    body = await _body(request, PoolingRequest)
    task = body.task or pooler.token_task
    if task not in pooler.tasks:
        raise bad_request(f"Task {task} is not supported, it must be one of {sorted(pooler.tasks)}", "task")
    name = request.app[CONFIG].served_model_name
    if task in ("embed", "token_embed"):
        params = _embed_params(pooler, name, body.dimensions, _first(body.use_activation, body.normalize), task)
    else:
        params = PoolingParams(task, activation=_first(body.use_activation, body.activation, pooler.activation))
    prompts = await tokenize(body.input, request.app[TOKENIZER], body.add_special_tokens)
    answer_id, prompts, pooled, headers = await _pool(request, body, prompts, params, "pool")
    data = [{"index": i, "object": "pooling", "data": _encoded(p, body.encoding_format)}
            for i, p in enumerate(pooled)]
    return web.json_response({"id": answer_id, "object": "list", "created": int(time.time()), "model": name,
                              "data": data, "usage": _usage(prompts)}, headers=headers)


async def classify(request: web.Request) -> web.Response:
    pooler = _pooler(request, "classify", "classify")
    body = await _body(request, ClassificationRequest)
    params = PoolingParams("classify", activation=_first(body.use_activation, body.activation, pooler.activation))
    prompts = await tokenize(body.input, request.app[TOKENIZER], body.add_special_tokens)
    answer_id, prompts, pooled, headers = await _pool(request, body, prompts, params, "classify")
    data = []
    for i, p in enumerate(pooled):
        probs = p.values()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": pooler.id2label.get(best), "probs": probs, "num_classes": len(probs)})
    return web.json_response({"id": answer_id, "object": "list", "created": int(time.time()),
                              "model": request.app[CONFIG].served_model_name, "data": data,
                              "usage": _usage(prompts)}, headers=headers)


async def _scores(request: web.Request, body, queries: list[str], documents: list[str], prefix: str
                  ) -> tuple[str, list[float], int, dict[str, str]]:
    """(answer id, one score per (query, document) pair, the tokens they took, the answer's headers): the
    cross-encoder on each pair, or the cosine of the two sides' embeddings (an embedding model)."""
    pooler = request.app[CONFIG].pooler
    assert pooler is not None
    tokenizer, add_special = request.app[TOKENIZER], body.add_special_tokens
    activation = _first(body.use_activation, body.activation, pooler.activation)
    if "score" in pooler.tasks:
        pairs = [await tokenizer.run(_encode_pair, tokenizer, q, d, add_special) for q, d in zip(queries, documents)]
        answer_id, pairs, pooled, headers = await _pool(request, body, pairs,
                                                        PoolingParams("score", activation=activation), prefix)
        return answer_id, [p.values()[0] for p in pooled], sum(map(len, pairs)), headers
    texts = list(dict.fromkeys([*queries, *documents]))  # each text embedded once
    prompts = [await tokenizer.run(tokenizer.encode, t, add_special) for t in texts]
    answer_id, prompts, pooled, headers = await _pool(request, body, prompts, PoolingParams("embed"), prefix)
    vectors = {t: p.values() for t, p in zip(texts, pooled)}
    scores = [_cosine(vectors[q], vectors[d]) for q, d in zip(queries, documents)]
    return answer_id, scores, sum(map(len, prompts)), headers


def _encode_pair(tokenizer, query: str, document: str, add_special_tokens: bool) -> list[int]:
    """A cross-encoder's input: the tokenizer's own pair encoding (text, text_pair), as vLLM builds it."""
    return tokenizer.tok(text=query, text_pair=document, add_special_tokens=add_special_tokens)["input_ids"]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / max(norm, 1e-8)  # (torch's cosine_similarity's eps, which vLLM uses)


def _check_score_model(request: web.Request, api: str) -> None:
    _pooler(request, api, "score", "embed")


async def score(request: web.Request) -> web.Response:
    _check_score_model(request, "score")
    body = await _body(request, ScoreRequest)
    sides = body.sides()
    if sides is None:
        raise bad_request("send 'queries' and 'documents' (or 'text_1' and 'text_2')", "queries")
    queries = [sides[0]] if isinstance(sides[0], str) else list(sides[0])
    documents = [sides[1]] if isinstance(sides[1], str) else list(sides[1])
    if not queries or not documents:
        raise bad_request("At least one text element must be given", "queries" if not queries else "documents")
    if len(queries) > 1 and len(queries) != len(documents):
        raise bad_request("Input lengths must be either 1:1, 1:N or N:N", "queries")
    if len(queries) == 1:
        queries = queries * len(documents)
    answer_id, scores, tokens, headers = await _scores(request, body, queries, documents, "score")
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0, "prompt_tokens_details": None}
    return web.json_response({"id": answer_id, "object": "list", "created": int(time.time()),
                              "model": request.app[CONFIG].served_model_name, "data": data, "usage": usage},
                             headers=headers)


async def rerank(request: web.Request) -> web.Response:
    _check_score_model(request, "rerank")
    body = await _body(request, RerankRequest)
    if not body.documents:
        raise bad_request("At least one text element must be given", "documents")
    if body.top_n < 0:
        raise bad_request("'top_n' must be 0 (every document) or more", "top_n")
    answer_id, scores, tokens, headers = await _scores(request, body, [body.query] * len(body.documents),
                                                       body.documents, "rerank")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    top = order[:body.top_n] if 0 < body.top_n < len(order) else order
    results = [{"index": i, "document": {"text": body.documents[i]}, "relevance_score": scores[i]} for i in top]
    return web.json_response({"id": answer_id, "model": request.app[CONFIG].served_model_name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results},
                             headers=headers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/pooling", pooling)
    app.router.add_post("/classify", classify)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
