"""`TextTokenizer`: a checkpoint's ``tokenizer.json`` (the `tokenizers` library) plus what
``tokenizer_config.json`` and ``generation_config.json`` add: special tokens, EOS ids, chat template.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); re-download it") from None


CHAT_TEMPLATE_FILE = "chat_template.jinja"     # where newer checkpoints (gpt-oss's harmony format) keep it


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """EOS ids named by generation_config.json (an int or a list), or ()."""
    eos = _read_json(Path(model_dir) / GENERATION_CONFIG_FILE).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any] | None = None, directory: Path | None = None):
        self.tokenizer = tokenizer
        self.directory = directory             # where its files are (from_dir): other processes load it from there
        config = config or {}
        self.chat_template: str | None = config.get("chat_template")
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: tuple[int, ...] = (eos_id,) if eos_id is not None else ()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TextTokenizer | None":
        """The directory's tokenizer, or None when it has no tokenizer.json."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            return None
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises its own exception type
            raise ValueError(f"cannot read {path}: {exc}; re-download it") from None
        config = _read_json(Path(model_dir) / TOKENIZER_CONFIG_FILE)
        jinja = Path(model_dir) / CHAT_TEMPLATE_FILE
        if not config.get("chat_template") and jinja.is_file():       # transformers 5 / gpt-oss: its own file
            config = {**config, "chat_template": jinja.read_text()}
        return cls(tok, config, Path(model_dir))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside this tokenizer's vocabulary are dropped."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render chat ``messages`` ([{"role": ..., "content": ...}]) with the checkpoint's template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template in tokenizer_config.json; send a raw "
                             "prompt instead of chat messages")
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # lazy: jinja2 (~80 ms) for chat templates only
        except ImportError:
            raise RuntimeError("chat templates need jinja2: pip install jinja2") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token or "", bos_token=self.bos_token or "")
