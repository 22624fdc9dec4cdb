"""llguidance against xgrammar: the host time of one constrained token (compute the next-token bitmask, then accept
the token) at batch 1, walking a schema-valid JSON document token by token, and the grammar's compile time.

The choice this measured is in docs/DEPENDENCIES.md ("Structured output"). xgrammar is not a dependency of the
service; install it beside it to compare (it needs torch and transformers, which are here):

    pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi
    PYTHONPATH=src:/tmp/xg python bench/compare_grammar_libs.py --tokenizer src/ftexpert/gpu_worker/checkpoint/data/default-moe/tokenizer.json
    PYTHONPATH=src:/tmp/xg python bench/compare_grammar_libs.py --tokenizer /tmp/qwen3-tokenizer/tokenizer.json --vocab 151936

(the second file is written by bench/qwen_vocab.py). Medians over --repeats walks after one warm-up walk.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
}
DOCUMENT = {"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "role": "admin",
            "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
            "tags": ["mathematics", "analytical engine", "poetry", "notes"], "active": True}


def walk_llguidance(path: str, vocab: int, eos: list[int], tokens: list[int], repeats: int) -> dict:
    import llguidance
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    with open(path) as fh:
        tok = llguidance.LLTokenizer(fh.read(), n_vocab=vocab, eos_token=eos)
    opts = {"whitespace_flexible": False}
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=opts)
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = allocate_token_bitmask(1, vocab)
    per_walk = []
    for r in range(repeats + 1):
        m = matcher.deep_copy()
        t0 = time.perf_counter()
        for t in tokens:
            fill_next_token_bitmask(m, mask)
            assert (mask[0, t // 32] >> (t % 32)) & 1, f"token {t} refused"
            assert m.consume_token(t), m.get_error()
        fill_next_token_bitmask(m, mask)
        if r:
            per_walk.append((time.perf_counter() - t0) / (len(tokens) + 1))
        assert all((mask[0, e // 32] >> (e % 32)) & 1 for e in eos), "EOS not allowed at the end"
    del np
    return {"compile_ms": compile_s * 1e3, "per_token_us": statistics.median(per_walk) * 1e6}


def walk_xgrammar(path: str, vocab: int, eos: list[int], tokens: list[int], repeats: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=path)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, vocab)
    per_walk = []
    for r in range(repeats + 1):
        m = xgr.GrammarMatcher(compiled)
        t0 = time.perf_counter()
        for t in tokens:
            m.fill_next_token_bitmask(mask)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"token {t} refused"
            assert m.accept_token(t)
        m.fill_next_token_bitmask(mask)
        if r:
            per_walk.append((time.perf_counter() - t0) / (len(tokens) + 1))
    return {"compile_ms": compile_s * 1e3, "per_token_us": statistics.median(per_walk) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    ap.add_argument("--vocab", type=int, default=0, help="the model's vocabulary (logits width); 0: the tokenizer's")
    ap.add_argument("--eos", default="<|endoftext|>,<|im_end|>", help="EOS token texts, comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(args.tokenizer)
    vocab = args.vocab or tok.get_vocab_size()
    eos = [i for i in (tok.token_to_id(s) for s in args.eos.split(",")) if i is not None]
    tokens = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False).ids
    print(f"{args.tokenizer}: vocabulary {tok.get_vocab_size()} (mask width {vocab}), document {len(tokens)} tokens")
    for name, walk in (("llguidance", walk_llguidance), ("xgrammar", walk_xgrammar)):
        try:
            res = walk(args.tokenizer, vocab, eos, tokens, args.repeats)
        except ImportError as exc:
            print(f"{name:11s} not installed ({exc})")
            continue
        print(f"{name:11s} compile {res['compile_ms']:8.1f} ms   mask + accept {res['per_token_us']:7.1f} us/token")


if __name__ == "__main__":
    main()
