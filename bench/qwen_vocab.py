"""Write the Qwen2 / Qwen3 byte-level BPE tokenizer.json from Qwen's tiktoken file, for measurements that need a real
~150K vocabulary on a machine without the model (bench/compare_grammar_libs.py, bench/bench_grammar.py).

Qwen's 151,643 ordinary tokens are the ranks of `qwen.tiktoken` (base64 token bytes and a rank a line; the PyPI
package `dashscope` ships it as dashscope/resources/qwen.tiktoken); Qwen3 adds 26 special tokens after them
(151643 <|endoftext|> ... 151668 </think>), so the vocabulary has 151,669 entries (the model's embedding has
151,936 rows). The merges are recovered from the ranks as transformers' tiktoken converter does (every split of a
token into two tokens, in rank order), and the pre-tokenizer is Qwen2's split regex then byte-level.

    pip download --no-deps -d /tmp/dl dashscope && unzip -o /tmp/dl/dashscope-*.whl dashscope/resources/qwen.tiktoken -d /tmp/dl
    PYTHONPATH=src python bench/qwen_vocab.py /tmp/dl/dashscope/resources/qwen.tiktoken /tmp/qwen3-tokenizer/tokenizer.json
"""
from __future__ import annotations

import argparse
import base64
import os

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
               r"\s+(?!\S)|\s+")
QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
                  "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def read_tiktoken(path: str) -> dict[bytes, int]:
    ranks = {}
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    merges = []
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        local.sort(key=lambda m: (ranks[m[0]], ranks[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: m[2])
    return [(a, b) for a, b, _ in merges]


def write_tokenizer_json(tiktoken_path: str, out_path: str) -> int:
    """Build and save the tokenizer; returns its vocabulary size (with the special tokens)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from ftexpert.coordinator.logprobs import bytes_to_unicode

    ranks = read_tiktoken(tiktoken_path)
    b2u = bytes_to_unicode()
    text = lambda b: "".join(b2u[x] for x in b)         # noqa: E731 - byte-level spelling of token bytes
    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN3_SPECIALS])
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tok.save(out_path)
    return tok.get_vocab_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tiktoken", help="qwen.tiktoken (from the dashscope package)")
    ap.add_argument("out", help="where to write tokenizer.json")
    args = ap.parse_args()
    print(f"{args.out}: {write_tokenizer_json(args.tiktoken, args.out)} tokens")


if __name__ == "__main__":
    main()
