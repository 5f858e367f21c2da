"""The router's own request, as both doors build it (router.request_builder): its prompts or conversation,
the sampling parameters every service checks (stagemesh.core.sampling_params), and what shapes the answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.reasoning import ReasoningPlan
from router.resume import ResumePoint
from router.tools import ToolPlan
from stagemesh.core.engine_request import EngineRequest
from stagemesh.core.sampling_params import SamplingParams


@dataclass
class Prompt:
    text: str | None = None
    token_ids: list[int] | None = None


@dataclass
class ChatOptions:
    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    documents: list[dict] | None = None


@dataclass
class GenerateRequest:
    model: str
    chat: bool
    prompts: list[Prompt] = field(default_factory=list)  # completions; a chat renders its one prompt
    chat_options: ChatOptions | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    structured_param: str = "structured_outputs"  # the field the output constraint came in (for its 400s)
    tool_plan: ToolPlan | None = None  # chat with tools (router.tools)
    reasoning: ReasoningPlan | None = None  # chat under --reasoning-parser: how its thinking is split off
    max_tokens_given: bool = False
    max_tokens_param: str = "max_tokens"  # the field max_tokens came in (max_completion_tokens, ...)
    # the model's generation config (router.generation_config): the max_tokens of a request that sets none (None:
    # the room its context leaves), and vLLM's cap on every request's (None: none)
    max_tokens_default: int | None = None
    max_tokens_cap: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    bad_words: list[str] = field(default_factory=list)
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs), nothing generated
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    add_special_tokens: bool = True
    request_id: str | None = None
    # what every choice's engine request carries (router.choices.plan gives each its id, prompt and sampling):
    # its priority (router.admission checks the replicas schedule by it), its LoRA adapter, ...
    engine: EngineRequest = field(default_factory=lambda: EngineRequest("", ()))
    resumable: bool = False  # its replicas keep it for a resume if the router goes away (router.resume)
    resume: ResumePoint | None = None  # a resume: what the client has of each choice

    @property
    def logprobs(self) -> bool:
        """Whether the answer carries the generated tokens' logprobs (sampling.logprobs: how many top ones)."""
        return self.sampling.logprobs is not None

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n if not self.chat else self.n
