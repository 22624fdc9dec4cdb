"""The soak's agent-like conversations: one shared system prompt and histories that grow turn by turn, as a coding
agent or a long chat resends its whole conversation every turn and adds a little. Each script is a seeded run of
user turns; its greedy replies are taken once, one at a time, before the load (the reference), and under load a
conversation replays the script, sending back the reference replies as the assistant's turns, and checks every
reply. Only the last turn of each request is new to the server: with the prefix cache on, the rest is found in it
(report.py checks the hit share from /metrics)."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Callable

SYSTEM_PROMPT = (
    "You are a careful coding agent working in a Python repository. You read the files you are shown, run the "
    "tests you are asked to run, and answer in short sentences. Keep every change small, say what you changed "
    "and why, and never invent a file, a function or a test result that you were not shown. When a command "
    "fails, read its output before you try anything else.")
USER_TURNS = [
    "List the files in the src folder.",
    "Output of `ls src`: __init__.py cli.py server.py engine.py. Which file starts the server?",
    "Open server.py and tell me what the main function does.",
    "The tests printed: 3 passed, 1 failed (test_timeout). What would you look at first?",
    "Here is the failing assertion: expected 30, got 60. Where could the doubled value come from?",
    "Apply the smallest fix you can think of and describe it.",
    "Run the tests again. Output: 4 passed. Summarize what we did.",
    "Now add a line to the changelog about the fix.",
]
SCRIPTS = 4                    # distinct conversations (each replayed many times under load)
MAX_TURNS = 6
MAX_TOKENS = 16
TURN_SLACK_TOKENS = 64         # room kept for the next user turn and the template's markers


@dataclass
class Script:
    turns: list[str]                                     # the user turns, in order
    replies: list[str] = field(default_factory=list)     # the reference replies (greedy), one per turn taken
    prompt_tokens: list[int] = field(default_factory=list)


def make_scripts(seed: int) -> list[Script]:
    rng = random.Random(seed)
    return [Script([rng.choice(USER_TURNS) for _ in range(MAX_TURNS)]) for _ in range(SCRIPTS)]


def messages(script: Script, turn: int) -> list[dict]:
    """The request of `turn`: the system prompt, the turns before it with their reference replies, the new turn."""
    out = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i in range(turn):
        out += [{"role": "user", "content": script.turns[i]}, {"role": "assistant", "content": script.replies[i]}]
    return out + [{"role": "user", "content": script.turns[turn]}]


def body(script: Script, turn: int) -> bytes:
    return json.dumps({"model": "soak", "messages": messages(script, turn), "max_tokens": MAX_TOKENS,
                       "temperature": 0}).encode()


Post = Callable[[str, bytes], "tuple[int, bytes]"]


def take_references(scripts: list[Script], post: Post, context_tokens: int) -> None:
    """Each script's greedy replies, one request at a time; a script ends where its next turn might not fit the
    context (so under load every turn fits)."""
    for script in scripts:
        for turn in range(len(script.turns)):
            status, raw = post("/v1/chat/completions", body(script, turn))
            if status != 200:
                raise RuntimeError(f"reference agent turn failed: {status} {raw[:300]!r}")
            doc = json.loads(raw)
            script.replies.append(doc["choices"][0]["message"]["content"])
            script.prompt_tokens.append(doc["usage"]["prompt_tokens"])
            grown = doc["usage"]["prompt_tokens"] + doc["usage"]["completion_tokens"]
            if grown + TURN_SLACK_TOKENS + MAX_TOKENS > context_tokens:
                break
        script.turns = script.turns[:len(script.replies)]


def replay(script: Script, post: Post, failure: Callable[[int, bytes], "tuple[str, str]"]) -> tuple[str, str]:
    """(result, detail) of one conversation under load: ok when every reply equals the reference; a turn that got
    no answer: `failure(status, body)` (the harness's classification)."""
    for turn in range(len(script.turns)):
        status, raw = post("/v1/chat/completions", body(script, turn))
        if status != 200:
            return failure(status, raw)
        text = json.loads(raw)["choices"][0]["message"]["content"]
        if text != script.replies[turn]:
            return "wrong", f"agent turn {turn}: {text!r} != {script.replies[turn]!r}"
    return "ok", ""
