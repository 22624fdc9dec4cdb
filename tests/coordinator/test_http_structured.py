"""Structured output and logprobs through the HTTP API, with the official `openai` client against a live server on
the embedded default model (CPU): json_schema answers that validate, json_object answers that parse, logprobs in
OpenAI's chat and completions shapes (consistent with the text, also under a stop string), streamed equal to
non-streamed, and the 400s of bad values naming the field (the schema's with the grammar engine's message)."""
from __future__ import annotations

import json
import os
import sys

import jsonschema
import openai
import pytest

from ftexpert.proto.engine_spec import DEFAULT_MODEL_DIR
from tests.gpu_worker.grammar_util import PERSON

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import MODEL_NAME, live_server  # noqa: E402

ORDER = {"type": "object", "additionalProperties": False, "required": ["id", "status", "lines", "paid"],
         "properties": {
             "id": {"type": "integer", "minimum": 1, "maximum": 99999},
             "status": {"enum": ["open", "shipped", "closed"]},
             "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                 "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                 "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                "note": {"type": "string", "maxLength": 10}}}},
             "paid": {"type": "boolean"}}}
QUESTION = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(tmp_path_factory.mktemp("structured"), real_engine=True, model=str(DEFAULT_MODEL_DIR)) as ls:
        yield ls


def client(ls) -> openai.OpenAI:
    return openai.OpenAI(base_url=ls.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def json_schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, ORDER], ids=["person", "order"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate(server, schema, temperature):
    for seed in (1, 2):
        r = client(server).chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, max_tokens=300, temperature=temperature, seed=seed,
            response_format=json_schema("answer", schema))
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_schema_on_completions_and_json_object_parse(server):
    c = client(server)
    r = c.completions.create(model=MODEL_NAME, prompt="An order:", max_tokens=200, temperature=0,
                             extra_body={"response_format": json_schema("order", ORDER)})
    jsonschema.validate(json.loads(r.choices[0].text), ORDER)
    r = c.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=100, temperature=0,
                                  response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_max_tokens_cuts_a_json_answer_with_length(server):
    r = client(server).chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=4, temperature=0,
                                               response_format=json_schema("person", PERSON))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def check_chat_entries(entries, text: str, top: int) -> None:
    assert "".join(e.token for e in entries) == text
    for e in entries:
        assert e.logprob <= 0 and bytes(e.bytes) == e.token.encode()
        assert len(e.top_logprobs) == top
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert all(bytes(t.bytes) == t.token.encode() for t in e.top_logprobs)


def test_chat_logprobs_streamed_equal_non_streamed(server):
    c = client(server)
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20,
                  temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    full = c.chat.completions.create(**kwargs)
    entries = full.choices[0].logprobs.content
    assert len(entries) == 20
    check_chat_entries(entries, full.choices[0].message.content, 4)
    assert all(e.top_logprobs[0].token == e.token for e in entries)          # greedy: the best one
    streamed, text = [], ""
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                streamed += choice.logprobs.content
                assert "".join(e.token for e in choice.logprobs.content) == choice.delta.content
    assert text == full.choices[0].message.content
    assert [(e.token, e.top_logprobs[1].token) for e in streamed] == \
        [(e.token, e.top_logprobs[1].token) for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    plain = c.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == text


def test_chat_logprobs_under_a_json_schema(server):
    r = client(server).chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=300, temperature=0,
                                               logprobs=True, top_logprobs=2,
                                               response_format=json_schema("person", PERSON))
    entries = r.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    assert entries[0].token == "{" and entries[0].logprob == 0.0        # forced: the only token allowed
    assert [t.token for t in entries[0].top_logprobs] == ["{"]             # cut tokens are never listed


def test_completion_logprobs_shape_and_stop_string_trimming(server):
    c = client(server)
    kwargs = dict(model=MODEL_NAME, prompt="And the king said", max_tokens=24, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    full = c.completions.create(**kwargs).choices[0]
    lp = full.logprobs
    assert "".join(lp.tokens) == full.text and len(lp.tokens) == 24
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and token in top and top[token] == value and 2 <= len(top) <= 3
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = c.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    joined = "".join(cut.logprobs.tokens)
    # the tokens whose text begins before the stop string are listed (the last may reach into it), no others
    assert joined.startswith(cut.text) and all(o < len(cut.text) for o in cut.logprobs.text_offset)
    assert len(cut.logprobs.tokens) == len([o for o in lp.text_offset if o < len(cut.text)])


def test_bad_schema_is_a_400_with_the_grammar_engines_message(server):
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=8,
                                               response_format=json_schema("bad", bad))
    body = err.value.body
    assert body["param"] == "response_format.json_schema.schema" and body["code"] == "invalid_json_schema"
    assert "Invalid type: strin" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=8,
                                               response_format=json_schema("bad", {"not": {"type": "string"}}))
    assert "not" in err.value.body["message"]                      # strict: an unimplemented keyword is refused
    lenient = {"type": "json_schema", "json_schema": {"name": "ok", "schema": {"type": "object", "not": {}},
                                                      "strict": False}}
    r = client(server).chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=30, temperature=0,
                                               response_format=lenient)
    assert r.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as err:
        client(server).chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=8, logprobs=True,
                                               top_logprobs=21)
    assert err.value.body["param"] == "top_logprobs"
