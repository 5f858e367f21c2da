"""gpt-oss's tool calls in the harmony format (--tool-call-parser openai, vLLM's name; router.harmony reads them,
router.tools gives them): a message to `functions.NAME` is a tool call, the analysis its reasoning.

The splitter against recorded harmony texts, whole and cut at every position; then the real router app over a
replica that replays recorded answers' tokens, through the official openai client (chat completions and the
Responses API), streamed and not, with a tokenizer whose harmony tokens are special and a chat template that
renders tools, past calls and tool results by gpt-oss's template's rules; the parser chosen from such a template."""
from __future__ import annotations

import json

import openai
import pytest

from fake_replicas import FakeRouter
from router.harmony import HarmonySplit
from stagemesh.core.errors import StagemeshError
from test_reasoning import Recorded

M = "gpt-oss-tiny"
ANALYSIS = "<|channel|>analysis<|message|>Need the weather in Paris.<|end|>"
ARGS = '{"city": "Paris"}'
CALL = (f"{ANALYSIS}<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
        "<|call|>")
CASES = [  # (recorded text, reasoning, content, [(name, arguments as vLLM gives them whole)])
    (CALL, "Need the weather in Paris.", None, [("get_weather", ARGS)]),
    # the recipient before the channel (as gpt-oss's template writes a past call), no <|constrain|>, JSON to
    # tidy up, and the end-of-sequence token's text not given (the output ended there)
    (ANALYSIS + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
     '{ "city" :"Paris"\n}', "Need the weather in Paris.", None, [("get_weather", ARGS)]),
    # two calls in one output; one to a built-in tool this server does not run, kept out of everything
    (CALL[:-len("<|call|>")] + '<|call|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>'
     'json<|message|>{}<|call|>', "Need the weather in Paris.", None, [("get_weather", ARGS), ("get_time", "{}")]),
    (ANALYSIS + '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"query": "x"}<|call|>',
     "Need the weather in Paris.", None, []),
    # an answer, no call; arguments that are not JSON stay as written
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>", "Need the weather in Paris.",
     "It is sunny.", []),
    ("<|channel|>commentary to=functions.run <|constrain|>text<|message|>ls -l<|call|>", None, None,
     [("run", "ls -l")]),
]


def feed_pieces(pieces: list[str], cut: bool = False) -> tuple[HarmonySplit, list, list]:
    s, deltas, calls = HarmonySplit(), [], []
    for i, piece in enumerate(pieces):
        deltas.append(s.feed(piece, final=i == len(pieces) - 1, cut=cut))
        calls += s.take_call_deltas()
    return s, deltas, calls


def assemble(call_deltas: list[dict]) -> list[dict]:
    """Tool-call deltas added up as OpenAI's clients do: by index, the first delta opens the call (id, type, name
    and arguments ""), the later ones bring arguments only."""
    calls: list[dict] = []
    for d in call_deltas:
        if d["index"] == len(calls):
            assert set(d) == {"index", "id", "type", "function"} and d["type"] == "function"
            assert d["function"]["arguments"] == "" and d["function"]["name"]
            calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": ""})
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            assert d["index"] == len(calls) - 1  # (arguments only for the call open now)
            calls[-1]["arguments"] += d["function"]["arguments"]
    return calls


def cuts(text: str):
    """The text whole, in pieces of one character, and cut in two at every position."""
    yield [text]
    yield list(text)
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]


@pytest.mark.parametrize("text, reasoning, content, want", CASES)
def test_recorded_harmony_calls_whole_and_cut_at_every_position(text, reasoning, content, want):
    for pieces in cuts(text):
        s, deltas, call_deltas = feed_pieces(pieces)
        assert s.result() == (reasoning, content)
        assert ("".join(r for r, _ in deltas), "".join(c for _, c in deltas)) == (reasoning or "", content or "")
        assert all("<|" not in r + c for r, c in deltas)
        assert [(c.name, c.json_arguments()) for c in s.made_calls()] == want
        streamed = assemble(call_deltas)
        assert [(c["name"], c["id"]) for c in streamed] == [(c.name, c.id) for c in s.made_calls()]
        for c, (_, arguments) in zip(streamed, want):  # (streamed as written; whole, tidied as vLLM does)
            assert c["arguments"] == arguments or json.loads(c["arguments"]) == json.loads(arguments)


def test_a_call_cut_short_by_max_tokens_is_none_and_one_without_its_end_token_counts():
    cut_short = CALL[:CALL.index('"Paris"')]
    s, _, call_deltas = feed_pieces([cut_short], cut=True)
    assert s.made_calls() == [] and assemble(call_deltas)[0]["name"] == "get_weather"
    s, _, _ = feed_pieces([CALL[:-len("<|call|>")]])
    assert [(c.name, c.json_arguments()) for c in s.made_calls()] == [("get_weather", ARGS)]


# --- through the router -------------------------------------------------------------------------------------------

SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>", "<|return|>"]
WHOLE = ["to=functions.get_weather", ARGS]  # (one token each, so that they decode as written)
# gpt-oss's template's rules, in short: tools in the developer message as a `functions` namespace; a past call as
# `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>` after its analysis
# (`thinking`); a tool's result as `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...`; the
# reasoning effort in the system message; "<|call|>" is what the parser is chosen by
TEMPLATE = """<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>
{%- if tools %}<|start|>developer<|message|>namespace functions {
{%- for t in tools %} type {{ t.function.name }} {% endfor %}}<|end|>{% endif %}
{%- set last = namespace(name=none) %}
{%- for m in messages %}
{%- if m.role == 'assistant' and 'tool_calls' in m %}{% set call = m.tool_calls[0].function %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>{{ call.arguments|tojson }}<|call|>
{%- set last.name = call.name %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>
{{- m.content|tojson }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}
{%- endfor %}<|start|>assistant"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = ("<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>"
          "It is sunny in Paris.<|return|>")


def harmony_tokenizer(base, target, texts: list[str]):
    """The tiny model with a word tokenizer over `texts`' words, harmony's tokens special, and TEMPLATE."""
    import shutil

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(base, target)
    split = pre_tokenizers.Whitespace()
    words = ["<unk>", "<s>", "</s>"] + sorted({w for t in texts for w, _ in split.pre_tokenize_str(t)})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = split
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in WHOLE])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(target)
    return target


@pytest.fixture(scope="module")
def gpt_oss_router(tiny_model_dir, tmp_path_factory):
    """A router as `serve` starts it on a gpt-oss template: --tool-call-parser openai, --reasoning-parser
    openai_gptoss."""
    from transformers import AutoTokenizer

    texts = [TEMPLATE, CALL, ANSWER, json.dumps(WEATHER), json.dumps(ASK), "Sunny high functions to assistant } ? ."]
    model = harmony_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("gpt-oss") / "m", texts)
    r = FakeRouter(model, M, replica_class=Recorded, tool_call_parser="openai", reasoning_parser="openai_gptoss")
    r.tokenizer = AutoTokenizer.from_pretrained(model)
    with r:
        yield r


def answer_with(router, text: str) -> None:
    router.replica.answer = router.tokenizer.encode(text, add_special_tokens=False)


def prompt_of(router) -> str:
    """The last prompt the replica was given, its whitespace dropped (the word tokenizer spaces every token)."""
    return "".join(router.tokenizer.decode(router.replica.submitted[-1][1]).split())


def test_a_call_is_a_tool_call_whole_and_streamed(gpt_oss_router):
    client = gpt_oss_router.client()
    answer_with(gpt_oss_router, CALL)
    out = client.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], reasoning_effort="high")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"].strip() == "Need the weather in Paris ."
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", ARGS)
    assert call.id.startswith("chatcmpl-tool-")
    prompt = prompt_of(gpt_oss_router)  # the tools and the effort reached the template
    assert "Reasoning:high" in prompt and "namespacefunctions{typeget_weather}" in prompt

    chunks = [c for c in client.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], stream=True)
              if c.choices]
    deltas = [c.choices[0].delta for c in chunks]
    call_deltas = [t.model_dump(exclude_none=True) for d in deltas for t in d.tool_calls or []]
    assert call_deltas[0]["function"] == {"name": "get_weather", "arguments": ""}  # (the name first)
    [streamed] = assemble(call_deltas)
    assert streamed["name"] == "get_weather" and json.loads(streamed["arguments"]) == json.loads(ARGS)
    assert not any(d.content for d in deltas)
    thought = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert thought.strip() == "Need the weather in Paris ."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_the_result_goes_back_through_the_template_and_the_answer_is_content(gpt_oss_router):
    client = gpt_oss_router.client()
    answer_with(gpt_oss_router, ANSWER)
    turn = {"role": "assistant", "content": None, "reasoning_content": "Need the weather in Paris.",
            "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function",
                            "function": {"name": "get_weather", "arguments": ARGS}}]}
    messages = ASK + [turn, {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "Sunny"}]
    out = client.chat.completions.create(model=M, messages=messages, tools=[WEATHER])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content.strip() == "It is sunny in Paris ."
    prompt = prompt_of(gpt_oss_router)
    assert ('<|start|>assistant<|channel|>analysis<|message|>NeedtheweatherinParis.<|end|>'
            '<|start|>assistantto=functions.get_weather<|channel|>commentaryjson<|message|>{"city":"Paris"}<|call|>'
            '<|start|>functions.get_weatherto=assistant<|channel|>commentary<|message|>"Sunny"<|end|>') in prompt
    streamed = client.chat.completions.create(model=M, messages=messages, tools=[WEATHER], stream=True)
    deltas = [c.choices[0] for c in streamed if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
    assert deltas[-1].finish_reason == "stop" and not any(d.delta.tool_calls for d in deltas)


def test_tool_choice_none_gives_no_call_and_forcing_one_is_refused_by_name(gpt_oss_router):
    client = gpt_oss_router.client()
    answer_with(gpt_oss_router, CALL)
    out = client.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].finish_reason == "stop" and not out.choices[0].message.tool_calls
    assert out.choices[0].message.content is None
    for forced in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], tool_choice=forced)
        assert err.value.body["param"] == "tool_choice" and "harmony" in err.value.body["message"]


def test_parallel_tool_calls_false_keeps_the_first_call_of_an_output_that_makes_two(gpt_oss_router):
    client = gpt_oss_router.client()
    answer_with(gpt_oss_router, CALL + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>"
                f"json<|message|>{ARGS}<|call|>")
    out = client.chat.completions.create(model=M, messages=ASK, tools=[WEATHER])
    assert [c.function.arguments for c in out.choices[0].message.tool_calls] == [ARGS, ARGS]
    out = client.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], parallel_tool_calls=False)
    assert [c.function.arguments for c in out.choices[0].message.tool_calls] == [ARGS]
    chunks = client.chat.completions.create(model=M, messages=ASK, tools=[WEATHER], parallel_tool_calls=False,
                                            stream=True)
    streamed = assemble([t.model_dump(exclude_none=True) for c in chunks if c.choices
                         for t in c.choices[0].delta.tool_calls or []])
    assert [json.loads(c["arguments"]) for c in streamed] == [json.loads(ARGS)]


def test_the_responses_api_gives_a_call_as_a_function_call_item_and_takes_its_output_back(gpt_oss_router):
    client, tools = gpt_oss_router.client(), [{"type": "function", **WEATHER["function"]}]
    answer_with(gpt_oss_router, CALL)
    out = client.responses.create(model=M, input=ASK[0]["content"], tools=tools)
    assert [item.type for item in out.output] == ["reasoning", "function_call"] and out.status == "completed"
    call = out.output[1]
    assert (call.name, call.arguments) == ("get_weather", ARGS) and call.call_id.startswith("chatcmpl-tool-")
    assert out.output[0].content[0].text.strip() == "Need the weather in Paris ."
    events = list(client.responses.create(model=M, input=ASK[0]["content"], tools=tools, stream=True))
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == ("get_weather", ARGS)
    assert not [e for e in events if e.type == "response.output_text.delta"]
    assert [item.type for item in events[-1].response.output] == ["reasoning", "function_call"]

    answer_with(gpt_oss_router, ANSWER)
    given = [ASK[0], {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": ARGS},
             {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}]
    out = client.responses.create(model=M, input=given, tools=tools)
    assert out.output_text.strip() == "It is sunny in Paris ." and out.output[-1].type == "message"
    assert ('to=functions.get_weather<|channel|>commentaryjson<|message|>{"city":"Paris"}<|call|>'
            '<|start|>functions.get_weatherto=assistant<|channel|>commentary<|message|>"Sunny"<|end|>'
            '<|start|>assistant') in prompt_of(gpt_oss_router)


def test_a_gpt_oss_template_chooses_the_openai_parser_and_it_needs_the_harmony_reasoning_parser():
    from router.config import RouterConfig
    from router.tool_parser_choice import choose

    assert choose(None, None, TEMPLATE).parser == "openai"
    assert choose(False, None, TEMPLATE).parser is None
    with pytest.raises(StagemeshError, match="--tool-call-parser openai .* --reasoning-parser openai_gptoss"):
        RouterConfig(M, tool_call_parser="openai", reasoning_parser="deepseek_r1")
    with pytest.raises(StagemeshError, match="not none"):
        RouterConfig(M, tool_call_parser="openai")


def test_the_router_started_on_a_gpt_oss_template_reads_calls_and_channels_by_itself():
    """What `serve` and `stagemesh router` do with no tool or reasoning flag on gpt-oss's template: the openai
    parser, and the harmony reasoning parser it needs; flags still win."""
    from argparse import Namespace
    from types import SimpleNamespace

    from router.cli import _auto_tool_choice, _reasoning
    from router.config import RouterConfig

    tokenizer = SimpleNamespace(tok=SimpleNamespace(chat_template=TEMPLATE))

    def started(**flags):
        args = Namespace(**{"enable_auto_tool_choice": None, "tool_call_parser": None, "reasoning_parser": None,
                            **flags})
        config = _reasoning(args, _auto_tool_choice(args, RouterConfig(M), tokenizer), tokenizer)
        return config.tool_call_parser, config.reasoning_parser

    assert started() == ("openai", "openai_gptoss")
    assert started(enable_auto_tool_choice=False) == (None, None)
    assert started(enable_auto_tool_choice=False, reasoning_parser="openai_gptoss") == (None, "openai_gptoss")
    with pytest.raises(StagemeshError, match="--reasoning-parser openai_gptoss"):
        started(reasoning_parser="qwen3")
