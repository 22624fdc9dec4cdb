"""Tool use in the Anthropic Messages API: the tools and tool_choice checked field by field and mapped to a table
of expected choices, the reply's calls as tool_use blocks (whole and streamed with input_json_delta, the same
content either way), the history's tool_use / tool_result blocks through the chat template, a forced call on the
embedded model that parses against its schema, and one call at most where the request says so (Anthropic's
disable_parallel_tool_use, OpenAI's parallel_tool_calls false). Live: the official `anthropic` client."""
from __future__ import annotations

import json
import os
import sys

import anthropic
import openai
import pytest

from ftexpert.coordinator.anthropic_output import MessageBlocks
from ftexpert.coordinator.text_codec import TextCodec
from ftexpert.coordinator.tool_calls import CallStream, ToolChoice, ToolError, parse_anthropic_tools, split_calls
from ftexpert.proto.engine_spec import DEFAULT_MODEL_DIR

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import MODEL_NAME, live_server  # noqa: E402
from test_tool_calls import CALL, REPLY  # noqa: E402 - the scripted reply: text, then one get_weather call

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "required": ["city"],
                            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}}}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
TOOLS, _ = parse_anthropic_tools({"tools": [WEATHER, CLOCK]})
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
TWO_CALLS = "Two things.\n" + CALL + "\n" + CALL2 + "\nAnd some words after the calls. " * 8
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# ------------------------------------------------------------------------------------------ definitions

CHOICES = [   # tool_choice -> (mode, name, parallel)
    (None, ("auto", None, True)),
    ({"type": "auto"}, ("auto", None, True)),
    ({"type": "any"}, ("required", None, True)),
    ({"type": "tool", "name": "get_time"}, ("function", "get_time", True)),
    ({"type": "none"}, ("none", None, True)),
    ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", None, False)),
    ({"type": "any", "disable_parallel_tool_use": False}, ("required", None, True)),
]


@pytest.mark.parametrize("raw, expected", CHOICES, ids=[json.dumps(c) for c, _ in CHOICES])
def test_tool_choice_table(raw, expected):
    tools, choice = parse_anthropic_tools({"tools": [WEATHER, CLOCK], "tool_choice": raw})
    assert [t.name for t in tools] == ["get_weather", "get_time"]
    assert (choice.mode, choice.name, choice.parallel) == expected
    assert tools[0].parameters == WEATHER["input_schema"] and tools[0].description == "The weather in a city"


def test_no_tools_is_no_choice():
    assert parse_anthropic_tools({}) == ([], ToolChoice("none"))
    assert parse_anthropic_tools({"tools": [], "tool_choice": {"type": "none"}}) == ([], ToolChoice("none"))


BAD = {
    "not-a-list": ({"tools": {"name": "f"}}, "tools"),
    "server-tool": ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    "no-schema": ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    "schema-not-object": ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema.type"),
    "bad-name": ({"tools": [{"name": "get weather", "input_schema": {}}]}, "tools[0].name"),
    "duplicate": ({"tools": [CLOCK, CLOCK]}, "tools"),
    "choice-a-string": ({"tools": [CLOCK], "tool_choice": "auto"}, "tool_choice"),
    "choice-unknown-type": ({"tools": [CLOCK], "tool_choice": {"type": "required"}}, "tool_choice"),
    "choice-unknown-tool": ({"tools": [CLOCK], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    "any-without-tools": ({"tool_choice": {"type": "any"}}, "tool_choice"),
    "parallel-not-bool": ({"tools": [CLOCK], "tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
                          "tool_choice.disable_parallel_tool_use"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_tools_name_the_field(case):
    body, param = BAD[case]
    with pytest.raises(ToolError) as info:
        parse_anthropic_tools(body)
    assert info.value.param == param, str(info.value)


# ------------------------------------------------------------------------------------------ the reply's blocks

def test_one_call_at_most_keeps_the_first_and_drops_what_follows():
    content, calls = split_calls(TWO_CALLS, TOOLS, single=True)
    assert content == "Two things." and [c.name for c in calls] == ["get_weather"]
    assert [c.name for c in split_calls(TWO_CALLS, TOOLS)[1]] == ["get_weather", "get_time"]
    stream = CallStream(TOOLS, single=True)
    for ch in TWO_CALLS:
        stream.feed(ch)
        if stream.calls:
            break
    assert stream.complete and stream.feed(CALL2) == ("", []) and stream.finish() == ("", [])


def _blocks_of(text: str, piece: int, choice: ToolChoice = ToolChoice("auto")):
    blocks = MessageBlocks(TOOLS, choice)
    events = blocks.start()
    for i in range(0, len(text), piece):
        events += blocks.feed(text[i:i + piece])
    return blocks, events + blocks.finish()


def _rebuild(events) -> list[dict]:
    """The content a client builds from the events (as the anthropic client's stream does)."""
    content: list[dict] = []
    open_blocks: set[int] = set()
    for name, data in events:
        index = data.get("index")
        if name == "content_block_start":
            assert index == len(content) and not open_blocks
            content.append(dict(data["content_block"]))
            content[-1].setdefault("partial", "")
            open_blocks.add(index)
        elif name == "content_block_delta":
            assert index in open_blocks
            delta = data["delta"]
            if delta["type"] == "text_delta":
                content[index]["text"] += delta["text"]
            else:
                assert delta["type"] == "input_json_delta"
                content[index]["partial"] += delta["partial_json"]
        elif name == "content_block_stop":
            open_blocks.remove(index)
    assert not open_blocks
    for block in content:
        partial = block.pop("partial")
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial)
    return content


@pytest.mark.parametrize("piece", [1, 3, 7, 10_000])
@pytest.mark.parametrize("text, expected", [
    (REPLY, [("text", "Let me look that up."), ("tool_use", "get_weather")]),
    (CALL, [("tool_use", "get_weather")]),
    (TWO_CALLS, [("text", "Two things."), ("tool_use", "get_weather"), ("tool_use", "get_time"),
                 ("text", TWO_CALLS.split("</tool_call>")[-1].strip())]),
    ("no call here", [("text", "no call here")]),
    ("", [("text", "")]),
])
def test_streamed_blocks_build_the_content_of_the_whole_reply(text, expected, piece):
    blocks, events = _blocks_of(text, piece)
    rebuilt = _rebuild(events)
    got = [(b["type"], b["text"] if b["type"] == "text" else b["name"]) for b in blocks.final_content()]
    assert got == expected
    assert len(rebuilt) == len(blocks.content)
    for streamed, whole in zip(rebuilt, blocks.content):
        assert streamed == whole
    assert blocks.made_calls == any(kind == "tool_use" for kind, _ in expected)
    for block in blocks.final_content():
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_") and isinstance(block["input"], dict)


def test_without_tools_the_text_block_opens_first():
    blocks = MessageBlocks([], ToolChoice("none"))
    events = blocks.start() + blocks.feed(REPLY) + blocks.finish()
    assert [n for n, _ in events] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert blocks.final_content() == [{"type": "text", "text": REPLY}] and not blocks.made_calls


# ------------------------------------------------------------------------------------------ live

def _scripted(tmp_path_factory, name: str, text: str, **engine_kwargs):
    """A live server whose engine writes `text`, then EOS, under the embedded model's template (it renders tools)."""
    template = TextCodec.from_model_dir(DEFAULT_MODEL_DIR).chat_template.source
    return live_server(tmp_path_factory.mktemp(name), chat_template=template, context_length=4096,
                       engine_kwargs={"text": text, "eos_after": len(text.encode()), **engine_kwargs})


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    with _scripted(tmp_path_factory, "anthropic-tools", REPLY) as ls:
        yield ls


@pytest.fixture(scope="module")
def two_calls(tmp_path_factory):
    """An engine that writes two calls and then words, a token every 2 ms: one call at most ends it early."""
    with _scripted(tmp_path_factory, "two-calls", TWO_CALLS, step_delay_s=0.002) as ls:
        yield ls


def _create(c: anthropic.Anthropic, stream: bool, **kwargs):
    """The message, plain or as the client's stream builds it."""
    if not stream:
        return c.messages.create(**kwargs)
    with c.messages.stream(**kwargs) as s:
        return s.get_final_message()


def _client(ls) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ls.base_url, api_key="unused", max_retries=0, timeout=30)


def _rendered(ls) -> str:
    rendered = list(ls.engine_box[-1].requests.values())[-1].prompt_ids
    return bytes(t for t in rendered if t < 256).decode()


def test_a_call_comes_back_as_a_tool_use_block_and_the_stream_says_the_same(scripted):
    c = _client(scripted)
    msg = c.messages.create(model=MODEL_NAME, max_tokens=200, tools=[WEATHER, CLOCK], messages=ASK)
    assert msg.stop_reason == "tool_use"
    text, use = msg.content
    assert text.type == "text" and text.text == "Let me look that up."
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert use.input == {"city": "Paris", "unit": "C"}
    assert _rendered(scripted).count('"name": "get_weather"') == 1             # the tools rendered once
    with c.messages.stream(model=MODEL_NAME, max_tokens=200, tools=[WEATHER, CLOCK], messages=ASK) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None)) for b in final.content] == [("text", None), ("tool_use", "get_weather")]
    assert final.content[0].text.strip() == "Let me look that up." and final.content[1].input == use.input


def test_a_tool_result_round_trips_through_the_template(scripted):
    c = _client(scripted)
    first = c.messages.create(model=MODEL_NAME, max_tokens=200, tools=[WEATHER], messages=ASK)
    use = next(b for b in first.content if b.type == "tool_use")
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"},
                         {"type": "tool_result", "tool_use_id": use.id, "is_error": True,
                          "content": [{"type": "text", "text": "the second station is down"}]},
                         {"type": "text", "text": "And tomorrow?"}]}]
    before = c.messages.count_tokens(model=MODEL_NAME, tools=[WEATHER], messages=history).input_tokens
    msg = c.messages.create(model=MODEL_NAME, max_tokens=5, tools=[WEATHER], messages=history)
    text = _rendered(scripted)
    assert msg.usage.input_tokens == before
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in text
    assert "<tool_response>\nError: the second station is down\n</tool_response>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert text.index("</tool_response>") < text.index("And tomorrow?")
    without = c.messages.count_tokens(model=MODEL_NAME, messages=ASK).input_tokens
    assert c.messages.count_tokens(model=MODEL_NAME, tools=[WEATHER], messages=ASK).input_tokens > without


def test_tool_choice_none_gives_the_text(scripted):
    msg = _client(scripted).messages.create(model=MODEL_NAME, max_tokens=200, tools=[WEATHER],
                                            tool_choice={"type": "none"}, messages=ASK)
    assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["text"] and msg.content[0].text == REPLY
    assert '"name": "get_weather"' not in _rendered(scripted)                  # none: the tools are not rendered


@pytest.mark.parametrize("stream", [False, True])
def test_disable_parallel_tool_use_ends_the_reply_at_its_first_call(two_calls, stream):
    kwargs = dict(model=MODEL_NAME, max_tokens=2000, tools=[WEATHER, CLOCK], messages=ASK,
                  tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    c = _client(two_calls)
    msg = _create(c, stream, **kwargs)
    assert msg.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None)) for b in msg.content] == [("text", None), ("tool_use", "get_weather")]
    assert msg.usage.output_tokens < len(TWO_CALLS.encode())                   # the engine stopped early
    engine = two_calls.engine_box[-1]
    rid = list(engine.requests)[-1]
    two_calls.wait_for(lambda: rid in engine.aborted and not engine.running, what="the engine's slot released")
    full = c.messages.create(**{**kwargs, "tool_choice": {"type": "auto"}})
    assert [getattr(b, "name", None) for b in full.content if b.type == "tool_use"] == ["get_weather", "get_time"]
    assert full.usage.output_tokens == len(TWO_CALLS.encode()) + 1              # every byte and the EOS


@pytest.mark.parametrize("stream", [False, True])
def test_openai_parallel_tool_calls_false_ends_the_reply_at_its_first_call(two_calls, stream):
    client = openai.OpenAI(base_url=two_calls.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
             for t in (WEATHER, CLOCK)]
    kwargs = dict(model=MODEL_NAME, max_tokens=2000, tools=tools, parallel_tool_calls=False,
                  messages=ASK, stream_options={"include_usage": True} if stream else None, stream=stream)
    if stream:
        names, reasons, usage = [], [], None
        for chunk in client.chat.completions.create(**{k: v for k, v in kwargs.items() if v is not None}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                names += [tc.function.name for tc in choice.delta.tool_calls or []]
                reasons += [choice.finish_reason] if choice.finish_reason else []
        tokens = usage.completion_tokens
    else:
        out = client.chat.completions.create(**{k: v for k, v in kwargs.items() if v is not None})
        names = [tc.function.name for tc in out.choices[0].message.tool_calls]
        reasons, tokens = [out.choices[0].finish_reason], out.usage.completion_tokens
    assert names == ["get_weather"] and reasons == ["tool_calls"]
    assert tokens < len(TWO_CALLS.encode())


# bounded input: a free string or extra properties could run the reply past max_tokens
BOUNDED_WEATHER = {"name": "get_weather", "input_schema": {
    "type": "object", "required": ["city", "unit"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}}
BOUNDED_CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {},
                                                      "additionalProperties": False}}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The embedded model: it never learnt to call, so only the grammar makes it."""
    with live_server(tmp_path_factory.mktemp("forced-anthropic"), real_engine=True, model=str(DEFAULT_MODEL_DIR)) as ls:
        yield ls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_a_forced_call_parses_against_its_schema(real, choice, stream):
    jsonschema = pytest.importorskip("jsonschema")
    tools = [BOUNDED_CLOCK, BOUNDED_WEATHER] if choice["type"] == "any" else [BOUNDED_WEATHER]
    kwargs = dict(model=MODEL_NAME, max_tokens=70 if choice["type"] == "any" else 95, tools=tools,
                  tool_choice=choice, messages=ASK, extra_body={"temperature": 0})
    msg = _create(_client(real), stream, **kwargs)
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    if choice["type"] == "tool":
        assert use.name == "get_weather"
    jsonschema.validate(use.input, {t["name"]: t["input_schema"] for t in tools}[use.name])


def test_a_forced_call_whose_schema_does_not_compile_is_a_400_naming_the_tools(scripted):
    pytest.importorskip("llguidance")
    broken = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "nonsense"}}}}
    with pytest.raises(anthropic.BadRequestError) as info:
        _client(scripted).messages.create(model=MODEL_NAME, max_tokens=20, tools=[broken], messages=ASK,
                                          tool_choice={"type": "any"})
    message = info.value.body["error"]["message"]
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "'input_schema'" in message and "does not compile" in message
