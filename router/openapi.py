"""GET /openapi.json: the gateway's endpoints and their request schemas, from router.protocol's models."""
from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from router.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from router.responses_api.request import ResponsesRequest

ENDPOINTS: list[tuple[str, str, str, type[BaseModel] | None]] = [
    ("post", "/v1/completions", "Complete prompts (OpenAI's Completions API, vLLM's extensions)", CompletionRequest),
    ("post", "/v1/chat/completions", "Answer a conversation (OpenAI's Chat Completions API, vLLM's extensions)",
     ChatCompletionRequest),
    ("post", "/v1/responses", "Answer input items (OpenAI's Responses API: function tools, structured output, "
                              "streamed events, previous_response_id over the response store)", ResponsesRequest),
    ("get", "/v1/responses/{response_id}", "A stored response", None),
    ("delete", "/v1/responses/{response_id}", "Delete a stored response", None),
    ("post", "/v1/responses/{response_id}/cancel", "Cancel a background response (there are none: 400)", None),
    ("post", "/tokenize", "Token ids of a prompt or a conversation", TokenizeRequest),
    ("post", "/detokenize", "Text of token ids", DetokenizeRequest),
    ("get", "/v1/models", "The served model and its LoRA adapters (--lora-modules, with their parent)", None),
    ("get", "/health", "Liveness: 200 while the router serves, with its replicas' state", None),
    ("get", "/ready", "Readiness: 200 while a replica can take new work and the router is not draining, 503 "
                      "otherwise", None),
    ("get", "/version", "The server's version", None),
    ("get", "/metrics", "Prometheus metrics", None),
]
# the endpoints that need the Responses API's store (--responses-store), and so answer 503 while it is down
STORE_PATHS = ("/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel")


@functools.cache
def openapi_document() -> dict:
    from stagemesh import __version__

    paths: dict[str, dict[str, dict]]
    op: dict[str, Any]
    schemas, paths = {}, {}
    for method, path, summary, model in ENDPOINTS:
        op = {"summary": summary, "responses": {"200": {"description": "OK"},
                                                "4XX": {"description": "An OpenAI-shaped error"}}}
        if path in STORE_PATHS:
            op["responses"]["503"] = {"description": "The response store (--responses-store) is unavailable"}
        if model is not None:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        paths.setdefault(path, {})[method] = op
    return {"openapi": "3.1.0", "info": {"title": "stagemesh", "version": __version__}, "paths": paths,
            "components": {"schemas": schemas}}
