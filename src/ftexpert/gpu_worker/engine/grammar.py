"""Structured output in the sampler: a request's `GrammarSpec` (proto/grammar_spec.py) becomes a token mask.

    grammars = GrammarCompiler(tokenizer_json, vocab_size=cfg.vocab_size, eos_token_ids=eos)
    state = grammars.matcher(spec)            # per request; ValueError if the grammar does not compile
    masks = GrammarMasks(max_rows, vocab_size, device)
    masks.apply(logits, rows, [state, ...])   # before sampling: disallowed tokens of those rows -> -inf
    state.accept(token)                       # after sampling; `state.done`: nothing but EOS may follow

The grammar engine is llguidance (docs/DEPENDENCIES.md). Its tokenizer (every token's bytes, built once from the
model's tokenizer.json, on the first constrained request) is sized to the model's vocabulary, so ids the tokenizer
does not have are never allowed; EOS is allowed where the grammar may end. Compiled grammars are cached by
`GrammarSpec.key()`; a request gets a copy of the cached matcher.

Masks: the host fills one int32 bitmask row per constrained request (bit t of row r: token t allowed;
llguidance's executor fills several rows in parallel threads), in pinned memory; one copy takes them to the
device and one masked fill applies them to those rows of the logits. Rows of other requests are not touched.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Iterable, Sequence

import torch

from ftexpert.proto.grammar_spec import GrammarError, GrammarSpec, llguidance_grammar

log = logging.getLogger("ft.engine.grammar")

GRAMMAR_CACHE_SIZE = 128        # compiled grammars kept (least recently used dropped)
MASK_THREADS = 8                # llguidance's executor threads, at most (several constrained rows)


def mask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token. A token the grammar refuses (it was masked, so only a grammar
        engine's limit can cause it) leaves the matcher in its error state, which allows only EOS."""
        if not self.matcher.consume_token(int(token_id)):
            log.warning("the grammar refused token %d: %s", token_id, self.matcher.get_error())

    @property
    def done(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete, or broken)."""
        return self.matcher.is_stopped()

    def allowed(self, vocab_size: int) -> set[int]:
        """The tokens allowed next (a test's view; the sampler uses GrammarMasks)."""
        import numpy as np          # lazy: only this test view needs numpy

        row = np.zeros((1, mask_words(vocab_size)), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
        return set(np.flatnonzero(bits).tolist())


class GrammarCompiler:
    """The model's tokenizer for the grammar engine and the cache of compiled grammars."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self.tokenizer_json, self.vocab_size = tokenizer_json, int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self.compiled = 0

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> "GrammarCompiler":
        """From a `tokenizers.Tokenizer` (checkpoint/tokenizer.py's `TextTokenizer.tokenizer`)."""
        return cls(tokenizer.to_str(), vocab_size, eos_token_ids)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance       # lazy: llguidance, an optional dependency

            try:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
            except Exception as exc:        # the library raises its own types; the request is refused
                raise GrammarError(f"the grammar engine cannot read this model's tokenizer: {exc}") from None
        return self._tokenizer

    def matcher(self, spec: GrammarSpec) -> GrammarState:
        """A fresh state of `spec`'s grammar; ValueError (GrammarError) if it does not compile."""
        key = spec.key()
        compiled = self._cache.get(key)
        if compiled is None:
            # lazy: llguidance, an optional dependency
            from llguidance import LLMatcher

            compiled = LLMatcher(self.tokenizer, llguidance_grammar(spec), log_level=0)
            if compiled.is_error():
                raise GrammarError(f"the grammar does not compile: {compiled.get_error()}")
            self.compiled += 1
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return GrammarState(compiled.deep_copy())


class GrammarMasks:
    """The batch's bitmask: a pinned host buffer the grammar engine fills, its device copy, and the masked fill."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        words = mask_words(vocab_size)
        pin = device.type == "cuda"
        self.host = torch.zeros((max_rows, words), dtype=torch.int32, pin_memory=pin)
        self.refused = refused_bits_table(device)
        self._executor = None

    def fill(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """The allowed tokens of each state as bitmask rows [n, W] int32 on the host (pinned on CUDA)."""
        n = len(states)
        rows = self.host[:n]
        row_bytes = rows.shape[1] * 4
        if n == 1:
            states[0].matcher.unsafe_compute_mask_ptr(rows.data_ptr(), row_bytes)
        else:
            if self._executor is None:
                # lazy: llguidance, an optional dependency
                import llguidance

                threads = max(1, min(MASK_THREADS, len(os.sched_getaffinity(0))))
                self._executor = llguidance.LLExecutor(num_threads=threads)
            self._executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)],
                                                  rows.data_ptr(), row_bytes, n)
        return rows

    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]) -> None:
        """In place: logits [B, V] rows `rows` keep only the tokens their states allow (the rest -inf)."""
        bitmask = self.fill(states).to(self.device, non_blocking=True)
        apply_token_bitmask_(logits, bitmask, rows, self.refused)


def refused_bits_table(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: bit i of byte b is clear (the token it stands for is refused)."""
    return ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).eq(0).to(device)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int],
                         refused: torch.Tensor | None = None) -> None:
    """logits [B, V] fp32, bitmask [n, W] int32 (bit t of word t // 32: token t allowed; little-endian words),
    rows: n row indices -> in place, the disallowed tokens of those rows set to -inf. One gather of a byte table
    (one byte a token, no wider temporary) and one masked fill."""
    n, vocab = len(rows), logits.shape[-1]
    if refused is None:
        refused = refused_bits_table(logits.device)
    mask = refused.index_select(0, bitmask.view(torch.uint8).reshape(-1).int()).view(n, -1)[:, :vocab]   # [n, V]
    if n == logits.shape[0] and list(rows) == list(range(n)):
        logits.masked_fill_(mask, float("-inf"))
        return
    index = torch.tensor(list(rows), dtype=torch.int64).to(logits.device, non_blocking=True)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(mask, float("-inf")))
