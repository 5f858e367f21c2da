"""The pooling endpoints' request schema, as vLLM's (0.11): /v1/embeddings (OpenAI's, with vLLM's extras), /pooling,
/classify, /score and /rerank (Jina's and Cohere's shape). Validated by router.protocol.validate, like every body."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from router.protocol import Strict, TokenIds

# a text, texts, token ids, or lists of token ids (OpenAI's embeddings input)
Input = Union[str, list[str], TokenIds, list[TokenIds]]


class _PoolingBase(Strict):
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # keep the last N tokens of each input (-1: max_model_len)
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None
    user: str | None = None


class EmbeddingRequest(_PoolingBase):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # a Matryoshka model's first N values
    normalize: bool | None = None  # vLLM's: None takes the server's (--pooler-config normalize)


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "classify", "score", "token_embed", "token_classify"] | None = None
    activation: bool | None = None


class ClassificationRequest(_PoolingBase):
    input: Input
    activation: bool | None = None


class ScoreRequest(_PoolingBase):
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    activation: bool | None = None


class RerankRequest(_PoolingBase):
    query: str
    documents: list[str]
    top_n: int = Field(default=0)  # 0: every document
    activation: bool | None = None


# fields of vLLM's pooling requests not served here: a 400 naming the field when given
REFUSED_POOLING = {
    "messages": "chat-style pooling requests ('messages') are not served yet: send 'input'",
    "mm_processor_kwargs": "multimodal input is not served",
    "embed_dtype": "'embed_dtype' other than float32 is not served yet",
    "softmax": "'softmax' is vLLM's older name: send 'activation'",
}
