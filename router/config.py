"""The router's settings, from its command line (router/cli.py)."""
from __future__ import annotations

from dataclasses import dataclass

from stagemesh.core.errors import StagemeshError


@dataclass(frozen=True)
class RouterConfig:
    served_model_name: str
    api_key: str | None = None  # every endpoint but /health (and /metrics when public) needs it
    max_model_len: int | None = None  # a cap below the replicas' own
    public_metrics: bool = False  # /metrics without the API key
    tool_call_parser: str | None = None  # tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser)
    # the Responses API's stored responses: "memory" (this router's, the last responses_store_size, default 1000)
    # or a Redis URL that several routers share (each response kept responses_store_ttl seconds, default 3600);
    # None: not given (router.responses_api.store refuses a bound that is not its store's)
    responses_store: str = "memory"
    responses_store_size: int | None = None
    responses_store_ttl: float | None = None
    trust_request_chat_template: bool = False  # a request's own chat_template is rendered, not refused
    chat_template_timeout: float = 5.0  # seconds a request's own chat template may take to render

    def __post_init__(self) -> None:
        if not self.chat_template_timeout > 0:
            raise StagemeshError(f"--chat-template-timeout must be > 0, got {self.chat_template_timeout}")

    @property
    def template_timeout_s(self) -> float | None:
        """The time bound of requests' own chat templates; None: they are refused (router.tokenization)."""
        return self.chat_template_timeout if self.trust_request_chat_template else None
