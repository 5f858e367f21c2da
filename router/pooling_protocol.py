"""The pooling endpoints' request schema, as vLLM's: /v1/embeddings (OpenAI's, with vLLM's extras), /pooling,
/classify, /score and /rerank (Jina's and Cohere's shape), with vLLM 0.32's names (use_activation; score's
queries / documents) and 0.11's (normalize, activation; text_1 / text_2). Validated by router.protocol.validate,
like every body."""
from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from router.protocol import Strict, TokenIds

# a text, texts, token ids, or lists of token ids (OpenAI's embeddings input)
Input = Union[str, list[str], TokenIds, list[TokenIds]]


class _PoolingBase(Strict):
    model: str | None = None
    truncate_prompt_tokens: int | None = None  # keep N tokens of each input (-1: max_model_len)
    truncation_side: Literal["left", "right"] = "left"  # left: the last N tokens are kept
    use_activation: bool | None = None  # vLLM 0.32's: normalize (embed) or activation (classify); None: the default
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
    """vLLM's pairs: queries with documents (or items), data_1 with data_2, or text_1 with text_2."""
    queries: Union[str, list[str], None] = None
    documents: Union[str, list[str], None] = None
    items: Union[str, list[str], None] = None
    data_1: Union[str, list[str], None] = None
    data_2: Union[str, list[str], None] = None
    text_1: Union[str, list[str], None] = None
    text_2: Union[str, list[str], None] = None
    activation: bool | None = None

    def sides(self) -> tuple[Union[str, list[str]], Union[str, list[str]]] | None:
        for first, second in ((self.queries, self.documents), (self.queries, self.items),
                              (self.data_1, self.data_2), (self.text_1, self.text_2)):
            if first is not None and second is not None:
                return first, second
        return None


class RerankRequest(_PoolingBase):
    query: str
    documents: list[str]
    top_n: int = Field(default=0)  # 0: every document
    activation: bool | None = None


# fields of vLLM's pooling requests not served here: a 400 naming the field when given
REFUSED_POOLING = {
    "messages": "chat-style pooling requests ('messages') are not served yet: send 'input'",
    "padding": "padding to max_length is not served (models trained with a fixed length are not served)",
    "max_tokens_per_query": "per-query truncation is not served: send truncate_prompt_tokens",
    "max_tokens_per_doc": "per-document truncation is not served: send truncate_prompt_tokens",
    "instruction": "score templates (instructions) are not served yet",
    "chat_template_kwargs": "score templates are not served yet",
    "mm_processor_kwargs": "multimodal input is not served",
    "embed_dtype": "'embed_dtype' other than float32 is not served yet",
    "softmax": "'softmax' is vLLM's older name: send 'activation'",
}
