"""A tiny model in gpt-oss's harmony format for the coordinator's tests: the byte-level test tokenizer with
harmony's special tokens, `<|return|>` and `<|call|>` as its stop tokens, and a harmony chat template of its own
(the structure of gpt-oss's: a system message, a developer message with the instructions and the `functions`
namespace, user turns, the assistant's final answers and calls, tool results from `functions.<name>`; the tools
are written as JSON where gpt-oss's template writes TypeScript)."""
from __future__ import annotations

HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_STOPS = ("<|return|>", "<|call|>")

HARMONY_TEMPLATE = (
    "{%- set sys = messages[0].content if messages and messages[0].role in ('system', 'developer') else '' -%}"
    "{%- set rest = messages[1:] if sys else messages -%}"
    "<|start|>system<|message|>You are a tiny test model.\nReasoning: low\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{% endif -%}"
    "<|end|>"
    "{%- if sys or tools -%}<|start|>developer<|message|>"
    "{%- if sys %}# Instructions\n\n{{ sys }}\n\n{% endif -%}"
    "{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{%- for t in tools %}// {{ t.function.description }}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;\n\n{% endfor %}} // namespace functions{% endif -%}"
    "<|end|>{%- endif -%}"
    "{%- set last = namespace(name=none) -%}"
    "{%- for m in rest -%}"
    "{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}"
    "{%- set call = m.tool_calls[0].function -%}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>{%- set last.name = call.name -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")

HARMONY_SERVER = {"chat_template": HARMONY_TEMPLATE, "specials": HARMONY_SPECIALS, "stop_tokens": HARMONY_STOPS}
