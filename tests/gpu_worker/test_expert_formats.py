"""--expert-format end to end on the CPU: quantize at load, the layout and the store in the format, `offload`
lossless against `resident` in the same format, resident equal to a model holding the dequantized experts."""
from __future__ import annotations

import json

import pytest
import torch

from ftexpert.coordinator.cli import main
from ftexpert.gpu_worker.engine import SamplingParams
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, expert_views, unpack_experts
from ftexpert.gpu_worker.checkpoint.format_sources import DequantizingExpertSource, QuantizingExpertSource
from ftexpert.gpu_worker.assembly.loader import open_model_source
from ftexpert.gpu_worker.backends.resident import ResidentExperts
from ftexpert.gpu_worker.backends.offload import HostExperts
from ftexpert.gpu_worker.backends.offload.host_store import layout_hash
from ftexpert.proto.expert_format import ExpertFormat, FormatError, QuantLayout
from ftexpert.kernels.expert_reference import dequantize_expert, quantize_expert
from tests.built_engines import build, build_with_resources, engine_of

TINY_FORMATS = ("fp8", "int4-g32", "int4-g64", "mxfp4", "nvfp4")   # the tiny model: H = I = 64
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64, 11, 300, 8]
LONG = [(7 * i + 3) % 300 for i in range(40)]


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("FT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tiny-cache"))


def greedy(built, prompts=(PROMPT, LONG), n: int = 16, chunk: int = 32, experts=None) -> list[list[int]]:
    """`built`'s greedy tokens (`experts`: over that backend instead)."""
    engine = engine_of(built, max_running_requests=2, max_context_tokens=128, prefill_chunk_tokens=chunk,
                       experts=experts)
    return engine.generate([list(p) for p in prompts], SamplingParams(max_new_tokens=n, ignore_eos=True))


class Bitwise:
    """A backend whose every forward is compared bit for bit with a reference backend's on the same inputs."""

    def __init__(self, backend, reference):
        self.backend, self.reference, self.calls, self.differ = backend, reference, 0, []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, layer_idx, x, topk_ids, topk_weights, partials=False):
        # the sums are compared: a fused forward's request for per-route outputs is not passed on (either is valid)
        out = self.backend.forward(layer_idx, x, topk_ids, topk_weights)
        ref = self.reference.forward(layer_idx, x, topk_ids, topk_weights)
        self.calls += 1
        if not torch.equal(out, ref):
            self.differ.append((layer_idx, tuple(x.shape)))
        return out


def float_layers(source) -> list[torch.Tensor]:
    """The checkpoint's experts, packed [E, N] per layer in the model dtype."""
    layers = []
    for layer in range(source.num_layers):
        out = source.layout.empty_layer(source.num_experts)
        source.fill_layer(layer, out)
        layers.append(out)
    return layers


def test_the_layout_holds_a_quantized_expert_as_its_bytes():
    lay = ExpertLayout(256, 128, torch.bfloat16, ExpertFormat.parse("int4"))
    q = QuantLayout(256, 128, ExpertFormat.parse("int4"))
    assert lay.storage_dtype == torch.uint8 and lay.expert_numel == lay.expert_nbytes == q.expert_nbytes
    assert lay.empty_layer(3).dtype == torch.uint8 and lay.dtype == torch.bfloat16
    with pytest.raises(FormatError, match="expert_math"):
        unpack_experts(lay.empty_layer(3), lay)
    with pytest.raises(FormatError, match="does not divide the hidden size 64"):
        ExpertLayout(64, 64, torch.float32, ExpertFormat.parse("int4"))     # groups of 128


@pytest.mark.parametrize("label", TINY_FORMATS)
def test_quantize_at_load_writes_quantize_expert_of_the_checkpoint_weights(label):
    float_src = open_model_source(expert_format="bf16").experts
    src = open_model_source(expert_format=label).experts
    assert isinstance(src, QuantizingExpertSource) and src.layout.fmt.label == label
    fmt = ExpertFormat.parse(label)
    host = HostExperts.create_filled(src, pin=False)
    try:
        assert host.store.expert_format == fmt and host.store.config_hash == layout_hash(src)
        for layer, packed in enumerate(float_layers(float_src)):
            for e in range(src.num_experts):
                want = quantize_expert(*expert_views(packed[e], float_src.layout), fmt)
                assert torch.equal(host.layers[layer][e], want), f"layer {layer} expert {e}"
    finally:
        host.close()


def test_bf16_from_a_quantized_source_is_its_dequantized_weights():
    quant = open_model_source(expert_format="nvfp4").experts
    src = DequantizingExpertSource(quant, torch.float32, progress=False)
    qbytes = quant.layout.empty_layer(quant.num_experts)
    quant.fill_layer(1, qbytes)
    out = src.layout.empty_layer(src.num_experts)
    src.fill_layer(1, out)
    for e in range(src.num_experts):
        for got, want in zip(expert_views(out[e], src.layout), dequantize_expert(qbytes[e], quant.layout.quant_layout)):
            assert torch.equal(got, want)
    with pytest.raises(FormatError, match="round twice"):
        QuantizingExpertSource(quant, ExpertFormat("fp8"))


@pytest.mark.parametrize("label, mode", [*((f, "auto") for f in TINY_FORMATS), ("int4-g64", "gemv"),
                                         ("nvfp4", "gemv")])
def test_offload_is_lossless_against_resident_in_the_same_format(label, mode):
    """auto: grouped on the CPU (the distinct routed rows dequantized); gemv: moe_gemv_quant (decode copy path)."""
    resident = build(expert_format=label, expert_compute=mode, max_context_tokens=128)
    loaded = build(moe_strategy="offload", moe_cache_size=12, expert_format=label, expert_compute=mode,
                   max_context_tokens=128)
    backend = loaded.experts
    assert backend.slots.dtype == torch.uint8 and backend.layout.fmt.label == label
    bitwise = Bitwise(backend, resident.experts)
    try:
        assert greedy(loaded, experts=bitwise) == greedy(resident)
        assert bitwise.calls > 0 and not bitwise.differ
        stats = backend.refresh_stats()
        assert stats.fetched > backend.cache.total_slots        # evicted and fetched again: the copies ran
        assert stats.copy_bytes == stats.fetched * QuantLayout(64, 64, ExpertFormat.parse(label)).expert_nbytes
        assert backend.audit_slots(sample_slots=backend.cache.total_slots) == []
    finally:
        backend.close()


def dequantized_resident(label: str, device: str = "cpu"):
    """The tiny model (bf16 experts) and a resident backend of its experts' quantized-then-dequantized weights (model
    dtype), to run it over."""
    loaded = build(device=device, expert_format="bf16", max_context_tokens=128)
    quant = open_model_source(expert_format=label).experts
    qlay = quant.layout.quant_layout
    packed = []
    for layer in range(quant.num_layers):
        qbytes = quant.layout.empty_layer(quant.num_experts)
        quant.fill_layer(layer, qbytes)
        out = loaded.model.experts.layout.empty_layer(quant.num_experts)
        for e in range(quant.num_experts):
            for view, w in zip(expert_views(out[e], loaded.model.experts.layout), dequantize_expert(qbytes[e], qlay)):
                view.copy_(w)
        packed.append(out)
    return loaded, ResidentExperts(packed, loaded.model.experts.layout)


@pytest.mark.parametrize("label", ["int4-g32", "nvfp4"])
def test_resident_quantized_is_the_model_with_dequantized_experts(label):
    quantized = build(expert_format=label, max_context_tokens=128)
    reference, dequantized = dequantized_resident(label)
    bitwise = Bitwise(quantized.experts, dequantized)
    assert greedy(quantized, experts=bitwise) == greedy(reference, experts=dequantized)
    assert bitwise.calls > 0 and not bitwise.differ


def test_ft_generate_int4_gives_the_tokens_of_the_dequantized_model(capsys):
    assert main(["generate", "--preset", "tiny", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12",
                 "--expert-format", "int4-g32", "--moe-strategy", "offload", "--moe-cache-size", "12",
                 "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["expert_format"] == "int4-g32"
    reference, dequantized = dequantized_resident("int4-g32")
    want = greedy(reference, prompts=(PROMPT,), n=12, chunk=4096, experts=dequantized)[0]
    assert result["token_ids"] == want


def test_a_format_the_shape_cannot_hold_is_refused_before_loading(capsys):
    assert main(["generate", "--preset", "tiny", "--prompt-ids", "1,2", "--expert-format", "int4", "--device", "cpu"]) != 0
    assert "int4-g128: group size 128 does not divide the hidden size 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):                   # argparse: not a format
        main(["generate", "--prompt-ids", "1,2", "--expert-format", "int3", "--device", "cpu"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_a_store_of_another_format_is_refused_on_attach():
    src = open_model_source(expert_format="fp8").experts
    host = HostExperts.create_filled(src, pin=False)
    try:
        with pytest.raises(ValueError, match="same --expert-format"):
            HostExperts.attach(host.store.name, src.layout.with_format("nvfp4"))
        bf16 = open_model_source(expert_format="bf16").experts
        assert layout_hash(bf16) != layout_hash(src) != layout_hash(open_model_source(expert_format="mxfp4").experts)
    finally:
        host.close()


@pytest.mark.parametrize("act_quant, bound", [("fp32", 1e-5), ("auto", 3e-2)])
def test_hybrid_on_the_cpu_gives_the_resident_tokens_in_a_quantized_format(act_quant, bound):
    """The CPU workers compute their share from the quantized store, the GPU side from its quantized slots; with fp32
    activations on the CPU the sums agree with resident's to fp32 rounding, with the default (int8 activations where
    the CPU has AVX-512 VNNI: docs/QUANTIZATION.md) within its stated 3% bound; the tokens are resident's."""
    from ftexpert.gpu_worker.backends.hybrid import HybridOptions

    label = "int4-g32"
    resident = build(expert_format=label, max_context_tokens=128)
    loaded = build_with_resources("hybrid", cache_size=12, expert_format=label, max_context_tokens=128,
                                  worker_args=("--threads", "1", "--no-pin", "--hot-ms", "1",
                                               "--act-quant", act_quant),
                                  hybrid=HybridOptions(fetch_fraction=0.5, cpu_deadline_s=20.0))
    backend = loaded.experts
    assert backend.host.store.expert_format.label == label and not backend.splits_experts
    diffs = []
    forward = backend.forward

    def checked(layer_idx, x, topk_ids, topk_weights, partials=False):    # (hybrid returns the sum)
        out = forward(layer_idx, x, topk_ids, topk_weights)
        ref = resident.experts.forward(layer_idx, x, topk_ids, topk_weights)
        diffs.append(float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
        return out

    backend.forward = checked
    try:
        assert greedy(loaded, n=12, chunk=4) == greedy(resident, n=12, chunk=4)
        counters = backend.counters()
        assert counters["cpu_triples_total"] > 0 and counters["experts_fetched_total"] > 0
        assert counters["fallbacks_total"] == 0 and diffs and max(diffs) < bound
    finally:
        backend.close()
