"""How many prompt bytes one token can stand for: the bound that rejects an over-long prompt before tokenizing.

A prompt of B UTF-8 bytes has at least B / max_bytes_per_token tokens when the tokenizer drops no input and no
token covers more than max_bytes_per_token bytes of it. Then a prompt of more than
context_tokens * max_bytes_per_token bytes cannot fit the context, and is refused without tokenizing it
(tokenizing 8 MB takes seconds and gigabytes). The bound is computed from the tokenizer's own description
(tokenizer.json):

- every token's text, the added tokens included: a byte-level BPE token covers as many bytes as its text has
  characters (each stands for one byte); any other token covers at most the UTF-8 bytes of its text (a
  SentencePiece '▁' is 3 bytes for a 1-byte space, byte-fallback '<0x41>' 6 for 1);
- times the most a normalizer can shrink its input: 1 for none, Prepend, and a Replace that does not shorten;
  4 for the Unicode normalizations and Lowercase (NFC composes at most 3 bytes into 1, e.g. Hangul jamo);
- None (no bound: every prompt is tokenized, still off the event loop) for a tokenizer that may drop input:
  normalizers that strip, pre-tokenizers that drop whitespace or delimiters, a model that folds runs of unknown
  characters into one token (WordPiece, WordLevel, BPE/Unigram with fuse_unk and no byte fallback).

The models served here (Qwen3-MoE, Mixtral, OLMoE, the embedded tiny model, the workload checkpoints) are
byte-level BPE or SentencePiece-BPE tokenizers, which have a bound.
"""
from __future__ import annotations

import json
from typing import Any

SHRINKING_NORMALIZERS = {"NFC": 4, "NFD": 4, "NFKC": 4, "NFKD": 4, "Lowercase": 4, "Prepend": 1}
KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split", "Sequence")


def _normalizer_factor(spec: Any) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        content = spec.get("content", "")
        if not isinstance(pattern, dict) or "String" not in pattern or not content:
            return None                      # a regex, or a deletion: no bound
        shrink = len(pattern["String"].encode("utf-8")) / len(content.encode("utf-8"))
        return max(1, int(-(-shrink // 1)))
    return SHRINKING_NORMALIZERS.get(kind)


def _pre_tokenizer_keeps_input(spec: Any) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_input(p) for p in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") != "Removed"
    if kind == "Punctuation":
        return spec.get("behavior", "Isolated") != "Removed"
    return kind in KEEPING_PRE_TOKENIZERS


def _model_keeps_input(spec: Any, byte_level: bool) -> bool:
    kind = spec.get("type")
    if kind == "Unigram":
        return bool(spec.get("byte_fallback"))       # else runs of unknown characters fold into one token
    if kind != "BPE":
        return False                                  # WordPiece / WordLevel: a whole unknown word, one token
    if byte_level or spec.get("byte_fallback"):
        return True
    return spec.get("unk_token") is not None and not spec.get("fuse_unk")   # no unk token: unknowns vanish


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """Most prompt bytes one token of `tokenizer` (a tokenizers.Tokenizer) can stand for; None: no bound."""
    spec = json.loads(tokenizer.to_str())
    byte_level = '"ByteLevel"' in json.dumps(spec.get("pre_tokenizer"))
    factor = _normalizer_factor(spec.get("normalizer"))
    if factor is None or not _pre_tokenizer_keeps_input(spec.get("pre_tokenizer")) \
            or not _model_keeps_input(spec.get("model") or {}, byte_level):
        return None
    added = {t.get("content", "") for t in spec.get("added_tokens", [])}
    longest = 1 if byte_level else 4          # an unknown character: one token of up to 4 bytes
    for text in tokenizer.get_vocab(with_added_tokens=True):
        n = len(text) if byte_level and text not in added else len(text.encode("utf-8"))
        longest = max(longest, n)
    return longest * factor


def utf8_length_over(text: str, limit: int) -> bool:
    """len(text.encode('utf-8')) > limit, without encoding where the character count decides it."""
    if len(text) > limit:
        return True                          # every character is at least one byte
    if 4 * len(text) <= limit:
        return False                         # ... and at most four
    return len(text.encode("utf-8", "surrogatepass")) > limit
