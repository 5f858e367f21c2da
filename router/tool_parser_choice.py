"""Which tool-call parser reads tool_choice "auto", and whether it is on: the router's flags where given, else
what the model's chat template shows.

vLLM turns "auto" on only with --enable-auto-tool-choice and --tool-call-parser; without them an agent's
first turn (LangChain's bind_tools, the Agents SDK: both send "auto" by default) gets a 400. Here a chat
template whose tool-call format one of the router's parsers reads (router.tools.TOOL_CALL_PARSERS) turns
"auto" on by itself, with that parser, and says so in the log. A flag always wins:
--tool-call-parser picks the parser, --no-enable-auto-tool-choice keeps "auto" off (vLLM's 400), and
--enable-auto-tool-choice with no parser given or found is an error that names --tool-call-parser.

gpt-oss's template (harmony messages, calls ended by <|call|>) chooses vLLM's `openai` parser, which reads the
calls from the harmony channels: it brings --reasoning-parser openai_gptoss with it when no reasoning parser is
given (router.cli), as vLLM serves gpt-oss; another reasoning parser beside it is refused (RouterConfig).
"""
from __future__ import annotations

from dataclasses import dataclass

from stagemesh.core.errors import StagemeshError

# (parser, a text only that family's templates hold, what it says of the template); the first match wins
_SIGNS = (
    ("openai", "<|call|>", "writes gpt-oss's harmony messages, a tool call ending in <|call|>"),
    ("hermes", "<tool_call>", "writes tool calls as <tool_call>{...}</tool_call> blocks (Hermes, Qwen 2.5/3, "
                              "SmolLM3 and other Hermes-style templates)"),
    ("llama3_json", "please respond with a JSON for a function call",
     "asks for tool calls as a JSON object (Llama 3.1/3.2/3.3's JSON tool format)"),
    ("llama3_json", "<|python_tag|>", "writes tool calls after <|python_tag|> (Llama 3.1/3.2/3.3)"),
    # SmolLM2's own template (the embedded model's) does not render tools, but SmolLM2 was trained to call
    # them in <tool_call>[{"name": ..., "arguments": {...}}]</tool_call> blocks, which the hermes parser reads
    ("hermes", "named SmolLM, trained by Hugging Face",
     "is SmolLM2's, whose tool calls are <tool_call>[...]</tool_call> blocks"),
)
# formats seen in templates that no parser here reads: named in the log, "auto" stays off
_UNREAD = (("[TOOL_CALLS]", "Mistral's [TOOL_CALLS]"), ("<|python_start|>", "Llama 4's pythonic calls"),
           ("<｜tool▁calls▁begin｜>", "DeepSeek's tool-call tokens"), ("<|tool_call|>", "<|tool_call|> tokens"))
FLAGS = "--enable-auto-tool-choice --tool-call-parser {hermes,llama3_json,openai}"


@dataclass(frozen=True)
class AutoToolChoice:
    parser: str | None  # the parser "auto" runs with; None: "auto" gets vLLM's 400
    message: str  # the start-up log line that says why


def template_text(chat_template) -> str:
    """A tokenizer's chat_template as one text: a named set ({"default": ..., "tool_use": ...}) joined."""
    if isinstance(chat_template, dict):
        return "\n".join(str(t) for t in chat_template.values())
    return chat_template or ""


def parser_from_template(chat_template) -> tuple[str | None, str]:
    """(the parser that reads the template's tool-call format or None, why)."""
    text = template_text(chat_template)
    if not text:
        return None, "the model has no chat template"
    for parser, sign, why in _SIGNS:
        if sign in text:
            return parser, f"the model's chat template {why}"
    for sign, what in _UNREAD:
        if sign in text:
            return None, f"the model's chat template writes {what}, which no tool-call parser here reads"
    return None, "the model's chat template shows no tool-call format a parser here reads"


def choose(enable: bool | None, tool_call_parser: str | None, chat_template) -> AutoToolChoice:
    """`enable`: --enable-auto-tool-choice (True), --no-enable-auto-tool-choice (False) or neither (None);
    `tool_call_parser`: --tool-call-parser or None. Raises StagemeshError when "auto" is asked for and no
    parser is given or found."""
    if enable is False:
        return AutoToolChoice(None, 'tool_choice "auto": off (--no-enable-auto-tool-choice); it gets a 400')
    if tool_call_parser is not None:
        return AutoToolChoice(tool_call_parser, f'tool_choice "auto": on, tool-call parser {tool_call_parser} '
                                                f"(--tool-call-parser)")
    parser, why = parser_from_template(chat_template)
    if parser is None:
        if enable:
            raise StagemeshError(f"--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or "
                                 f"openai): "
                                 f"{why}")
        return AutoToolChoice(None, f'tool_choice "auto": off: {why}; it gets a 400 until the router runs with '
                                    f"{FLAGS}")
    return AutoToolChoice(parser, f'tool_choice "auto": on, tool-call parser {parser}, chosen because {why} '
                                  f"(--tool-call-parser picks another, --no-enable-auto-tool-choice turns it off)")
