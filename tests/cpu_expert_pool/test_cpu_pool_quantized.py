"""The CPU expert kernel over quantized stores: the torch path computes the dequantized experts (bit for bit the
bf16 store of the same weights), in lockstep with the float32 reference; the compiled kernel refuses formats it
has no path for."""
from __future__ import annotations

import os
import uuid

import pytest
import torch

from ftexpert.cpu_expert_pool.expert_kernel import ExpertKernel, torch_moe_layer
from ftexpert.cpu_expert_pool.native.build import try_load_native
from ftexpert.cpu_expert_pool.reference import reference_moe_layer
from ftexpert.proto.expert_format import ExpertFormat, FormatError
from ftexpert.kernels.expert_reference import dequantize_expert, quantize_expert
from ftexpert.proto.expert_store import ExpertStore

H, I, E = 128, 64, 5
FORMATS = ("fp8", "int4-g32", "int4-g64", "mxfp4", "nvfp4")
TOL = 4 * 2.0 ** -8                  # the torch path rounds x, h and the GEMM outputs to bf16


def stores(label: str):
    """(a quantized store of random experts, a bf16 store of the same experts dequantized)."""
    fmt = ExpertFormat.parse(label)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    q = ExpertStore.create(f"ft-test-q-{tag}", num_layers=1, num_experts=E, hidden=H, intermediate=I,
                           dtype=torch.bfloat16, config_hash="q", fmt=label)
    d = ExpertStore.create(f"ft-test-d-{tag}", num_layers=1, num_experts=E, hidden=H, intermediate=I,
                           dtype=torch.bfloat16, config_hash="d")
    g = torch.Generator().manual_seed(3)
    for e in range(E):
        quantize_expert(torch.randn(I, H, generator=g) / H ** 0.5, torch.randn(I, H, generator=g) / H ** 0.5,
                        torch.randn(H, I, generator=g) / I ** 0.5, fmt, out=q.expert_bytes_view(0, e))
        gate, up, down = dequantize_expert(q.expert_bytes_view(0, e), q.shape.quant_layout)
        d.write_expert(0, e, gate=gate.to(torch.bfloat16), up=up.to(torch.bfloat16), down=down.to(torch.bfloat16))
    return q, d


@pytest.mark.parametrize("label", FORMATS)
def test_the_torch_kernel_computes_the_dequantized_experts(label):
    q, d = stores(label)
    try:
        g = torch.Generator().manual_seed(4)
        hidden = torch.randn(4, H, generator=g).to(torch.bfloat16)
        token_idx = torch.tensor([0, 0, 1, 2, 3, 3], dtype=torch.int32)
        expert_id = torch.tensor([1, 4, 1, 0, 2, 3], dtype=torch.int32)
        weight = torch.rand(6, generator=g)
        out_q, out_d = torch.empty(4, H), torch.empty(4, H)
        stats = torch_moe_layer(q, 0, hidden, token_idx, expert_id, weight, out_q)
        torch_moe_layer(d, 0, hidden, token_idx, expert_id, weight, out_d)
        assert torch.equal(out_q, out_d) and stats.num_experts == 5
        ref = reference_moe_layer(q, 0, hidden, token_idx, expert_id, weight)
        assert float((out_q - ref).abs().max() / ref.abs().max()) < TOL
        split = torch.empty(4, H)                   # a split expert: a prefix of its channels
        torch_moe_layer(q, 0, hidden, token_idx, expert_id, weight, split, split_expert=1, split_limit=32)
        want = torch.empty(4, H)
        torch_moe_layer(d, 0, hidden, token_idx, expert_id, weight, want, split_expert=1, split_limit=32)
        assert torch.equal(split, want)
    finally:
        for s in (q, d):
            s.close()
            s.unlink()


def test_every_format_gets_the_compiled_kernel_and_torch_on_request():
    q, d = stores("nvfp4")
    try:
        assert ExpertKernel(q, kernel="torch").name == "torch"
        native, why = try_load_native()
        if native is None:
            pytest.skip(f"no compiled kernel here: {why}")
        assert ExpertKernel(q, kernel="auto").name.startswith("native-")
        with pytest.raises(ValueError, match="avx512_bf16"):             # no bf16-dot path for fp32 weights
            ExpertKernel(q, kernel="native-avx512_bf16")
    finally:
        for s in (q, d):
            s.close()
            s.unlink()
