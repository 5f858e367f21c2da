"""The router's settings, from its command line (router/cli.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    served_model_name: str
    api_key: str | None = None  # every endpoint but /health (and /metrics when public) needs it
    max_model_len: int | None = None  # a cap below the replicas' own
    public_metrics: bool = False  # /metrics without the API key
    tool_call_parser: str | None = None  # tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser)
    responses_store_size: int = 1000  # the Responses API's stored responses (the last N)
