"""Structured output in the engine (gpu_worker/engine/grammar.py, sampling.py) on the embedded model:

- the grammar mask against a plain reference: the allowed tokens of a few states computed by brute force over the
  vocabulary (a token is allowed when its bytes extend the text so far towards one of the documents the schema
  admits; EOS when the text is one of them), and the bitmask's application against a per-token loop;
- constrained and unconstrained requests in one batch (CPU, and on CUDA with graphs and overlap on): outputs
  that validate, an unconstrained neighbour's tokens as alone, no step queued ahead while a constrained request
  runs, max_tokens cut -> length;
- a tool-call grammar (literal text, a JSON value of a schema, literal text; one alternative per tool).
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ftexpert.gpu_worker.api import DEFAULT_MODEL_DIR, build_engine
from ftexpert.gpu_worker.engine import Engine, EngineConfig
from ftexpert.gpu_worker.engine.grammar import GrammarMasks, apply_token_bitmask_, mask_words
from ftexpert.proto.engine_spec import EngineSpec
from ftexpert.proto.grammar_spec import GrammarSpec
from ftexpert.proto.sampling_params import SamplingParams

from ftexpert.coordinator.logprobs import TokenPieces
from tests.gpu_worker.grammar_util import FLAG_DOCS, FLAGS, PERSON

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 10}}, "x-guidance": {"whitespace_flexible": False}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}, "x-guidance": {"whitespace_flexible": False}}
TOOL_CALL = f'''
start: "<tool_call>\\n" call "\\n</tool_call>"
call: weather | time
weather: "{{\\"name\\":\\"get_weather\\",\\"arguments\\":" %json {json.dumps(WEATHER)} "}}"
time: "{{\\"name\\":\\"get_time\\",\\"arguments\\":" %json {json.dumps(TIME)} "}}"
'''


@pytest.fixture(scope="module")
def built():
    return build_engine(EngineSpec(device="cpu", model=DEFAULT_MODEL_DIR, max_running_requests=4,
                                   max_context_tokens=512, overlap_decode="on"))


def fresh(built, **config) -> Engine:
    cfg = EngineConfig(**{"max_running_requests": 4, "max_context_tokens": 512, "overlap_decode": True, **config})
    return Engine(built.engine.model, cfg, built.source.eos_token_ids, built.engine.grammars)


def run(engine: Engine, requests: dict) -> dict:
    """request id -> (generated ids, finish reason); also checks that no step was queued ahead while a
    constrained request was running."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    out = {rid: ([], None) for rid in requests}
    while engine.has_work():
        constrained = any(r.sampler.grammar is not None for r in engine.scheduler.running)
        ahead = engine.stats.decode_steps_ahead
        for o in engine.step():
            out[o.request_id][0].append(o.new_token_id)
            if o.finished:
                out[o.request_id] = (out[o.request_id][0], o.finish_reason)
        assert not (constrained and engine.stats.decode_steps_ahead > ahead), "queued ahead of a constrained step"
    return out


def text_of(built, ids) -> str:
    return built.source.tokenizer.decode(ids)


# ---------------------------------------------------------------- the mask against brute force

def reference_allowed(pieces: TokenPieces, vocab: int, special: set[int], eos: list[int], prefix: bytes) -> set[int]:
    """Tokens whose bytes take `prefix` towards one of FLAG_DOCS, and EOS when `prefix` is one of them."""
    allowed = {t for t in range(vocab) if t not in special and pieces.bytes_of(t)
               and any(doc.startswith(prefix + pieces.bytes_of(t)) for doc in FLAG_DOCS)}
    return allowed | (set(eos) if prefix in FLAG_DOCS else set())


def test_mask_equals_the_brute_force_allowed_set(built):
    grammars = built.engine.grammars
    tok = built.source.tokenizer.tokenizer
    vocab = built.engine.model.cfg.vocab_size
    pieces = TokenPieces(tok)
    special = {t.id if hasattr(t, "id") else i for i, t in tok.get_added_tokens_decoder().items()}
    eos = grammars.eos_token_ids
    state = grammars.matcher(GrammarSpec.json_schema(FLAGS))
    masks = GrammarMasks(4, vocab, torch.device("cpu"))
    doc = FLAG_DOCS[1].decode()
    ids = tok.encode(doc, add_special_tokens=False).ids
    prefix, choices = b"", 0
    for step, token in enumerate(ids + [None]):
        row = masks.fill([state])[0]
        bits = [(int(row[t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        got = {t for t in range(vocab) if bits[t]}
        reference = reference_allowed(pieces, vocab, special, eos, prefix)
        # Where the schema leaves a choice (true / false, red / green, the end) the sets are equal. Where it forces
        # the next bytes (a key, the rest of a literal), llguidance allows only the tokens of their canonical BPE
        # tokenization ("ok" but not "o" then "k"), a subset of what merely spells them.
        branches = {doc[len(prefix):len(prefix) + 1] for doc in FLAG_DOCS if doc.startswith(prefix)}
        if len(branches) > 1 or prefix in FLAG_DOCS:
            assert got == reference, f"state {step}: after {prefix!r}"
            choices += 1
        else:
            assert got and got <= reference, f"state {step}: after {prefix!r}"
        assert got == state.allowed(vocab)
        if token is None:
            break
        assert token in got
        state.accept(token)
        prefix += pieces.bytes_of(token)
    assert state.done and prefix == FLAG_DOCS[1] and choices == 3


def test_batched_fill_and_apply_match_a_per_token_loop(built):
    grammars = built.engine.grammars
    vocab = built.engine.model.cfg.vocab_size
    states = [grammars.matcher(GrammarSpec.json_schema(FLAGS)), grammars.matcher(GrammarSpec("json_object")),
              grammars.matcher(GrammarSpec.json_schema(PERSON))]
    states[0].accept(built.source.tokenizer.encode("{")[0])
    masks = GrammarMasks(4, vocab, torch.device("cpu"))
    rows = masks.fill(states).clone()                     # three rows, filled in parallel
    for i, s in enumerate(states):
        assert rows[i].tolist() == masks.fill([s])[0].tolist()
    logits = torch.randn(5, vocab)
    expected = logits.clone()
    targets = [4, 0, 2]
    for i, r in enumerate(targets):
        for t in range(vocab):
            if not (int(rows[i, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    apply_token_bitmask_(logits, rows, targets)
    assert torch.equal(logits, expected)
    assert rows.shape == (3, mask_words(vocab))


def test_grammar_cache_compiles_each_spec_once(built):
    grammars = built.engine.grammars
    spec = GrammarSpec.json_schema({"type": "array", "items": {"type": "integer"}, "maxItems": 2})
    before = grammars.compiled
    a, b = grammars.matcher(spec), grammars.matcher(GrammarSpec.json_schema(json.loads(spec.text)))
    assert grammars.compiled == before + 1 and a.matcher is not b.matcher


# ---------------------------------------------------------------- the engine path

def test_constrained_and_unconstrained_requests_share_a_batch(built):
    tok = built.source.tokenizer
    prompt = tok.encode("The quick brown fox")
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    alone = run(fresh(built), {"free": (tok.encode("And he said"), greedy)})["free"]
    out = run(fresh(built), {
        "person": (prompt, SamplingParams(max_new_tokens=200, grammar=GrammarSpec.json_schema(PERSON))),
        "flags": (prompt, SamplingParams(max_new_tokens=60, temperature=0.9, seed=3,
                                         grammar=GrammarSpec.json_schema(FLAGS))),
        "object": (prompt, SamplingParams(max_new_tokens=60, grammar=GrammarSpec("json_object"))),
        "free": (tok.encode("And he said"), greedy)})
    for rid, schema in (("person", PERSON), ("flags", FLAGS)):
        ids, reason = out[rid]
        assert reason == "stop", (rid, text_of(built, ids))
        jsonschema.validate(json.loads(text_of(built, ids)), schema)
    assert isinstance(json.loads(text_of(built, out["object"][0])), dict) and out["object"][1] == "stop"
    assert out["free"] == alone                           # its row is not masked: the same tokens as alone


def test_max_tokens_cut_is_length_and_overlap_resumes_without_grammars(built):
    engine = fresh(built)
    prompt = built.source.tokenizer.encode("Once")
    out = run(engine, {"cut": (prompt, SamplingParams(max_new_tokens=5, grammar=GrammarSpec.json_schema(PERSON)))})
    ids, reason = out["cut"]
    assert reason == "length" and len(ids) == 5 and text_of(built, ids) == '{"name"'
    assert engine.stats.decode_steps_ahead == 0
    run(engine, {"free": (prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))})
    assert engine.stats.decode_steps_ahead > 0            # an unconstrained batch queues ahead as before


def test_an_engine_without_a_tokenizer_refuses_a_grammar(built):
    engine = Engine(built.engine.model, EngineConfig(max_context_tokens=64))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1, 2], SamplingParams(grammar=GrammarSpec("json_object")))


def test_a_tool_call_grammar_constrains_the_model(built):
    out = run(fresh(built), {
        i: (built.source.tokenizer.encode(p), SamplingParams(max_new_tokens=80, temperature=t, seed=i,
                                                            grammar=GrammarSpec("grammar", TOOL_CALL)))
        for i, (p, t) in enumerate([("What is the weather", 0.0), ("The time is", 1.0), ("Call a tool", 1.2)])})
    for ids, reason in out.values():
        text = text_of(built, ids)
        assert reason == "stop" and text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
        call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
        schema = {"get_weather": WEATHER, "get_time": TIME}[call["name"]]
        jsonschema.validate(call["arguments"], schema)


# ---------------------------------------------------------------- CUDA: graphs and overlap

@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")]), "cpu"])
def test_constrained_requests_with_cuda_graphs_and_overlap(device):
    """Constrained requests beside an unconstrained one with the decode step queued ahead (and, on CUDA, replayed
    from CUDA graphs): no step is queued ahead while a constrained request runs; "free" outlasts them (more tokens
    than either may take) and then runs on alone, queued ahead."""
    built = build_engine(EngineSpec(device=device, model=DEFAULT_MODEL_DIR, max_running_requests=4,
                                    max_context_tokens=512, overlap_decode="on"))
    engine = built.engine
    assert engine.overlap_decode and (engine.graphs is not None) == (device == "cuda")
    tok = built.source.tokenizer
    out = run(engine, {
        "person": (tok.encode("The quick brown fox"), SamplingParams(max_new_tokens=200,
                                                                     grammar=GrammarSpec.json_schema(PERSON))),
        "flags": (tok.encode("Yes"), SamplingParams(max_new_tokens=60, temperature=0.9, seed=3, logprobs=3,
                                                    grammar=GrammarSpec.json_schema(FLAGS))),
        "free": (tok.encode("And he said"), SamplingParams(max_new_tokens=240, ignore_eos=True))})
    for rid, schema in (("person", PERSON), ("flags", FLAGS)):
        ids, reason = out[rid]
        assert reason == "stop", (rid, text_of(built, ids))
        jsonschema.validate(json.loads(text_of(built, ids)), schema)
    assert len(out["free"][0]) == 240 > max(len(out["person"][0]), len(out["flags"][0]))
    assert engine.stats.decode_steps_ahead > 0           # "free" ran on alone, queued ahead
    assert device == "cpu" or engine.graphs.replays > 0
