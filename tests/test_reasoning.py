"""--reasoning-parser (router.reasoning): a reasoning model's <think> text goes to reasoning / reasoning_content,
streamed as such deltas and as the Responses API's reasoning item, never into the answer.

The splitter against recorded outputs of each format, whole and cut at every point; then the real router app
(HTTP with the official openai client, the Responses API, the gRPC frontend) over a replica that replays a
recorded answer's tokens, with a tokenizer built here whose <think> and </think> are tokens of their own and
chat templates that do and do not think."""
from __future__ import annotations

import grpc
import openai
import pytest

from fake_replicas import FakeReplica, FakeRouter
from router.config import RouterOptions
from router.reasoning import ReasoningSplit, plan, template_thinks
from router.submit_stream import ReplicaOutput
from stagemesh.core.flags import add_flags
from stagemesh.v1 import frontend_pb2, frontend_pb2_grpc

M = "thinker"
# recorded outputs: DeepSeek-R1's (its template opened <think>), Qwen3's (it opens the block itself), one cut
# short by max_tokens while thinking, and a model that does not think
R1 = "Okay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**."
QWEN3 = "<think>\nThe user greets me. I should greet back.\n</think>\n\nHello! How can I help you today?"
CUT = "<think>\nLet me think about this carefully, step by"
PLAIN = "Paris is the capital of France."
SPLITS = [  # (text, implicit thinking, reasoning, content)
    (R1, True, "Okay, the user asks for 2 + 2. That is 4.\n", "\n\nThe answer is **4**."),
    (QWEN3, True, "\nThe user greets me. I should greet back.\n", "\n\nHello! How can I help you today?"),
    (QWEN3, False, "\nThe user greets me. I should greet back.\n", "\n\nHello! How can I help you today?"),
    (CUT, False, "\nLet me think about this carefully, step by", None),
    (PLAIN, False, None, PLAIN),  # (a template with no thinking part: the answer as it is)
    (PLAIN, True, PLAIN, None),  # (a template that opened <think>: never closed, all of it is reasoning)
    ("  <think></think>Hi", False, "", "Hi"),
]


def split_whole(text: str, implicit: bool) -> tuple:
    s = ReasoningSplit(implicit)
    s.feed(text, final=True)
    return s.result()


@pytest.mark.parametrize("text, implicit, reasoning, content", SPLITS)
def test_recorded_outputs_split_whole(text, implicit, reasoning, content):
    assert split_whole(text, implicit) == (reasoning, content)


@pytest.mark.parametrize("text, implicit, reasoning, content", SPLITS)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_streamed_in_any_pieces_they_add_up_to_the_whole_split(text, implicit, reasoning, content, size):
    s, pieces = ReasoningSplit(implicit), [text[i:i + size] for i in range(0, len(text), size)]
    deltas = [s.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert (reasoning or "", content or "") == ("".join(r for r, _ in deltas), "".join(c for _, c in deltas))
    assert all("</think>" not in r + c and "<think>" not in r + c for r, c in deltas)  # (no tag leaks, even cut)
    assert s.result() == (reasoning, content)


def test_qwen3_honours_enable_thinking_false_and_templates_are_read_for_a_thinking_part():
    qwen3_template = "{%- if enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    assert template_thinks(qwen3_template) and not template_thinks("{{ messages[0]['content'] }}")
    off = plan("qwen3", True, {"enable_thinking": False}, True)
    assert off is not None and not off.implicit
    assert split_whole("Hello there.", off.implicit) == (None, "Hello there.")
    r1 = plan("deepseek_r1", True, {"enable_thinking": False}, True)  # (a qwen3 switch: not R1's)
    assert r1 is not None and r1.implicit and plan(None, True, {}, True) is None


def test_an_unknown_parser_name_is_refused_by_name(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_flags(parser, RouterOptions)
    with pytest.raises(SystemExit):
        parser.parse_args(["--replica", "x:1", "--reasoning-parser", "granite"])
    assert "--reasoning-parser: invalid choice: 'granite'" in capsys.readouterr().err


# --- through the router -----------------------------------------------------------------------------------------

WORDS = ["<unk>", "<s>", "</s>", "<think>", "</think>", "hi", "Okay", "the", "user", "asks", "two", "plus", "is",
         "four", "The", "answer", "Let", "me", "think", "<tool_call>", "</tool_call>"]
THINKING = "{% for m in messages %}{{ m['content'] }} {% endfor %}<think>"  # R1-like: opens the block
QWEN3_LIKE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
              "{% if enable_thinking is defined and enable_thinking is false %}<think> </think>{% endif %}")
NOT_THINKING = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
ANSWER = "Okay the user asks two plus two </think> The answer is four"  # (R1's: the template opened <think>)
# as the router decodes it (the word tokenizer puts a space before each word): the thinking and the answer
RAW = " " + ANSWER
THOUGHT, _, REPLY = RAW.partition("</think>")


def tokenizer_dir(base, target, template: str):
    """The tiny model with a word tokenizer whose think tags are tokens of their own, and `template`."""
    import shutil

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(base, target, dirs_exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in WORDS[3:5] + WORDS[-2:]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = template
    fast.save_pretrained(target)
    return target


class Recorded(FakeReplica):
    """A replica that answers every request with one recorded answer's tokens, one output per token."""
    answer: list[int] = []

    async def _outputs(self, prompt, sampling, num_generated):
        tokens = self.answer[:sampling.max_tokens]
        for i, token in enumerate(tokens):
            last = i + 1 == len(tokens)
            reason = ("length" if len(tokens) == sampling.max_tokens else "stop") if last else None
            yield ReplicaOutput([token], finish_reason=reason, num_prompt_tokens=len(prompt) if i == 0 else 0)


@pytest.fixture(scope="module")
def routers(tiny_model_dir, tmp_path_factory):
    """Routers with --reasoning-parser over models whose templates think (R1-like, Qwen3-like) and do not."""
    from transformers import AutoTokenizer

    base, opened = tiny_model_dir("llama"), {}
    for name, template, parser in (("r1", THINKING, "deepseek_r1"), ("qwen3", QWEN3_LIKE, "qwen3"),
                                   ("plain", NOT_THINKING, "deepseek_r1"), ("off", THINKING, None)):
        model = tokenizer_dir(base, tmp_path_factory.mktemp(name) / "m", template)
        r = FakeRouter(model, M, grpc_frontend=True, replica_class=Recorded, reasoning_parser=parser,
                       template_thinks=template_thinks(template))
        r.replica.answer = AutoTokenizer.from_pretrained(model).encode(ANSWER, add_special_tokens=False)
        opened[name] = r.__enter__()
    yield opened
    for r in opened.values():
        r.__exit__()


ASK = [{"role": "user", "content": "hi"}]


def reasoning_of(message) -> tuple:
    extra = message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"]  # (vLLM's field and its older name)
    return extra["reasoning_content"], message.content


def test_chat_gives_the_thinking_as_reasoning_content_whole_and_streamed(routers):
    client = routers["r1"].client()
    out = client.chat.completions.create(model=M, messages=ASK)
    assert reasoning_of(out.choices[0].message) == (THOUGHT, REPLY)
    assert out.usage.completion_tokens_details.reasoning_tokens == 8  # (seven words and </think>)
    chunks = list(client.chat.completions.create(model=M, messages=ASK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == REPLY
    assert all("think>" not in (d.content or "") for d in deltas)


def test_include_reasoning_false_drops_it_and_the_answer_stays(routers):
    client = routers["r1"].client()
    out = client.chat.completions.create(model=M, messages=ASK, extra_body={"include_reasoning": False})
    assert reasoning_of(out.choices[0].message) == (None, REPLY)
    chunks = client.chat.completions.create(model=M, messages=ASK, stream=True,
                                            extra_body={"include_reasoning": False})
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.model_extra.get("reasoning_content") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == REPLY


def test_a_template_without_thinking_leaves_the_answer_unchanged_and_no_parser_mixes_it_in(routers):
    out = routers["plain"].client().chat.completions.create(model=M, messages=ASK)
    assert reasoning_of(out.choices[0].message) == (None, RAW)
    out = routers["off"].client().chat.completions.create(model=M, messages=ASK)
    assert out.choices[0].message.content == RAW and "reasoning_content" not in out.choices[0].message.model_extra


def test_qwen3s_enable_thinking_false_makes_it_all_answer(routers):
    client = routers["qwen3"].client()
    out = client.chat.completions.create(model=M, messages=ASK)
    assert reasoning_of(out.choices[0].message) == (THOUGHT, REPLY)
    out = client.chat.completions.create(model=M, messages=ASK,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_of(out.choices[0].message) == (None, RAW)


def test_a_constraint_is_refused_while_the_model_thinks(routers):
    with pytest.raises(openai.BadRequestError) as err:
        routers["r1"].client().chat.completions.create(model=M, messages=ASK,
                                                       response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format" and "--reasoning-parser" in err.value.body["message"]


def test_the_responses_api_gives_a_reasoning_item_whole_and_streamed(routers):
    client = routers["r1"].client()
    out = client.responses.create(model=M, input="hi")
    kinds = [item.type for item in out.output]
    assert kinds == ["reasoning", "message"]
    assert out.output[0].content[0].text == THOUGHT
    assert out.output_text == REPLY and out.usage.output_tokens_details.reasoning_tokens == 8
    events = list(client.responses.create(model=M, input="hi", stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, text) == (THOUGHT, REPLY)
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert added == [(0, "reasoning"), (1, "message")]
    done = events[-1].response
    assert [i.type for i in done.output] == ["reasoning", "message"] and done.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_grpc_frontend_splits_it_into_reasoning(routers):
    with grpc.insecure_channel(f"127.0.0.1:{routers['r1'].grpc_port}") as channel:
        stub = frontend_pb2_grpc.FrontendStub(channel)
        replies = list(stub.Chat(frontend_pb2.ChatRequest(model=M, messages=[
            frontend_pb2.ChatMessage(role="user", content="hi")]), timeout=30))
    assert "".join(r.reasoning for r in replies) == THOUGHT
    assert "".join(r.text for r in replies) == REPLY


def test_an_earlier_answers_reasoning_reaches_the_template():
    """An agent gives an assistant turn back with its reasoning: the chat template gets it, as vLLM gives it."""
    from router.protocol import ChatMessage
    from router.request_builder import chat_options

    turn = ChatMessage(role="assistant", content="four", reasoning_content="two plus two")
    options = chat_options([ChatMessage(role="user", content="hi"), turn], True, False, None, None, None)
    assert options.messages[1] == {"role": "assistant", "content": "four", "reasoning_content": "two plus two"}


# --- gpt-oss's harmony channels (router.harmony) -----------------------------------------------------------------

HARMONY = ("<|channel|>analysis<|message|>User asks for the capital. It is Paris.<|end|><|start|>assistant"
           "<|channel|>commentary<|message|>Let me say it.<|end|><|start|>assistant<|channel|>final<|message|>"
           "The capital of France is Paris.")
HARMONY_SPLITS = [  # (recorded text, reasoning, content)
    (HARMONY, "User asks for the capital. It is Paris.", "Let me say it.\nThe capital of France is Paris."),
    ("<|channel|>analysis<|message|>Cut short while thi", "Cut short while thi", None),
    ("Plain text <b>with tags</b>", None, "Plain text <b>with tags</b>"),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>commentary "
     "<|constrain|>json<|message|>{\"a\": 1}<|call|>", "x", None),
]


@pytest.mark.parametrize("text, reasoning, content", HARMONY_SPLITS)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_harmony_recorded_outputs_split_whole_and_in_any_pieces(text, reasoning, content, size):
    from router.harmony import HarmonySplit

    s, pieces = HarmonySplit(), [text[i:i + size] for i in range(0, len(text), size)]
    deltas = [s.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert s.result() == (reasoning, content)
    assert ("".join(r for r, _ in deltas), "".join(c for _, c in deltas)) == (reasoning or "", content or "")
    assert all("<|" not in r + c for r, c in deltas)


HARMONY_WORDS = ["<unk>", "<s>", "</s>", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "analysis", "final",
                 "assistant", "Okay", "the", "user", "asks", "The", "answer", "is", "four", "hi", "low", "high"]
HARMONY_ANSWER = ("<|channel|> analysis <|message|> Okay the user asks <|end|> <|start|> assistant <|channel|> final "
                  "<|message|> The answer is four")


@pytest.fixture(scope="module")
def harmony_router(tiny_model_dir, tmp_path_factory):
    """A router with --reasoning-parser openai_gptoss over a tokenizer whose harmony tokens are special, and a
    template that writes the reasoning effort it is given."""
    import shutil

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    target = tmp_path_factory.mktemp("harmony") / "m"
    shutil.copytree(tiny_model_dir("llama"), target)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(HARMONY_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_WORDS[3:7]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                          "{% if reasoning_effort is defined %}{{ reasoning_effort }} {% endif %}<|start|> assistant")
    fast.save_pretrained(target)
    r = FakeRouter(target, M, replica_class=Recorded, reasoning_parser="openai_gptoss")
    r.replica.answer = AutoTokenizer.from_pretrained(target).encode(HARMONY_ANSWER, add_special_tokens=False)
    with r:
        yield r


def test_harmony_analysis_is_the_reasoning_and_final_the_answer(harmony_router):
    client = harmony_router.client()
    reasoning, content = reasoning_of(client.chat.completions.create(model=M, messages=ASK).choices[0].message)
    assert (reasoning.strip(), content.strip()) == ("Okay the user asks", "The answer is four")
    assert "<|" not in reasoning + content
    deltas = [c.choices[0].delta for c in client.chat.completions.create(model=M, messages=ASK, stream=True)
              if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content


def test_reasoning_effort_reaches_the_template_and_forced_tool_calls_are_refused_under_harmony(harmony_router):
    """(gpt-oss's calls under tool_choice "auto": tests/test_harmony_tools.py)"""
    client = harmony_router.client()
    client.chat.completions.create(model=M, messages=ASK, reasoning_effort="high")
    assert HARMONY_WORDS.index("high") in harmony_router.replica.submitted[-1][1]
    client.responses.create(model=M, input="hi", reasoning={"effort": "low"})
    assert HARMONY_WORDS.index("low") in harmony_router.replica.submitted[-1][1]
    tools = [{"type": "function", "function": {"name": "f"}}]
    out = client.chat.completions.create(model=M, messages=ASK, tools=tools, tool_choice="none")
    assert out.choices[0].message.content.strip() == "The answer is four" and not out.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=M, messages=ASK, tools=tools, tool_choice="required")
    assert err.value.body["param"] == "tool_choice" and "openai_gptoss" in err.value.body["message"]
