"""`GrammarSpec`: what a constrained request's output must match, as the front door checked it and the GPU
worker's sampler enforces it (a field of `SamplingParams`, so it travels in ADD_REQUEST).

Three kinds, each a text the grammar engine (llguidance, docs/DEPENDENCIES.md) compiles the same way in both
processes (`llguidance_grammar`):

- ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``); no text.
- ``json_schema``: a JSON value that matches the JSON schema ``text``. ``strict``: a keyword the compiler does
  not implement is an error (False: it is ignored, so the output may not honour it).
- ``grammar``: a Lark grammar in llguidance's syntax (docs/STRUCTURED_OUTPUT.md). It can put literal text, JSON
  values matching schemas (``%json { ... }``) and alternatives in sequence, so a tool call is one grammar, e.g.
  ``start: "<tool_call>\\n" %json {"type": "object", ...} "\\n</tool_call>"``, with one alternative per tool.

JSON is generated compact (no whitespace between tokens: ``{"a":1,"b":[2,3]}``): flexible whitespace lets a model
pad an answer with spaces until ``max_tokens``. Inside a ``grammar``, a ``%json`` schema takes llguidance's own
default (flexible whitespace) unless it says ``"x-guidance": {"whitespace_flexible": false}``.

Torch-free: the coordinator checks a grammar here (`check_grammar`) before it accepts the request; llguidance
is imported on first use only.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

GRAMMAR_KINDS = ("json_object", "json_schema", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False}     # compact JSON (see the module's docstring)
ANY_OBJECT_SCHEMA = '{"type":"object"}'


class GrammarError(ValueError):
    """The grammar does not compile; the message is the grammar engine's."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str                 # one of GRAMMAR_KINDS
    text: str = ""            # json_schema: the schema as JSON text; grammar: the Lark grammar; json_object: ""
    strict: bool = True       # json_schema: unimplemented keywords are errors (False: ignored)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind {self.kind!r} is not one of {', '.join(GRAMMAR_KINDS)}")
        if (self.kind == "json_object") != (not self.text):
            raise ValueError(f"a {self.kind} grammar {'has no' if self.kind == 'json_object' else 'needs a'} text")

    @classmethod
    def json_schema(cls, schema: dict | bool, strict: bool = True) -> "GrammarSpec":
        """From a schema object (its keys keep their order: properties are generated in it)."""
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), strict)

    def key(self) -> str:
        """What the worker caches its compiled grammar by."""
        return hashlib.sha256(f"{self.kind}\0{int(self.strict)}\0{self.text}".encode()).hexdigest()


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The grammar engine's serialized grammar for `spec` (what LLMatcher compiles against a tokenizer).
    GrammarError when the schema is not JSON."""
    from llguidance import LLMatcher        # lazy: only processes that meet a grammar load it

    if spec.kind == "grammar":
        return LLMatcher.grammar_from_lark(spec.text)
    text = ANY_OBJECT_SCHEMA if spec.kind == "json_object" else spec.text
    try:
        return LLMatcher.grammar_from_json_schema(text, overrides={**JSON_OPTIONS, "lenient": not spec.strict})
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def check_grammar(spec: GrammarSpec) -> None:
    """Compile `spec` without a tokenizer; GrammarError with the grammar engine's message if it does not compile
    (a bad type, a dangling $ref, an unsatisfiable range, an unimplemented keyword when strict, a Lark error)."""
    from llguidance import LLMatcher        # lazy: only processes that meet a grammar load it

    message = LLMatcher.validate_grammar(llguidance_grammar(spec))
    if message and not message.startswith("WARNING"):
        raise GrammarError(message.strip())
