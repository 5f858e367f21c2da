"""tool_choice "auto" (what LangChain's bind_tools and the Agents SDK send by default) on a router started with no
tool flags, as `make serve` starts it: the tool-call parser comes from the model's chat template (the embedded
model's is SmolLM2's: hermes), a template no parser reads keeps vLLM's 400 naming the two flags, and the flags
win both ways. Real scheduler, stage and router processes on loopback."""
from __future__ import annotations

import json
import shutil

import pytest
import requests

from mesh import Mesh, Router, run_stagemesh

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# SmolLM2's own tool-call format: a list of calls in one <tool_call> block
SMOLLM2_CALL = r'<tool_call>\[\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,9}"\}\}\]</tool_call>'
FLAGS = "--enable-auto-tool-choice and --tool-call-parser"


@pytest.fixture(scope="module")
def mesh(default_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("auto-tool-choice")
    with Mesh(default_model_dir, [30], log_dir=logs) as m:
        m.logs = logs
        yield m


def _router_log(logs, router: Router) -> str:
    return (logs / f"router-{router.port}.log").read_text()


def test_plain_router_answers_auto_tool_choice_from_langchain_and_openai(mesh, default_model_dir):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return f"Sunny in {city}."

    with Router(default_model_dir, [mesh.address], log_dir=mesh.logs) as router:
        # LangChain's bind_tools sends the tools with no tool_choice: OpenAI's "auto"
        llm = ChatOpenAI(model=MODEL, base_url=f"{router.base_url}/v1", api_key="none", temperature=0, max_tokens=16,
                         max_retries=0)
        ai = llm.bind_tools([get_weather]).invoke("Say hello.")
        assert ai.content and not ai.tool_calls
        # the openai client, "auto" named; the model made to write SmolLM2's call format: read back as calls
        client = router.client()
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto",
                                             temperature=0, max_tokens=80,
                                             extra_body={"structured_outputs": {"regex": SMOLLM2_CALL}})
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
        # the Responses API, as the Agents SDK calls it (tool_choice left out)
        answer = client.responses.create(model=MODEL, input="Say hello.", tools=[{"type": "function",
                                         **WEATHER["function"]}], max_output_tokens=8, temperature=0)
        assert answer.output_text
        assert "tool-call parser hermes, chosen because the model's chat template is SmolLM2's" in \
            _router_log(mesh.logs, router)


def _unknown_template(default_model_dir, target):
    """The embedded model's tokenizer with a chat template that shows no tool-call format."""
    target.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, target / name)
    (target / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                                "{% endfor %}assistant:")
    return target


def test_unknown_template_keeps_the_400_naming_the_flags_and_the_off_flag_wins(mesh, default_model_dir, tmp_path):
    unknown = _unknown_template(default_model_dir, tmp_path / "unknown-template")
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "max_tokens": 8}
    with Router(unknown, [mesh.address], ("--served-model-name", MODEL), log_dir=mesh.logs) as router:
        answer = requests.post(f"{router.base_url}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert FLAGS in error["message"] and error["param"] == "tool_choice"
        assert 'tool_choice "auto": off: the model\'s chat template shows no tool-call format' in \
            _router_log(mesh.logs, router)
    # --no-enable-auto-tool-choice keeps it off on a template that has a parser
    with Router(default_model_dir, [mesh.address], ("--no-enable-auto-tool-choice",), log_dir=mesh.logs) as router:
        answer = requests.post(f"{router.base_url}/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 400 and FLAGS in answer.json()["error"]["message"]


def test_enable_auto_tool_choice_without_a_parser_to_find_names_the_flag(mesh, default_model_dir, tmp_path):

    unknown = _unknown_template(default_model_dir, tmp_path / "unknown-template")
    done = run_stagemesh(["router", str(unknown), "--port", "0",
                           "--replica", mesh.address, "--enable-auto-tool-choice"], timeout=120)
    assert done.returncode != 0
    assert "--enable-auto-tool-choice needs --tool-call-parser" in done.stdout + done.stderr


@pytest.mark.parametrize("template, parser", [
    ("{%- if tools %}<tools>{{ tools }}</tools> ... <tool_call>\n{\"name\": ...}\n</tool_call>{% endif %}", "hermes"),
    ("Given the following functions, please respond with a JSON for a function call with its proper arguments",
     "llama3_json"),
    ("{%- if builtin_tools is defined %}<|python_tag|>{% endif %}", "llama3_json"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ tools }}[/AVAILABLE_TOOLS] ... [TOOL_CALLS]", None),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_the_parser_chosen_from_known_templates(template, parser):
    from router.tool_parser_choice import parser_from_template

    assert parser_from_template(template)[0] == parser
    assert parser_from_template({"default": "x", "tool_use": template or ""})[0] == parser


def test_flags_win_over_the_template():
    from router.tool_parser_choice import choose

    smollm2 = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert choose(None, None, smollm2).parser == "hermes"
    assert choose(None, "llama3_json", smollm2).parser == "llama3_json"  # --tool-call-parser
    assert choose(None, "hermes", "{{ messages }}").parser == "hermes"
    assert choose(True, "hermes", "{{ messages }}").parser == "hermes"
    assert choose(False, None, smollm2).parser is None  # --no-enable-auto-tool-choice
    assert choose(False, "hermes", smollm2).parser is None


def test_serve_leaves_the_choice_to_the_router_unless_a_flag_is_given():
    import argparse

    from stagemesh.entry.serve import add_arguments, plan_commands

    def router_argv(*argv: str) -> list[str]:
        p = argparse.ArgumentParser()
        add_arguments(p)
        return next(c.argv for c in plan_commands(p.parse_args(list(argv)), "/m", 4, cuda=False)
                    if c.name == "router")

    assert not [a for a in router_argv() if "tool" in a]
    assert "--no-enable-auto-tool-choice" in router_argv("--no-enable-auto-tool-choice")
    plain = router_argv("--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    assert "--enable-auto-tool-choice" in plain and plain[plain.index("--tool-call-parser") + 1] == "llama3_json"
