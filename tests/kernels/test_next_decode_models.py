"""The fused forwards of Qwen3-Next and gpt-oss (kernels/next_decode, moe_decode's rope and router) against their
plain torch forwards, on tiny random float32 checkpoints: with the kernels' torch references the fused forward is
the plain one op for op (bit-equal logits); with the Triton kernels (the interpreter here, natively on a GPU) the
engine's greedy tokens are the plain forward's and a decode step's logits agree within 1e-5 relative error.
Prefill chunks and decode steps both run; a decode step takes the Gated DeltaNet decode kernels (conv and recurrent
state rows in place) and writes K/V from the rope kernel."""
from __future__ import annotations

import pytest
import torch

from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.engine.attention import DecodeAttention, PrefillAttention
from ftexpert.gpu_worker.engine.kv_cache import KVCache
from ftexpert.gpu_worker.engine.state_cache import StateCache
from ftexpert.gpu_worker.checkpoint.qwen3_next_weights import FUSED_PROJECTIONS, fuse_next_projections
from ftexpert.gpu_worker.models.qwen3_next import StatefulContext
from ftexpert.kernels import next_decode
from tests.built_engines import build, engine_of
from tests.conftest import KERNEL_DEVICE
from tests.gpu_worker.gpt_oss_util import hf_gpt_oss
from tests.gpu_worker.qwen3_next_util import hf_qwen3_next, save
from tests.gpu_worker.test_models_util import prompt_ids, rel_err

DEV = KERNEL_DEVICE
PROMPTS = [prompt_ids(9, seed=20), prompt_ids(5, seed=21)]


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return save(hf_qwen3_next(seed=7), tmp_path_factory.mktemp("next"))


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf_gpt_oss(seed=7).save_pretrained(str(path))
    return path


def models(path, kernel_impl: str):
    conf = dict(device=DEV, dtype="float32", max_running_requests=2, max_context_tokens=64, prefill_chunk_tokens=4,
                cuda_graphs="off")
    plain = build(path, fused_kernels="off", **conf)
    fused = build(path, fused_kernels="on", **conf)
    fused.model.kernel_impl = kernel_impl
    if kernel_impl == "reference" and hasattr(plain.model, "delta_impl"):
        # the gated delta rule's torch reference on both sides: with fla (CUDA's "auto") the two forwards hand it
        # the same q/k in different forms (normalized / expanded before or inside its kernel), equal only to rounding
        plain.model.delta_impl = fused.model.delta_impl = "reference"
    assert fused.model.fused_kernels and not plain.model.fused_kernels
    return plain, fused


def greedy(loaded, n: int = 6) -> list[list[int]]:
    engine = engine_of(loaded)
    return engine.generate(PROMPTS, SamplingParams(max_new_tokens=n, ignore_eos=True))


def decode_logits(loaded) -> tuple[torch.Tensor, StateCache | None, KVCache]:
    """Prefill both prompts (one chunk each), then one decode step of the two: its logits [2, V]."""
    cfg, model = loaded.cfg, loaded.model
    kv = KVCache(cfg, 2, 32, torch.float32, torch.device(DEV))
    states = StateCache(cfg, 2, torch.float32, torch.device(DEV)) if cfg.linear_attention is not None else None

    def ctx(attn, rows):
        return attn if states is None else StatefulContext(attn, rows)
    for slot, ids in enumerate(PROMPTS):
        n = len(ids)
        attn = PrefillAttention(kv, slot, 0, n)
        model.forward(torch.tensor(ids, device=DEV), torch.arange(n, device=DEV),
                      ctx(attn, None if states is None else states.prefill(slot, 0)))
    slots, positions = torch.tensor([1, 0], device=DEV), torch.tensor([len(PROMPTS[1]), len(PROMPTS[0])], device=DEV)
    attn = DecodeAttention(kv, slots, positions, bucket_tokens=16)
    logits = model.forward(torch.tensor([3, 7], device=DEV), positions,
                           ctx(attn, None if states is None else states.decode(slots)))
    return logits, states, kv


@pytest.mark.parametrize("arch", ["qwen3_next", "gpt_oss"])
def test_fused_forward_with_the_references_is_the_plain_forward(arch, next_dir, gpt_oss_dir):
    plain, fused = models(next_dir if arch == "qwen3_next" else gpt_oss_dir, "reference")
    if arch == "qwen3_next":
        # the fused forward's projections that read one input are one GEMM each (fuse_next_projections), which on
        # CPU may sum in another order than the separate GEMMs; the plain forward takes the same fused weights
        fuse_next_projections(plain.model.dense)
    (a, states_a, kv_a), (b, states_b, kv_b) = decode_logits(plain), decode_logits(fused)
    assert torch.equal(a, b)
    assert torch.equal(kv_a.k, kv_b.k) and torch.equal(kv_a.v, kv_b.v)
    if states_a is not None:
        assert torch.equal(states_a.conv, states_b.conv) and torch.equal(states_a.recurrent, states_b.recurrent)


@pytest.mark.parametrize("arch", ["qwen3_next", "gpt_oss"])
def test_fused_kernels_give_the_plain_tokens_and_logits(arch, next_dir, gpt_oss_dir, monkeypatch, no_tf32):
    plain, fused = models(next_dir if arch == "qwen3_next" else gpt_oss_dir, "triton")
    calls = {"gdn": 0, "rule": 0, "kv_written": 0}
    real_pre, real_rule, real_attend = next_decode.gdn_decode_pre, next_decode.gdn_decode_rule, DecodeAttention.attend

    def pre(*args, **kw):
        calls["gdn"] += 1
        return real_pre(*args, **kw)

    def rule(*args, **kw):
        calls["rule"] += 1
        return real_rule(*args, **kw)

    def attend(self, *args, kv_written=False, **kw):
        calls["kv_written"] += kv_written
        return real_attend(self, *args, kv_written=kv_written, **kw)
    monkeypatch.setattr(next_decode, "gdn_decode_pre", pre)
    monkeypatch.setattr(next_decode, "gdn_decode_rule", rule)
    monkeypatch.setattr(DecodeAttention, "attend", attend)
    (a, states_a, kv_a), (b, states_b, kv_b) = decode_logits(plain), decode_logits(fused)
    assert rel_err(b, a) < 1e-5
    assert rel_err(kv_b.k, kv_a.k) < 1e-5 and rel_err(kv_b.v, kv_a.v) < 1e-5
    if states_a is not None:
        assert rel_err(states_b.conv, states_a.conv) < 1e-5 and rel_err(states_b.recurrent, states_a.recurrent) < 1e-5
    cfg = fused.cfg
    linear = 0 if cfg.linear_attention is None else sum(t == "linear_attention" for t in cfg.layer_types)
    assert calls["gdn"] == calls["rule"] == linear                # the decode step's Gated DeltaNet kernels
    assert calls["kv_written"] == cfg.num_layers - linear         # and every attention layer's KV from its rope
    assert greedy(fused) == greedy(plain)


def test_qwen3_next_fused_forward_runs_one_projection_per_input(next_dir, monkeypatch):
    """fuse_next_projections: the router with the shared expert's gate and up, in_proj_qkvz with in_proj_ba, q with
    k and v are one weight each, whose parts are row views (no second copy), and a decode step runs four dense
    projections a layer (the fused input one, the output one, the MoE's fused one, the shared expert's down)."""
    plain, fused = models(next_dir, "reference")
    for mine, theirs in zip(fused.model.dense.layers, plain.model.dense.layers):
        for whole, parts in FUSED_PROJECTIONS.items():
            if getattr(theirs, parts[0]) is None:                 # the other attention kind's group
                assert getattr(mine, whole) is None
                continue
            w = getattr(mine, whole)
            assert torch.equal(w, torch.cat([getattr(theirs, p) for p in parts]))
            assert all(getattr(mine, p).untyped_storage().data_ptr() == w.untyped_storage().data_ptr() for p in parts)
        assert all(getattr(theirs, whole) is None for whole in FUSED_PROJECTIONS)
    shapes = []
    real = fused.model.linear

    def counting(h, w):
        if h.shape[0] == 2:                                       # the decode step of the two prompts
            shapes.append(tuple(w.shape))
        return real(h, w)
    monkeypatch.setattr(fused.model, "linear", counting)
    decode_logits(fused)
    assert len(shapes) == 4 * fused.cfg.num_layers, shapes


def test_qwen3_next_shared_expert_down_takes_the_gated_gemv(next_dir, monkeypatch, no_tf32):
    """With the decode GEMV on (dense_linear "gemv", the CUDA default), a decode step's shared expert runs its
    silu(gate) * up inside the down projection's GEMV (dense_gemv's up=), one call a layer, and the step's logits
    stay the plain forward's within the Triton tolerance."""
    from ftexpert.kernels import dense_gemv
    plain, fused = models(next_dir, "triton")
    fused.model.dense_linear = "gemv"
    gated = []
    real = dense_gemv.linear_gemv

    def spy(x, w, **kw):
        if kw.get("up") is not None:
            gated.append(x.shape[0])
        return real(x, w, **kw)
    monkeypatch.setattr(dense_gemv, "linear_gemv", spy)
    (a, _, _), (b, _, _) = decode_logits(plain), decode_logits(fused)
    assert rel_err(b, a) < 1e-5
    assert gated == [2] * fused.cfg.num_layers          # the decode step's two tokens, every layer; prefill: cuBLAS


@pytest.mark.parametrize("arch", ["qwen3_next", "gpt_oss"])
def test_decode_sums_the_routes_in_the_norm(arch, next_dir, gpt_oss_dir, monkeypatch, no_tf32):
    """With the resident backend's gemv mode (a decode step on CUDA), the MoE's routed output reaches the next
    add_rms_norm as per-route outputs [T, K, H] fp32, which it sums (no sum launch; gpt-oss's biased experts too);
    the step's logits stay the plain forward's within the Triton tolerance, and its tokens the plain forward's."""
    plain, fused = models(next_dir if arch == "qwen3_next" else gpt_oss_dir, "triton")
    fused.model.experts.mode, fused.model.experts.kernel_impl = "gemv", "triton"
    seen = []
    real = next_decode.add_rms_norm

    def spy(x, delta, *args, **kw):
        seen.append(delta.dim())
        return real(x, delta, *args, **kw)
    monkeypatch.setattr(next_decode, "add_rms_norm", spy)
    (a, _, _), (b, _, _) = decode_logits(plain), decode_logits(fused)
    assert rel_err(b, a) < 1e-5
    # the gemv mode forced: both prompts' prefills and the decode step, every layer (auto takes it for decode sizes)
    assert seen.count(3) == 3 * fused.cfg.num_layers
    assert greedy(fused) == greedy(plain)
