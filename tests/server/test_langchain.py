"""LangChain's ``ChatOpenAI`` as its users drive ``chatkv serve``, on the packaged default model:
``invoke``, ``bind_tools`` (the model's template has no tools: chatkv.server.generic_tools' format),
``with_structured_output`` by json_schema and function_calling returning a parsed object within 160
tokens (json_mode: a closed JSON object), and 6 concurrent ``ainvoke``s each equal to its own solo reply (the
deterministic engine: a reply does not depend on what else runs)."""

from __future__ import annotations

import asyncio
import json

import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.support.serving import MODEL, default_engine, server  # noqa: F401  (server: the fixture, on this module's engine)


class City(BaseModel):
    """A city and a few facts about it."""

    name: str = Field(description="the city's name")
    country: str = Field(description="the country it is in")
    population: int = Field(description="how many people live there")


@pytest.fixture(scope="module")
def engine(default_model_dir, tmp_path_factory):
    yield from default_engine(default_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def chat(server):  # noqa: F811
    return ChatOpenAI(
        base_url=server.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=160, max_retries=0
    )


def test_invoke_and_stream(chat):
    reply = chat.invoke("What is the capital of France?")
    assert isinstance(reply.content, str) and reply.content.strip()
    assert reply.usage_metadata["output_tokens"] <= 160
    streamed = "".join(c.content for c in chat.stream("What is the capital of France?"))
    assert streamed == reply.content  # greedy: the same reply streamed or not


def test_bind_tools_on_a_template_without_tools(chat):
    """The tool is forced (``tool_choice``): LangChain gets a parsed call with schema-valid args."""

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"sunny in {city}"

    bound = chat.bind_tools([get_weather], tool_choice="get_weather")
    msg = bound.invoke("What is the weather in Paris?")
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["args"]["city"]
    # the agent loop: the tool's result fed back as a ToolMessage, then a text answer
    from langchain_core.messages import HumanMessage, ToolMessage

    answer = chat.bind_tools([get_weather]).invoke(
        [
            HumanMessage("What is the weather in Paris?"),
            msg,
            ToolMessage(get_weather(call["args"]["city"]), tool_call_id=call["id"]),
        ]
    )
    assert isinstance(answer.content, str)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_closes_within_160_tokens(chat, method):
    """The schema reaches the server (as response_format or a forced tool), whose grammar bounds
    every number and string run (chatkv.engine.schema_bounds): the model closes its object."""
    structured = chat.with_structured_output(City, method=method, include_raw=True)
    out = structured.invoke("Tell me about Paris as JSON with keys name, country and population.")
    assert out["parsing_error"] is None, out["raw"]
    city = out["parsed"]
    assert isinstance(city, City) and city.name
    assert out["raw"].usage_metadata["output_tokens"] <= 160


def test_json_mode_closes_a_json_object(chat):
    """json_mode sends no schema (``response_format: json_object``): the server constrains the reply
    to a JSON object, which closes within 160 tokens; which keys it holds is the model's to choose
    (the 135M model leaves out some asked for in the prompt, so City itself may not parse)."""
    out = chat.with_structured_output(City, method="json_mode", include_raw=True).invoke(
        "Tell me about Paris as JSON with keys name, country and population."
    )
    assert isinstance(json.loads(out["raw"].content), dict)
    assert out["raw"].usage_metadata["output_tokens"] <= 160


def test_concurrent_ainvokes_equal_their_solo_replies(chat):
    prompts = [
        "Name a fruit.",
        "What is 2 + 2?",
        "Write one sentence about the sea.",
        "Who painted the Mona Lisa?",
        "Give a synonym for quick.",
        "What colour is grass?",
    ]
    solo = [chat.invoke(p).content for p in prompts]

    async def together():
        return await asyncio.gather(*(chat.ainvoke(p) for p in prompts))

    assert [m.content for m in asyncio.run(together())] == solo
