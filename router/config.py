"""The router's settings, from its command line (router/cli.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from stagemesh.core.errors import StagemeshError
from router.lora_registry import LoRARegistry


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
    # JSON constraints' whitespace when a request does not say (--structured-outputs-config's
    # disable_any_whitespace, true by default here): False compact, True a bounded run per gap
    json_any_whitespace: bool = False
    grammar_compile_timeout: float = 5.0  # seconds a request's constraint may take to compile (router.grammar_pool)
    # --enable-lora: adapters a request picks by its model name (--lora-modules, and those loaded at run time)
    lora: LoRARegistry = field(default_factory=LoRARegistry)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return self.lora.names()

    def __post_init__(self) -> None:
        if not self.chat_template_timeout > 0:
            raise StagemeshError(f"--chat-template-timeout must be > 0, got {self.chat_template_timeout}")
        if not self.grammar_compile_timeout > 0:
            raise StagemeshError(f"--grammar-compile-timeout must be > 0, got {self.grammar_compile_timeout}")

    @property
    def template_timeout_s(self) -> float | None:
        """The time bound of requests' own chat templates; None: they are refused (router.tokenization)."""
        return self.chat_template_timeout if self.trust_request_chat_template else None


STRUCTURED_OUTPUTS_KEYS = ("backend", "disable_any_whitespace")


def json_any_whitespace(structured_outputs_config: str | None) -> bool:
    """The whitespace default of --structured-outputs-config (vLLM's flag: JSON with "backend", auto or
    xgrammar, and "disable_any_whitespace"); compact unless it says "disable_any_whitespace": false."""
    import json

    flag = "--structured-outputs-config"
    if structured_outputs_config is None:
        return False
    try:
        value = json.loads(structured_outputs_config)
    except ValueError as err:
        raise StagemeshError(f"{flag} must be JSON: {err}") from None
    if not isinstance(value, dict) or set(value) - set(STRUCTURED_OUTPUTS_KEYS):
        raise StagemeshError(f"{flag} takes an object with the keys {', '.join(STRUCTURED_OUTPUTS_KEYS)}, got "
                             f"{structured_outputs_config}")
    if value.get("backend", "xgrammar") not in ("auto", "xgrammar"):
        raise StagemeshError(f"{flag} backend {value['backend']!r} is not available: this server compiles with "
                             "xgrammar")
    disable = value.get("disable_any_whitespace", True)
    if not isinstance(disable, bool):
        raise StagemeshError(f"{flag} disable_any_whitespace must be true or false, got {disable!r}")
    return not disable
