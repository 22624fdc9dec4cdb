"""The one seam between the expert backends and the expert math: the FFN over a set of packed rows in one format.

`expert_rows(rows, layout)` -> an `ExpertRows` over ``rows: [S, N]`` (a layer of experts, or a GPU slot pool) in
``layout.fmt``; every backend (`resident`, `offload`, `hybrid`, the decode copy) computes through its ``ffn``:

    ffn(mode, x [T, H], ids [T, K], weights [T, K], *, kernel_impl, plan, between, between_down) -> [T, H]

with ``mode`` resolved by `pick_mode` (gemv | grouped) and the semantics of
expert_compute.expert_ffn / kernels.moe_decode.moe_gemv (a route at -1 adds exactly 0 in the gemv mode;
``plan`` / ``between`` / ``between_down``: the copy running beside it, gemv only).

- bf16 (`Bf16Rows`): w13 / w2 views of the rows and the existing kernels (moe_gemv, the grouped GEMMs).
- quantized (`QuantRows`): gemv -> ``moe_gemv_quant(x, ids, weights, rows_u8, layout, impl=..., plan=...,
  between=..., between_down=...)``; grouped (prefill) -> the distinct routed rows dequantized by
  ``dequantize_rows(rows_u8, ids, layout, out_dtype)`` to x.dtype, then the grouped GEMMs over them (a host sync:
  the distinct ids: the quantized grouped mode is never captured; the bf16 one is where `grouped_capturable`).

Biased experts with gpt-oss's clamped SwiGLU (``layout.act``, proto/expert_act.py): bf16 gemv -> moe_gemv with the
rows' bias tails and the activation (``b13=, b2=, act=``), quantized gemv -> moe_gemv_quant likewise; the grouped
mode -> `act_expert_ffn`:
the distinct routed experts' rows (dequantized where quantized) and their biases, one expert at a time (a host
sync: the distinct ids).

The two quantized kernels are kernels/moe_decode/quant.py's: Triton on CUDA (decode dequantizes in registers,
prefill dequantizes the distinct routed rows in one launch), their plain-torch reference elsewhere. A format a path has no kernel for is refused here (`check_supported`), naming the path and the format.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ftexpert.kernels.moe_decode import CopyPlan, moe_gemv
from ftexpert.kernels.moe_decode.quant import dequantize_rows, moe_gemv_quant
from ftexpert.proto.expert_act import ExpertAct
from ftexpert.kernels.expert_reference import apply_act
from ftexpert.proto.expert_format import FormatError

from ftexpert.gpu_worker.backends.expert_compute import expert_ffn, grouped_capturable, grouped_expert_ffn
from ftexpert.gpu_worker.checkpoint.expert_layout import ExpertLayout, bias_views, unpack_experts

# Formats each path computes (a fast kernel that lacks a format narrows its entry; the references take all).
SUPPORTED_FORMATS: dict[str, tuple[str, ...]] = {
    "gemv": ("bf16", "fp8", "int4", "mxfp4", "nvfp4"),
    "grouped": ("bf16", "fp8", "int4", "mxfp4", "nvfp4"),
}


def check_supported(layout: ExpertLayout, path: str) -> None:
    """Raise FormatError when the ``path`` (gemv: decode, grouped: prefill) has no kernel for the layout's format."""
    if layout.fmt.name not in SUPPORTED_FORMATS[path]:
        raise FormatError(f"the {path} expert path has no kernel for {layout.fmt.label} experts (it computes "
                          f"{', '.join(SUPPORTED_FORMATS[path])}); serve another --expert-format")


class ExpertRows:
    """The expert FFN over packed rows [S, N] of one format (see the module docstring)."""

    rows: torch.Tensor
    layout: ExpertLayout

    def ffn(self, mode: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, kernel_impl: str = "auto",
            plan: CopyPlan | None = None, between: Callable[[], None] | None = None,
            between_down: Callable[[], None] | None = None, partials: bool = False) -> torch.Tensor:
        """-> [T, H]; with partials, the gemv mode's weighted per-route outputs [T, K, H] fp32 instead (the other
        paths still give the sum: ExpertBackend.forward)."""
        raise NotImplementedError

    @property
    def grouped_capturable(self) -> bool:
        """Whether the grouped mode over these rows makes no host sync and has fixed shapes (CUDA-graph capturable)."""
        return False

    @property
    def w13_bytes(self) -> int:
        """Bytes at the start of a row that hold everything gate/up reads (0: not a prefix of the row), so that a
        copy in two parts can release the gate/up GEMMs after the first (DecodeCopy's split)."""
        return 0


def _run_hooks(between: Callable[[], None] | None, between_down: Callable[[], None] | None) -> None:
    if between is not None:
        between()
    if between_down is not None:
        between_down()


def act_expert_ffn(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   b13: torch.Tensor, b2: torch.Tensor, act: ExpertAct) -> torch.Tensor:
    """sum_k w_k * (W2_e act(W13_e x + b13_e) + b2_e) with e = ids[t, k] (a route at -1 adds exactly 0).

    x [T, H]; ids / weights [T, K]; w13 [n, 2I, H], w2 [n, H, I], b13 [n, 2I], b2 [n, H] indexed by ids. Rounds
    as transformers' GptOssExperts does (each linear and the activation in x.dtype); the sum over k in fp32."""
    T, K = ids.shape
    flat, wflat = ids.reshape(-1), weights.reshape(-1)
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(flat[flat >= 0]).tolist():
        pos = (flat == e).nonzero().squeeze(1)                          # routes to expert e
        tok = pos // K
        h = apply_act(F.linear(x[tok], w13[e], b13[e]), act)           # [n_e, I]
        y = F.linear(h, w2[e], b2[e])                                   # [n_e, H]
        out.index_add_(0, tok, y.float() * wflat[pos, None].float())
    return out.to(x.dtype)


def _routed(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct routed ids >= 0, ids renumbered into them; -1 stays -1)."""
    flat = ids.reshape(-1).to(torch.int64)
    distinct = torch.unique(flat[flat >= 0])
    local = torch.searchsorted(distinct, flat.clamp(min=0))
    return distinct, torch.where(flat >= 0, local, -1).view(ids.shape)


class Bf16Rows(ExpertRows):
    """Rows in the model dtype: w13 [S, 2I, H] and w2 [S, H, I] views (no copy)."""

    def __init__(self, rows: torch.Tensor, layout: ExpertLayout):
        self.rows, self.layout = rows, layout
        self.w13, self.w2 = unpack_experts(rows, layout)

    @property
    def grouped_capturable(self) -> bool:
        # biased experts take act_expert_ffn (a sync for the distinct ids); else expert_compute's rule
        return not self.layout.act.bias and grouped_capturable(self.w13, self.w2, self.layout.dtype)

    @property
    def w13_bytes(self) -> int:
        if self.layout.act.bias:        # gate/up's biases sit at the row's end: the copy is one part
            return 0
        return self.layout.w13_numel * self.rows.element_size()

    def ffn(self, mode, x, ids, weights, *, kernel_impl="auto", plan=None, between=None, between_down=None,
            partials=False):
        if self.layout.act.bias:
            b13, b2 = bias_views(self.rows, self.layout)
            if mode == "gemv":                          # kernels/moe_decode's gemv takes the biases and act
                return moe_gemv(x, ids, weights, self.w13, self.w2, impl=kernel_impl, plan=plan, between=between,
                                between_down=between_down, b13=b13, b2=b2, act=self.layout.act, partials=partials)
            _run_hooks(between, between_down)
            return act_expert_ffn(x, ids, weights, self.w13, self.w2, b13, b2, self.layout.act)
        if mode == "gemv" and (plan is not None or between is not None or partials):
            return moe_gemv(x, ids, weights, self.w13, self.w2, impl=kernel_impl, plan=plan, between=between,
                            between_down=between_down, partials=partials)
        _run_hooks(between, between_down)
        return expert_ffn(mode, x, ids, weights, self.w13, self.w2, kernel_impl=kernel_impl)


class QuantRows(ExpertRows):
    """Rows of quantized experts (uint8, proto/expert_format.py's byte layout)."""

    def __init__(self, rows: torch.Tensor, layout: ExpertLayout):
        layout.check(rows)
        self.rows, self.layout, self.quant = rows, layout, layout.quant_layout

    def ffn(self, mode, x, ids, weights, *, kernel_impl="auto", plan=None, between=None, between_down=None,
            partials=False):
        if x.dtype != self.layout.dtype:
            raise TypeError(f"x is {x.dtype}; these {self.layout.fmt.label} experts dequantize to {self.layout.dtype}")
        check_supported(self.layout, mode)
        if self.layout.act.bias and mode == "gemv":     # the quantized gemv takes the biases and act too
            b13, b2 = bias_views(self.rows, self.layout)
            return moe_gemv_quant(x, ids, weights, self.rows, self.quant, impl=kernel_impl, plan=plan,
                                  between=between, between_down=between_down, b13=b13, b2=b2, act=self.layout.act,
                                  partials=partials)
        if self.layout.act.bias:
            _run_hooks(between, between_down)
            distinct, local = _routed(ids)
            w13, w2 = dequantize_rows(self.rows, distinct, self.quant, x.dtype)       # [n, 2I, H], [n, H, I]
            b13, b2 = bias_views(self.rows, self.layout)
            return act_expert_ffn(x, local, weights, w13, w2, b13[distinct], b2[distinct], self.layout.act)
        if mode == "gemv":
            return moe_gemv_quant(x, ids, weights, self.rows, self.quant, impl=kernel_impl, plan=plan,
                                  between=between, between_down=between_down, partials=partials)
        _run_hooks(between, between_down)
        distinct, local = torch.unique(ids.reshape(-1).to(torch.int64), return_inverse=True)   # sorted: same groups
        w13, w2 = dequantize_rows(self.rows, distinct, self.quant, x.dtype)          # [n, 2I, H], [n, H, I]
        return grouped_expert_ffn(x, local.view(ids.shape), weights, w13, w2)


def expert_rows(rows: torch.Tensor, layout: ExpertLayout) -> ExpertRows:
    """The `ExpertRows` of ``rows`` [S, N] in ``layout.fmt``."""
    return QuantRows(rows, layout) if layout.quantized else Bf16Rows(rows, layout)
