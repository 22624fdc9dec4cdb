"""Compile every decode kernel for an NVIDIA target without a GPU: Triton's front end, MLIR passes,
LLVM and ptxas (bundled with the triton wheel) run as on the GPU machine, so code that only the
interpreter accepts (e.g. an op that does not broadcast when compiled) fails here, on a CPU.

    python -m ftexpert.kernels.moe_decode.compile_check [--arch 90] [--resources]

Exit status 0 when everything compiled; prints SKIP and exits 0 when this triton cannot compile
ahead of time (no ASTSource / GPUTarget of this shape, or TRITON_INTERPRET=1 in the environment).
--resources adds registers / spills per kernel (cuobjdump), with 16-byte alignment hints on the
pointer and size arguments, as the JIT gives them at launch on aligned tensors.
"""
from __future__ import annotations

import sys

from ftexpert.kernels.compile_driver import run_compile_check
from ftexpert.kernels.moe_decode import triton_kernels


def _cases() -> list[tuple[str, str, dict, dict, dict, list[str]]]:
    """(name, kernel attribute, signature, constexprs, options, 16-divisible args)."""
    dt = "bf16"
    gate_up_sig = {"x_ptr": f"*{dt}", "ids_ptr": "*i64", "w13_ptr": f"*{dt}", "act_ptr": f"*{dt}",
                   "plan_ptr": "*i32", "nplan_ptr": "*i32", "extra_slot": "i32", "K": "i32", "H": "i32", "I": "i32", "stride_xt": "i32", "stride_we": "i64",
                   "stride_wn": "i32", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                   "EVEN_N": "constexpr", "EVEN_K": "constexpr",
                   "ACCURATE": "constexpr", "PLAN": "constexpr", "PLAN_MAX": "constexpr"}
    gate_up_div = ["x_ptr", "ids_ptr", "w13_ptr", "act_ptr", "H", "I", "stride_xt", "stride_we", "stride_wn"]
    down_sig = {"act_ptr": f"*{dt}", "ids_ptr": "*i32", "rw_ptr": "*fp32", "w2_ptr": f"*{dt}",
                "y_ptr": "*fp32", "plan_ptr": "*i32", "nplan_ptr": "*i32", "extra_slot": "i32", "H": "i32", "I": "i32", "stride_we": "i64", "stride_wn": "i32",
                "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "EVEN_N": "constexpr",
                "EVEN_K": "constexpr", "PLAN": "constexpr", "PLAN_MAX": "constexpr"}
    down_div = ["act_ptr", "ids_ptr", "rw_ptr", "w2_ptr", "y_ptr", "H", "I", "stride_we", "stride_wn"]
    norm_sig = {"x_ptr": f"*{dt}", "d_ptr": f"*{dt}", "w_ptr": f"*{dt}", "xo_ptr": f"*{dt}",
                "no_ptr": f"*{dt}", "R2": "i32", "N": "i32", "sx1": "i32", "sx2": "i32", "sd1": "i32",
                "sd2": "i32", "eps": "fp32", "inv_n": "fp32", "HAS_ADD": "constexpr",
                "BLOCK": "constexpr", "ACCURATE": "constexpr"}
    rope_sig = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "qo_ptr": f"*{dt}", "ko_ptr": f"*{dt}",
                "qw_ptr": f"*{dt}", "kw_ptr": f"*{dt}", "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}",
                "HQ": "i32", "HKV": "i32", "D": "i32", "sqt": "i32", "sqh": "i32", "skt": "i32",
                "skh": "i32", "sct": "i32", "sst": "i32", "eps": "fp32", "inv_d": "fp32",
                "kc_ptr": f"*{dt}", "vc_ptr": f"*{dt}", "v_ptr": f"*{dt}", "idx_ptr": "*i64", "svt": "i32",
                "svh": "i32", "HAS_NORM": "constexpr", "BLOCK_D": "constexpr", "ACCURATE": "constexpr",
                "HAS_KV": "constexpr"}
    route_sig = {"logits_ptr": f"*{dt}", "ids_ptr": "*i64", "w_ptr": "*fp32", "E": "i32",
                 "stride_t": "i32", "K": "constexpr", "BLOCK_E": "constexpr", "BLOCK_K": "constexpr",
                 "SOFTMAX_FIRST": "constexpr", "RENORM": "constexpr", "ACCURATE": "constexpr"}
    w4, w1 = {"num_warps": 4}, {"num_warps": 1}
    whole = dict(PLAN=0, PLAN_MAX=1)          # an unsplit call (moe_gemv without a CopyPlan)
    return [
        ("gate_up 4x512 even (the default)", "moe_gate_up_kernel", gate_up_sig,
         dict(BLOCK_N=4, BLOCK_K=512, EVEN_N=True, EVEN_K=True, ACCURATE=True, **whole),
         w4, gate_up_div),
        ("gate_up 4x512 split: routes in the plan", "moe_gate_up_kernel", gate_up_sig,
         dict(BLOCK_N=4, BLOCK_K=512, EVEN_N=True, EVEN_K=True, ACCURATE=True, PLAN=2, PLAN_MAX=8),
         w4, gate_up_div),
        ("gate_up 16x256 ragged", "moe_gate_up_kernel", gate_up_sig,
         dict(BLOCK_N=16, BLOCK_K=256, EVEN_N=False, EVEN_K=False, ACCURATE=True, **whole),
         w4, gate_up_div),
        ("gate_up split: routes off the plan", "moe_gate_up_kernel", gate_up_sig,
         dict(BLOCK_N=16, BLOCK_K=256, EVEN_N=True, EVEN_K=True, ACCURATE=True, PLAN=1, PLAN_MAX=8),
         w4, gate_up_div),
        ("down 16x256 even (the default)", "moe_down_kernel", down_sig,
         dict(BLOCK_N=16, BLOCK_K=256, EVEN_N=True, EVEN_K=True, **whole), w4, down_div),
        ("down 16x256 ragged", "moe_down_kernel", down_sig,
         dict(BLOCK_N=16, BLOCK_K=256, EVEN_N=False, EVEN_K=False, **whole), w4, down_div),
        ("down split: routes in the plan", "moe_down_kernel", down_sig,
         dict(BLOCK_N=16, BLOCK_K=256, EVEN_N=True, EVEN_K=True, PLAN=2, PLAN_MAX=8), w4, down_div),
        ("sum over k", "moe_sum_k_kernel", {"y_ptr": "*fp32", "out_ptr": f"*{dt}", "K": "i32", "H": "i32",
                                            "BLOCK": "constexpr"}, dict(BLOCK=1024), w4, []),
        ("add + rms_norm", "rms_norm_kernel", norm_sig, dict(HAS_ADD=True, BLOCK=2048, ACCURATE=True), w4, []),
        ("add of the routes' sum (per-route outputs) + rms_norm", "rms_norm_kernel",
         {**norm_sig, "d_ptr": "*fp32", "n_routes": "i32", "PARTS": "constexpr"},
         dict(HAS_ADD=True, BLOCK=2048, ACCURATE=True, PARTS=True), w4, []),
        ("rms_norm", "rms_norm_kernel", norm_sig, dict(HAS_ADD=False, BLOCK=128, ACCURATE=True), w1, []),
        ("q/k norm + rope", "qk_norm_rope_kernel", rope_sig,
         dict(HAS_NORM=True, BLOCK_D=128, ACCURATE=True, HAS_KV=False), {"num_warps": 1, "enable_fp_fusion": False}, []),
        ("q/k norm + rope + KV write", "qk_norm_rope_kernel", rope_sig,
         dict(HAS_NORM=True, BLOCK_D=128, ACCURATE=True, HAS_KV=True), {"num_warps": 1, "enable_fp_fusion": False}, []),
        ("rope", "qk_norm_rope_kernel", rope_sig, dict(HAS_NORM=False, BLOCK_D=128, ACCURATE=True, HAS_KV=False),
         {"num_warps": 1, "enable_fp_fusion": False}, []),
        ("route softmax/top-k/renorm", "route_topk_kernel", route_sig,
         dict(K=8, BLOCK_E=128, BLOCK_K=8, SOFTMAX_FIRST=True, RENORM=True, ACCURATE=True), w1, []),
        ("route top-k/softmax (mixtral)", "route_topk_kernel", route_sig,
         dict(K=2, BLOCK_E=8, BLOCK_K=2, SOFTMAX_FIRST=False, RENORM=False, ACCURATE=True), w1, []),
        ("route 512 top-10, weights rounded (qwen3-next)", "route_topk_kernel", route_sig,
         dict(K=10, BLOCK_E=512, BLOCK_K=16, SOFTMAX_FIRST=True, RENORM=True, ACCURATE=True, ROUND=True),
         {"num_warps": 2}, []),
        ("route 128 top-4 top-k/softmax rounded (gpt-oss)", "route_topk_kernel", route_sig,
         dict(K=4, BLOCK_E=128, BLOCK_K=4, SOFTMAX_FIRST=False, RENORM=False, ACCURATE=True, ROUND=True), w1, []),
    ]


def main(argv: list[str] | None = None) -> int:
    return run_compile_check("compile the decode kernels for an NVIDIA target", _cases(), triton_kernels, argv)


if __name__ == "__main__":
    sys.exit(main())
