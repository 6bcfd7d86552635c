"""Agents through the libraries people write them with (issue 51), each used as its own
documentation shows for an OpenAI-compatible ``base_url``, against a real server on 127.0.0.1
over the shipped model: instructor, LangChain, pydantic-ai, the OpenAI Agents SDK, and the
openai client's Responses API. The grammar engine forces the schemas and the calls, so the small
prose model's answers are objects of the asked type; each is validated. The schemas are bounded
(``max_length``, integer ranges), so a field cannot honestly run to the token budget."""

import asyncio
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server import Server
from tests.test_server import LiveServer

MODEL = "austen-moe"
QUESTION = "What is the weather in Bath, and who lives there?"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Weather(BaseModel):
    city: Literal["Bath", "London", "Pemberley"]
    days: int = Field(ge=1, le=7)


def get_weather(city: Literal["Bath", "London", "Pemberley"], days: int = Field(ge=1, le=7)) -> str:
    """The weather of a city over some days."""
    return f"rain in {city} for {days} days"


WEATHER_SCHEMA = {**Weather.model_json_schema(), "additionalProperties": False}
PERSON_SCHEMA = {**Person.model_json_schema(), "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city",
                "parameters": Weather.model_json_schema()}  # as pydantic gives it: open


@pytest.fixture(scope="module")
def live(shipped_runner):
    live = LiveServer(Server(shipped_runner, MODEL))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


# ---- the openai client's Responses API ----------------------------------------------------------------
def test_responses_create_answers_text_and_counts_its_tokens(client):
    r = client.responses.create(model=MODEL, input="It is a truth", max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and r.output_text
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the same as the chat endpoint's answer to the same messages
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "It is a truth"}],
                                          max_tokens=8, temperature=0)
    assert r.output_text == chat.choices[0].message.content


def test_responses_parse_gives_the_schema_object(client):
    for seed in range(3):
        r = client.responses.parse(model=MODEL, input=QUESTION, text_format=Person, max_output_tokens=60,
                                   temperature=1.0, extra_body={"seed": seed})
        assert r.status == "completed", r
        assert isinstance(r.output_parsed, Person)
        jsonschema.validate(json.loads(r.output_text), PERSON_SCHEMA)


def test_responses_function_calls_named_and_required(client):
    for choice in ({"type": "function", "name": "get_weather"}, "required"):
        r = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER_TOOL], tool_choice=choice,
                                    parallel_tool_calls=False, max_output_tokens=60, temperature=1.0)
        assert r.status == "completed", r
        [call] = r.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    # a function's result sent back, and the conversation goes on
    follow = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])
    assert follow.output[0].type == "message" and follow.output_text


def test_responses_stream_events_join_to_the_whole_response(client):
    events = list(client.responses.create(model=MODEL, input="It is a truth", max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    whole = client.responses.create(model=MODEL, input="It is a truth", max_output_tokens=8, temperature=0)
    assert text == whole.output_text == events[-1].response.output_text
    calls = list(client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER_TOOL], max_output_tokens=60,
                                         tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    arguments = "".join(e.delta for e in calls if e.type == "response.function_call_arguments.delta")
    done = next(e for e in calls if e.type == "response.function_call_arguments.done")
    assert arguments == done.arguments and calls[-1].type == "response.completed"
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)


@pytest.mark.parametrize("fields, param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"), ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools[0].type"),
    ({"tools": [WEATHER_TOOL]}, "tools"), ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens")])
def test_responses_fields_it_does_not_do_are_400s_naming_them(live, fields, param):
    r = httpx.post(live.url + "/v1/responses", json={"model": MODEL, "input": "Hello", **fields}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ---- instructor ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(live, mode):
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    for seed in range(2):
        person = client.chat.completions.create(model=MODEL, response_model=Person, max_retries=0, max_tokens=80,
                                                seed=seed, messages=[{"role": "user", "content": QUESTION}])
        assert isinstance(person, Person)


# ---- LangChain ----------------------------------------------------------------------------------------
def _chat_model(live, **more):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=live.url + "/v1", api_key="unused", max_retries=0, max_tokens=80,
                      temperature=1.0, **more)


@pytest.mark.parametrize("tool_choice", ["get_weather", "required"])
def test_langchain_bind_tools(live, tool_choice):
    message = _chat_model(live).bind_tools([get_weather], tool_choice=tool_choice,
                                           parallel_tool_calls=False).invoke(QUESTION)
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_SCHEMA | {"required": ["city"]})


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(live, method):
    person = _chat_model(live).with_structured_output(Person, method=method).invoke(QUESTION)
    assert isinstance(person, Person)


def test_langchain_on_the_responses_api(live):
    person = _chat_model(live, use_responses_api=True).with_structured_output(Person, method="json_schema"
                                                                              ).invoke(QUESTION)
    assert isinstance(person, Person)


# ---- pydantic-ai --------------------------------------------------------------------------------------
def _pydantic_ai_model(live):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=live.url + "/v1", api_key="unused"))


def test_pydantic_ai_output_type(live):
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings

    agent = Agent(_pydantic_ai_model(live), output_type=Person, model_settings=ModelSettings(max_tokens=80))
    assert isinstance(agent.run_sync(QUESTION).output, Person)


def test_pydantic_ai_calls_a_tool(live):
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    called = []
    agent = Agent(_pydantic_ai_model(live), output_type=Person,
                  model_settings=ModelSettings(max_tokens=80, temperature=1.0, seed=1))

    @agent.tool_plain
    def weather(city: Literal["Bath", "London", "Pemberley"], days: int = Field(ge=1, le=7)) -> str:
        """The weather of a city over some days."""
        called.append(Weather(city=city, days=days))
        return "rain"

    result = agent.run_sync(QUESTION, usage_limits=UsageLimits(request_limit=12))
    assert isinstance(result.output, Person)
    for message in result.all_messages():  # every tool call it made had arguments of the schema
        for part in message.parts:
            if getattr(part, "tool_name", None) == "weather" and part.part_kind == "tool-call":
                jsonschema.validate(part.args_as_dict(), WEATHER_SCHEMA | {"required": ["city"]})


# ---- the OpenAI Agents SDK (its default model: the Responses API) --------------------------------------
def _agents(live):
    import agents

    agents.set_tracing_disabled(True)
    return agents, agents.OpenAIResponsesModel(
        model=MODEL, openai_client=openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0))


def test_agents_sdk_output_type(live):
    agents, model = _agents(live)
    agent = agents.Agent(name="clerk", instructions="Answer about people.", model=model, output_type=Person,
                         model_settings=agents.ModelSettings(max_tokens=80))
    result = asyncio.run(agents.Runner.run(agent, QUESTION))
    assert isinstance(result.final_output, Person)


def test_agents_sdk_tools_beside_an_output_type(live):
    """Tools and an output type: the SDK sends text.format beside the forced tool choice; the call
    is what is generated, and the tool runs with arguments of its schema."""
    agents, model = _agents(live)
    called = []

    @agents.function_tool
    def weather(city: Literal["Bath", "London", "Pemberley"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather of a city over some days."""
        called.append((city, days))
        return f"rain in {city}"

    agent = agents.Agent(name="clerk", instructions="Answer about the weather.", model=model, output_type=Weather,
                         tools=[weather], tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(max_tokens=80, tool_choice="required",
                                                             parallel_tool_calls=False))
    result = asyncio.run(agents.Runner.run(agent, QUESTION))
    assert len(called) == 1 and called[0][0] in ("Bath", "London", "Pemberley")
    assert result.final_output == f"rain in {called[0][0]}"
