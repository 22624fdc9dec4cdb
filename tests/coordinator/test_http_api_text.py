"""Text handling behind the HTTP API: incremental detokenizing, stop strings, chat templates."""
from __future__ import annotations

import os
import sys

import pytest
from hypothesis import assume, given, settings, strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import write_tiny_model_dir  # noqa: E402

from ftexpert.coordinator.detokenizer import IncrementalDetokenizer, StopStringMatcher  # noqa: E402
from ftexpert.coordinator.text_codec import ChatMessage, ChatTemplate, TextCodec, render_chatml  # noqa: E402
from ftexpert.gpu_worker.checkpoint.tiny import SPECIAL_TOKENS  # noqa: E402


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    return TextCodec.from_model_dir(write_tiny_model_dir(str(tmp_path_factory.mktemp("m"))))


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=40))
def test_incremental_detokenizer_reassembles_multibyte_text_exactly(codec, text):
    # a special token's text encodes to that token, which decoding skips by design
    assume(not any(special in text for special in SPECIAL_TOKENS))
    ids = codec.encode(text, add_special_tokens=False)      # one token per UTF-8 byte
    detok = IncrementalDetokenizer(codec.decode, codec.encode("prompt"))
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in text


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                 min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=6))
def test_stop_matcher_emits_exactly_the_text_before_the_first_stop(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    bounds = sorted(set([0, len(text)] + [min(c, len(text)) for c in cuts]))
    out = "".join(matcher.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    if not matcher.stopped:
        out += matcher.flush()
    # Generation stops at the first chunk after which the text so far holds a stop string; the
    # output is that text up to the earliest stop in it. (A longer stop that would start earlier
    # but is still incomplete at that point never gets the chance to complete.)
    expected, stopped = text, False
    for end in bounds[1:]:
        seen = text[:end]
        hits = [seen.find(s) for s in stops if s in seen]
        if hits:
            expected, stopped = seen[:min(hits)], True
            break
    assert out == expected
    assert matcher.stopped == stopped


def test_chat_template_renders_like_chatml_and_falls_back_without_a_template(codec):
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")]
    assert codec.chat_template.kind == "jinja2"
    assert codec.chat_template.render(messages) == render_chatml(messages)
    fallback = ChatTemplate(None)
    assert fallback.kind == "chatml" and fallback.render(messages).endswith("<|im_start|>assistant\n")


def test_chat_template_errors_are_value_errors():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
    refusing = ChatTemplate("{{ raise_exception('only user and assistant roles') }}")
    with pytest.raises(ValueError, match="only user and assistant"):
        refusing.render([ChatMessage("user", "x")])


def test_eos_ids_come_from_the_tokenizer_config(codec):
    assert codec.eos_token_ids == [codec.tokenizer.token_to_id("<|endoftext|>")]
    assert codec.decode(codec.eos_token_ids) == ""            # special tokens are not shown
