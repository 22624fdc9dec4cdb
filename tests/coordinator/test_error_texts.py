"""Error texts without doubled spaces: every refusal the OpenAI request parser gives for a sweep of bad and
unsupported options, and a scan of src/ for f-strings that put a piece which can be empty (or begins or ends with
a space) next to a space, as "'logprobs'  is not supported" was built from "'{name}' {what} is ..." with what=""."""
from __future__ import annotations

import ast
import itertools
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from coordinator_support import MODEL_NAME, write_tiny_model_dir  # noqa: E402

from ftexpert.coordinator.openai_requests import ApiError, ModelInfo, parse_chat, parse_completion  # noqa: E402
from ftexpert.coordinator.text_codec import TextCodec  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src" / "ftexpert"
OPTIONS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
           "seed", "n", "stop", "stream", "stream_options", "ignore_eos", "stop_token_ids", "logprobs",
           "top_logprobs", "echo", "best_of", "suffix", "presence_penalty", "frequency_penalty", "logit_bias",
           "tools", "functions", "tool_choice", "response_format", "user"]
VALUES = [None, True, False, -1, 0, 1, 2, 1.5, 1e30, "", "x", "required", [], ["x"], [1], [[]], {}, {"1": 1},
          {"type": "json_object"}, {"type": "text"}, [{"role": "user"}], [{"role": "nobody", "content": "x"}],
          [{"role": "user", "content": [{"type": "image_url"}]}]]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ModelInfo:
    codec = TextCodec.from_model_dir(write_tiny_model_dir(str(tmp_path_factory.mktemp("model"))))
    return ModelInfo(MODEL_NAME, 256, codec)


def test_the_request_parser_refuses_without_doubled_spaces(model):
    base = {False: {"model": MODEL_NAME, "prompt": "hi"},
            True: {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}}
    messages: dict[str, str] = {}
    for chat, option, value in itertools.product((False, True), OPTIONS, VALUES):
        try:
            (parse_chat if chat else parse_completion)({**base[chat], option: value}, model)
        except ApiError as exc:
            messages.setdefault(exc.message, f"{'chat' if chat else 'completion'} {option}={value!r}")
    refusals = [m for m in messages if "is not supported" in m]
    assert len(messages) > 30 and len(refusals) > 5, messages        # the sweep reaches the refusals
    doubled = {m: body for m, body in messages.items() if "  " in m}
    assert not doubled, doubled


# ---------------------------------------------------------------- the scan of src/

UNKNOWN = "x"        # a piece whose text is not known here: taken to be neither empty nor space-bounded


def _called(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


class _Module:
    """What one module's own code says a name can hold: defaults, arguments at its call sites, assignments, and
    what its functions return (a rough, local reading: enough for the helpers messages are built with)."""

    def __init__(self, tree: ast.Module):
        self.funcs = {}
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.funcs.setdefault(n.name, n)
        self.calls = defaultdict(list)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and _called(n.func) in self.funcs:
                self.calls[_called(n.func)].append(n)

    def env(self, fn) -> dict[str, list[ast.expr]]:
        env = defaultdict(list)
        params = fn.args.posonlyargs + fn.args.args
        for a, d in zip(params[len(params) - len(fn.args.defaults):], fn.args.defaults):
            env[a.arg].append(d)
        for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults):
            if d is not None:
                env[a.arg].append(d)
        skip = 1 if params and params[0].arg in ("self", "cls") else 0
        for call in self.calls[fn.name]:
            for i, value in enumerate(call.args):
                if i + skip < len(params) and not isinstance(value, ast.Starred):
                    env[params[i + skip].arg].append(value)
            for kw in call.keywords:
                if kw.arg:
                    env[kw.arg].append(kw.value)
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        env[t.id].append(n.value)
        return env

    def texts(self, e: ast.expr, env, depth: int = 3) -> list[str]:
        """Texts `e` can have, as far as their first and last characters go."""
        if depth <= 0:
            return [UNKNOWN]
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return [e.value]
        if isinstance(e, ast.IfExp):
            return self.texts(e.body, env, depth) + self.texts(e.orelse, env, depth)
        if isinstance(e, ast.BoolOp):
            return [t for v in e.values for t in self.texts(v, env, depth)]
        if isinstance(e, ast.JoinedStr):
            if not e.values:
                return [""]
            head, tail = e.values[0], e.values[-1]
            return [(head.value[:1] if isinstance(head, ast.Constant) else UNKNOWN) + UNKNOWN
                    + (tail.value[-1:] if isinstance(tail, ast.Constant) else UNKNOWN)]
        if isinstance(e, ast.Name) and e.id in env:
            return [t for v in env[e.id] for t in self.texts(v, env, depth - 1)]
        if isinstance(e, ast.Call) and _called(e.func) in self.funcs:
            fn = self.funcs[_called(e.func)]
            returns = [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
            return [t for r in returns for t in self.texts(r, self.env(fn), depth - 1)] or [UNKNOWN]
        return [UNKNOWN]


def doubled_spaces(source: str) -> list[tuple[int, str, str]]:
    """(line, expression, a text of it) for each f-string piece that can make a doubled space where it joins
    its neighbours. A piece that holds a doubled space itself is padding by intent (table columns), not flagged."""
    tree = ast.parse(source)
    module = _Module(tree)
    found = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        env = module.env(fn)
        for node in (n for n in ast.walk(fn) if isinstance(n, ast.JoinedStr)):
            values = node.values
            for i, v in enumerate(values):
                if not isinstance(v, ast.FormattedValue) or v.conversion != -1 or v.format_spec is not None:
                    continue
                before = values[i - 1].value if i and isinstance(values[i - 1], ast.Constant) else UNKNOWN
                after = values[i + 1].value if i + 1 < len(values) and isinstance(values[i + 1], ast.Constant) \
                    else UNKNOWN
                for text in module.texts(v.value, env):
                    joined = before[-1:] + text + after[:1]
                    if "  " in joined and "  " not in text:
                        found.add((v.lineno, ast.unparse(v.value), text))
    return sorted(found)


def test_the_scan_finds_the_patterns_it_is_for():
    assert doubled_spaces('''
def refuse(name, what):
    raise ValueError(f"'{name}' {what} is not supported")
def check(body):
    refuse("logprobs", "")
''') == [(3, "what", "")]
    assert doubled_spaces('''
class Client:
    def _pid(self):
        return f"(pid {self.pid})" if self.pid else ""
    def fail(self):
        raise RuntimeError(f"CPU worker {self._pid()} of channel died")
''') == [(6, "self._pid()", "")]
    assert doubled_spaces('''
def ok(what=""):
    option = f"{what} " if what else ""
    return f"the {option}option", f"{'FAIL' if what else 'ok  '} |"
''') == []


def test_no_message_in_src_can_have_a_doubled_space():
    found = {f"{path.relative_to(SRC.parent)}:{line}: {{{expr}}} can be {text!r}"
             for path in sorted(SRC.rglob("*.py")) for line, expr, text in doubled_spaces(path.read_text())}
    assert not found, "\n".join(sorted(found))
