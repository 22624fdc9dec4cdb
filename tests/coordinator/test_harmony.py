"""gpt-oss's harmony format (coordinator/harmony.py): a reply's channels parsed into reasoning, text and calls
(a table of replies, fed whole and in pieces of every size), the grammar that forces one call (compiled against a
harmony tokenizer, walked at random through its mask: every walk is a call the parser reads and the schema
accepts), and live on a tiny harmony model: chat content and `reasoning_content`, tool calls in both APIs, the
history rendered by the template, plain and streamed alike."""
from __future__ import annotations

import json
import os
import random
import sys

import anthropic
import openai
import pytest

from ftexpert.coordinator.harmony import HarmonyStream, Reasoning, call_grammar
from ftexpert.coordinator.text_codec import ChatMessage, TextCodec
from ftexpert.coordinator.tool_calls import ToolCall, parse_openai_tools

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import MODEL_NAME, live_server, write_tiny_model_dir  # noqa: E402
from harmony_support import HARMONY_SERVER, HARMONY_SPECIALS, HARMONY_STOPS, HARMONY_TEMPLATE  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS, _ = parse_openai_tools({"tools": [WEATHER, CLOCK]})

THINK = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
ANSWER = THINK + "<|channel|>final<|message|>It is sunny in Paris."
CALL = THINK + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
ROLE_CALL = THINK + ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'

REPLIES = {   # reply text (after the prompt's "<|start|>assistant", stop token not shown) -> its items, merged
    "answer": (ANSWER, [("reasoning", "The user wants the weather."), ("text", "It is sunny in Paris.")]),
    "answer-ended": (ANSWER + "<|end|>", [("reasoning", "The user wants the weather."),
                                          ("text", "It is sunny in Paris.")]),
    "call": (CALL, [("reasoning", "The user wants the weather."), ("call", ("get_weather", {"city": "Paris"}))]),
    "call-recipient-in-role": (ROLE_CALL, [("reasoning", "The user wants the weather."),
                                           ("call", ("get_weather", {"city": "Paris"}))]),
    "preamble-then-call": ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
                           "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}",
                           [("text", "Checking."), ("call", ("get_time", {}))]),
    "unknown-function": ("<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{}",
                         [("text", "{}")]),
    "builtin-tool": ("<|channel|>analysis<|message|>search<|end|><|start|>assistant to=browser.search"
                     "<|channel|>commentary<|message|>{\"query\": \"x\"}",
                     [("reasoning", "search"), ("text", "{\"query\": \"x\"}")]),
    "bad-json": ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": ",
                 [("text", "{\"city\": ")]),
    "cut-in-analysis": ("<|channel|>analysis<|message|>Still thinking", [("reasoning", "Still thinking")]),
    "no-channel": ("<|message|>Plain.", [("text", "Plain.")]),
    "text-with-brackets": ("<|channel|>final<|message|>a <| b |> c <|", [("text", "a <| b |> c <|")]),
}


def _merged(items: list) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for item in items:
        if isinstance(item, ToolCall):
            out.append(("call", (item.name, json.loads(item.arguments))))
            continue
        kind, text = ("reasoning", item.text) if isinstance(item, Reasoning) else ("text", item)
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out


def _parse(text: str, piece: int, tools=TOOLS, single: bool = False) -> tuple[HarmonyStream, list]:
    stream = HarmonyStream(tools, single)
    items: list = []
    for i in range(0, len(text), piece):
        items += stream.feed_items(text[i:i + piece])
    return stream, items + stream.finish_items()


@pytest.mark.parametrize("piece", [1, 2, 5, 10_000])
@pytest.mark.parametrize("case", list(REPLIES), ids=list(REPLIES))
def test_reply_table(case, piece):
    text, expected = REPLIES[case]
    stream, items = _parse(text, piece)
    assert _merged(items) == expected
    assert [c.name for c in stream.calls] == [v[0] for k, v in expected if k == "call"]


def test_one_call_at_most_and_no_tools_offered():
    two = CALL + "<|call|><|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}"
    stream, items = _parse(two, 3, single=True)
    assert stream.complete and [c.name for c in stream.calls] == ["get_weather"]
    assert _parse(two, 3)[0].calls[1].name == "get_time"
    _, items = _parse(CALL, 4, tools=[])
    assert _merged(items) == [("reasoning", "The user wants the weather."), ("text", '{"city":"Paris"}')]


# ------------------------------------------------------------------------------------------ the forced call

@pytest.fixture(scope="module")
def harmony_codec(tmp_path_factory) -> TextCodec:
    path = write_tiny_model_dir(str(tmp_path_factory.mktemp("harmony") / "model"), HARMONY_TEMPLATE,
                                HARMONY_SPECIALS, HARMONY_STOPS)
    return TextCodec.from_model_dir(path)


BOUNDED = parse_openai_tools({"tools": [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "unit"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]})[0]


def test_the_forced_call_grammar_walks_only_to_calls_the_parser_reads(harmony_codec):
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    from ftexpert.gpu_worker.engine.grammar import GrammarCompiler
    from ftexpert.proto.grammar_spec import GrammarSpec, check_grammar

    spec = GrammarSpec("grammar", call_grammar(BOUNDED))
    check_grammar(spec)
    vocab = harmony_codec.vocab_size
    compiler = GrammarCompiler.from_tokenizer(harmony_codec.tokenizer, vocab, harmony_codec.eos_token_ids)
    names = set()
    for text in _walks(harmony_codec, spec, 12, seed=7):
        assert text.endswith("<|call|>"), text
        stream, items = _parse(text[:-len("<|call|>")], 10_000, tools=BOUNDED)
        (call,) = stream.calls
        names.add(call.name)
        schema = next(t.parameters for t in BOUNDED if t.name == call.name)
        jsonschema.validate(json.loads(call.arguments), schema)
    assert names == {"get_weather", "get_time"}
    state = compiler.matcher(spec)
    refused = harmony_codec.encode("<|channel|>final", add_special_tokens=False)
    state.accept(refused[0])
    assert refused[1] not in state.allowed(vocab)                      # only commentary to=functions. may follow


def _walks(codec: TextCodec, spec, walks: int, seed: int, steps: int = 200, to_the_end: bool = True) -> list[str]:
    """Random walks through `spec`'s token mask (to its end, or `steps` tokens): each walk's text (special tokens
    kept)."""
    from ftexpert.gpu_worker.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler.from_tokenizer(codec.tokenizer, codec.vocab_size, codec.eos_token_ids)
    rng, out = random.Random(seed), []
    for _ in range(walks):
        state, ids = compiler.matcher(spec), []
        while not state.done and len(ids) < steps:
            token = rng.choice(sorted(state.allowed(codec.vocab_size)))
            ids.append(token)
            state.accept(token)
        assert state.done or not to_the_end, codec.decode_special(ids)
        out.append(codec.decode_special(ids))
    return out


ANSWER_SCHEMA = {"type": "object", "required": ["city", "ok"], "additionalProperties": False,
                 "properties": {"city": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}}}


def test_a_response_format_is_the_final_channels_message(harmony_codec, tmp_path):
    """On a harmony model, response_format's JSON comes as the final channel's message: the parser's content."""
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    from ftexpert.coordinator.openai_requests import ModelInfo, parse_chat

    model = ModelInfo("tiny", 4096, harmony_codec)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}}
    plan = parse_chat(body, model)
    (params,) = plan.sampling
    assert plan.harmony and params.grammar.kind == "grammar" and "<|channel|>" in params.grammar.text
    for text in _walks(harmony_codec, params.grammar, 8, seed=3):
        _, items = _parse(text, 10_000)
        assert all(isinstance(i, str) for i in items)
        jsonschema.validate(json.loads("".join(items)), ANSWER_SCHEMA)
    plain = parse_chat({**body, "response_format": {"type": "json_object"}}, model).sampling[0].grammar
    for text in _walks(harmony_codec, plain, 4, seed=4, steps=12, to_the_end=False):   # (any object: unbounded)
        assert text.startswith("<|channel|>final<|message|>{"), text
        assert "".join(_parse(text, 10_000)[1]).startswith("{")


def test_the_template_renders_calls_as_objects_and_results(harmony_codec):
    history = [ChatMessage("user", "Weather in Paris?"),
               ChatMessage("assistant", "", [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
               ChatMessage("tool", "18 C", None, "call_1")]
    text = harmony_codec.decode_special(harmony_codec.encode_chat(history, tools=[t.openai() for t in TOOLS]))
    assert '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' \
        in text                                                        # the arguments an object, not JSON text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18 C"<|end|>' in text
    assert "namespace functions" in text and text.endswith("<|start|>assistant")


# ------------------------------------------------------------------------------------------ live

def _server(tmp_path_factory, name: str, reply: str):
    """A live server on the tiny harmony model whose engine writes `reply` (special tokens as tokens), then its
    stop token."""
    path = write_tiny_model_dir(str(tmp_path_factory.mktemp(name + "-ids") / "m"), HARMONY_TEMPLATE,
                                HARMONY_SPECIALS, HARMONY_STOPS)
    ids = TextCodec.from_model_dir(path).encode(reply, add_special_tokens=False)
    return live_server(tmp_path_factory.mktemp(name), context_length=4096, **HARMONY_SERVER,
                       engine_kwargs={"token_ids": ids, "eos_after": len(ids)})


@pytest.fixture(scope="module")
def answering(tmp_path_factory):
    with _server(tmp_path_factory, "answer", ANSWER + "<|return|>") as ls:
        yield ls


@pytest.fixture(scope="module")
def calling(tmp_path_factory):
    with _server(tmp_path_factory, "call", CALL + "<|call|>") as ls:
        yield ls


def _openai(ls) -> openai.OpenAI:
    return openai.OpenAI(base_url=ls.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _anthropic(ls) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ls.base_url, api_key="unused", max_retries=0, timeout=30)


ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_chat_gives_the_final_channel_as_content_and_the_analysis_as_reasoning(answering):
    out = _openai(answering).chat.completions.create(model=MODEL_NAME, max_tokens=300, messages=ASK)
    message = out.choices[0].message
    assert message.content == "It is sunny in Paris." and out.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning_content"] == "The user wants the weather."
    content, reasoning = "", ""
    for chunk in _openai(answering).chat.completions.create(model=MODEL_NAME, max_tokens=300, messages=ASK,
                                                            stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
    assert (content, reasoning) == ("It is sunny in Paris.", "The user wants the weather.")
    msg = _anthropic(answering).messages.create(model=MODEL_NAME, max_tokens=300, messages=ASK)
    assert [(b.type, b.text) for b in msg.content] == [("text", "It is sunny in Paris.")]
    assert msg.stop_reason == "end_turn"
    completion = _openai(answering).completions.create(model=MODEL_NAME, max_tokens=300, prompt="x")
    assert "<|channel|>" not in completion.choices[0].text                 # completions: special tokens not shown


@pytest.mark.parametrize("stream", [False, True])
def test_a_harmony_call_comes_back_in_both_apis(calling, stream):
    if stream:
        calls, reasons = {}, []
        for chunk in _openai(calling).chat.completions.create(model=MODEL_NAME, max_tokens=300, messages=ASK,
                                                              tools=[WEATHER, CLOCK], stream=True):
            for tc in chunk.choices[0].delta.tool_calls or []:
                calls[tc.index] = (tc.function.name, json.loads(tc.function.arguments))
            reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
        assert list(calls.values()) == [("get_weather", {"city": "Paris"})] and reasons == ["tool_calls"]
        with _anthropic(calling).messages.stream(model=MODEL_NAME, max_tokens=300, messages=ASK,
                                                 tools=[{"name": "get_weather", "input_schema": WEATHER["function"]
                                                         ["parameters"]}]) as s:
            msg = s.get_final_message()
    else:
        out = _openai(calling).chat.completions.create(model=MODEL_NAME, max_tokens=300, messages=ASK,
                                                       tools=[WEATHER, CLOCK])
        (call,) = out.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
        msg = _anthropic(calling).messages.create(model=MODEL_NAME, max_tokens=300, messages=ASK,
                                                  tools=[{"name": "get_weather",
                                                          "input_schema": WEATHER["function"]["parameters"]}])
    assert msg.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in msg.content] == [("tool_use", "get_weather", {"city": "Paris"})]
