"""Agent loops, as their libraries run them, against the gateway over a real replica of the default model
(SmolLM2-135M-Instruct) with vLLM's tool options (--enable-auto-tool-choice --tool-call-parser hermes): a
tool call, the tool's answer, then the model's answer. Chat completions with the openai client and with a
LangChain tool-calling agent; the Responses API with the openai client, the OpenAI Agents SDK and
LangChain's Responses mode. The tiny model cannot be asked to want a tool, so the first turn forces the
call (tool_choice "required", as agents do to make a tool run first); the answer turn is "auto"."""
from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from mesh import Mesh, Router

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's tool shape


@pytest.fixture(scope="module")
def router(default_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("agents")
    with Mesh(default_model_dir, [30], log_dir=logs) as mesh:
        with Router(default_model_dir, [mesh.address], ("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
                    log_dir=logs) as r:
            yield r


def weather(city: str) -> str:
    return f"Sunny and 21 degrees in {city}."


def test_openai_chat_agent_loop(router):
    client = router.client()
    messages = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=40, temperature=0)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    # the second request: the assistant's turn as the client gives it back (content null), then the tool's answer
    messages += [message.model_dump(exclude_none=False),
                 {"role": "tool", "tool_call_id": call.id, "content": weather(**json.loads(call.function.arguments))}]
    assert messages[1]["content"] is None
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=24,
                                            temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the tool's answer is in the prompt


def test_langchain_tool_calling_agent_loop(router):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return weather(city)

    llm = ChatOpenAI(model=MODEL, base_url=f"{router.base_url}/v1", api_key="none", temperature=0, max_tokens=40,
                     max_retries=0)
    messages = [HumanMessage(QUESTION)]
    for turn in range(3):  # the agent loop: call the model, run the tools it asks for, until it answers
        bound = llm.bind_tools([get_weather], tool_choice="required" if turn == 0 else None)
        ai = bound.invoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            break
        messages += [get_weather.invoke(call) for call in ai.tool_calls]
    assert [type(m).__name__ for m in messages] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert isinstance(messages[2], ToolMessage) and messages[2].content.startswith("Sunny")
    assert messages[-1].content and not messages[-1].tool_calls


def test_responses_function_call_then_its_output(router):
    client = router.client()
    first = client.responses.create(model=MODEL, input=QUESTION, tools=[FLAT_WEATHER], tool_choice="required",
                                    max_output_tokens=40, temperature=0)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and call.name == "get_weather" and call.call_id
    output = {"type": "function_call_output", "call_id": call.call_id,
              "output": weather(**json.loads(call.arguments))}
    # stateful: the stored response goes on
    answer = client.responses.create(model=MODEL, previous_response_id=first.id, input=[output],
                                     tools=[FLAT_WEATHER], max_output_tokens=24, temperature=0)
    assert answer.output_text and answer.output[0].type == "message"
    # stateless, as the Agents SDK sends it: the whole history as items
    again = client.responses.create(model=MODEL, input=[{"role": "user", "content": QUESTION},
                                                        *[item.model_dump() for item in first.output], output],
                                    tools=[FLAT_WEATHER], max_output_tokens=24, temperature=0, store=False)
    assert again.output_text == answer.output_text  # the same conversation, rendered the same way


def test_responses_continue_an_unfinished_assistant_message(router):
    client = router.client()
    asked = [{"role": "user", "content": "Name a colour."}]
    started = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "My favourite"}]}
    done = client.responses.create(model=MODEL, input=[*asked, {**started, "status": "completed"}],
                                   max_output_tokens=1, temperature=0)
    going = client.responses.create(model=MODEL, input=[*asked, {**started, "status": "incomplete"}],
                                    max_output_tokens=1, temperature=0)
    # continued (vLLM's rule for a last assistant message in_progress or incomplete): no end of its turn, no new
    # assistant turn opened after it (SmolLM2's template: <|im_end|>, a newline, <|im_start|>assistant, newline)
    assert going.usage.input_tokens < done.usage.input_tokens


def test_responses_stream_of_a_function_call(router):
    client = router.client()
    with client.responses.stream(model=MODEL, input=QUESTION, tools=[FLAT_WEATHER], tool_choice="required",
                                 max_output_tokens=40, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert "response.output_text.delta" not in kinds
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"]


def test_responses_structured_output_and_logprobs(router):
    class City(BaseModel):
        name: str
        country: str

    client = router.client()
    parsed = client.responses.parse(model=MODEL, input="Name a city in France as JSON.", text_format=City,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City)
    out = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=5, temperature=0, top_logprobs=2,
                                  include=["message.output_text.logprobs"])
    logprobs = out.output[0].content[0].logprobs
    assert len(logprobs) == out.usage.output_tokens and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == out.output_text


def test_openai_agents_sdk_runs_a_tool_then_answers(router):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        calls.append(city)
        return weather(city)

    model = OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=f"{router.base_url}/v1",
                                                                        api_key="none", max_retries=0))
    agent = Agent(name="assistant", instructions="Answer with the tools you have.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=40))
    result = Runner.run_sync(agent, QUESTION, max_turns=4)
    assert len(calls) == 1 and isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"


def test_langchain_responses_mode(router):
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city now."""
        return weather(city)

    llm = ChatOpenAI(model=MODEL, base_url=f"{router.base_url}/v1", api_key="none", temperature=0, max_tokens=40,
                     max_retries=0, use_responses_api=True)
    assert llm.invoke("Say hello.").text
    messages = [HumanMessage(QUESTION)]
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke(messages)
    [call] = ai.tool_calls
    messages += [ai, get_weather.invoke(call)]
    answer = llm.bind_tools([get_weather]).invoke(messages)
    assert answer.text and not answer.tool_calls
