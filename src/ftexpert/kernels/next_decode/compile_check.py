"""Compile every Qwen3-Next / gpt-oss decode kernel for an NVIDIA target without a GPU (kernels/compile_driver.py:
Triton's front end, MLIR, LLVM and ptxas), at the real models' block sizes, bf16.

    python -m ftexpert.kernels.next_decode.compile_check [--arch 90] [--resources]
"""
from __future__ import annotations

import sys

from ftexpert.kernels.compile_driver import run_compile_check
from ftexpert.kernels.next_decode import triton_kernels

ACC = dict(ACCURATE=True, EMU_BF16=False)
OPTS = {"enable_fp_fusion": False}


def _sig(names: str, types: dict[str, str], default: str = "i32") -> dict[str, str]:
    return {n: types.get(n, default) for n in names.split()}


def _cases() -> list[tuple[str, str, dict, dict, dict, list[str]]]:
    b = "*bf16"
    norm = _sig("x_ptr sx d_ptr sd s_ptr ss h_ptr sh gw_ptr w_ptr xo_ptr no_ptr N eps inv_n offset HAS_ADD SHARED BLOCK "
                "ACCURATE EMU_BF16", {**dict.fromkeys("x_ptr d_ptr s_ptr h_ptr gw_ptr w_ptr xo_ptr no_ptr".split(), b),
                                      **dict.fromkeys("eps inv_n offset".split(), "fp32"),
                                      **dict.fromkeys("HAS_ADD SHARED BLOCK ACCURATE EMU_BF16".split(), "constexpr")})
    parts = _sig("x_ptr sx d_ptr sd s_ptr ss h_ptr sh gw_ptr w_ptr xo_ptr no_ptr N eps inv_n offset HAS_ADD SHARED BLOCK "
                 "ACCURATE EMU_BF16 n_routes PARTS",
                 {**dict.fromkeys("x_ptr s_ptr h_ptr gw_ptr w_ptr xo_ptr no_ptr".split(), b), "d_ptr": "*fp32",
                  **dict.fromkeys("eps inv_n offset".split(), "fp32"),
                  **dict.fromkeys("HAS_ADD SHARED BLOCK ACCURATE EMU_BF16 PARTS".split(), "constexpr")})
    pre = _sig("qkvz_ptr s_qkvz ba_ptr s_ba cache_ptr s_row s_c rows_ptr w_ptr alog_ptr dtb_ptr q_ptr k_ptr v_ptr g_ptr "
               "beta_ptr Hk Hv Dk Dv R K BLOCK_DK BLOCK_V BLOCK_R ACCURATE EMU_BF16",
               {**dict.fromkeys("qkvz_ptr ba_ptr cache_ptr w_ptr q_ptr k_ptr v_ptr beta_ptr".split(), b),
                "rows_ptr": "*i64", "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "g_ptr": "*fp32", "s_row": "i64",
                **dict.fromkeys("K BLOCK_DK BLOCK_V BLOCK_R ACCURATE EMU_BF16".split(), "constexpr")})
    rule = _sig("q_ptr sq_t sq_h k_ptr sk_t sk_h v_ptr sv_t sv_h g_ptr beta_ptr state_ptr s_row s_h s_k rows_ptr o_ptr "
                "Hv Dk Dv G scale eps BLOCK_K BLOCK_V ACCURATE EMU_BF16",
                {**dict.fromkeys("q_ptr k_ptr v_ptr beta_ptr o_ptr".split(), b), "g_ptr": "*fp32",
                 "state_ptr": "*fp32", "rows_ptr": "*i64", "s_row": "i64", "scale": "fp32", "eps": "fp32",
                 **dict.fromkeys("BLOCK_K BLOCK_V ACCURATE EMU_BF16".split(), "constexpr")})
    gnorm = _sig("o_ptr so_t so_h z_ptr sz_t sz_g sz_r w_ptr out_ptr Hv R Dv eps inv_d BLOCK_D ACCURATE EMU_BF16",
                 {**dict.fromkeys("o_ptr z_ptr w_ptr out_ptr".split(), b), "eps": "fp32", "inv_d": "fp32",
                  **dict.fromkeys("BLOCK_D ACCURATE EMU_BF16".split(), "constexpr")})
    rope = _sig("q_ptr k_ptr qo_ptr ko_ptr qw_ptr kw_ptr cos_ptr sin_ptr HQ HKV D RD sqt sqh skt skh sct sst eps inv_d "
                "offset kc_ptr vc_ptr v_ptr idx_ptr svt svh BLOCK_D ACCURATE EMU_BF16 HAS_KV",
                {**dict.fromkeys("q_ptr k_ptr qo_ptr ko_ptr qw_ptr kw_ptr cos_ptr sin_ptr kc_ptr vc_ptr v_ptr".split(), b),
                 "idx_ptr": "*i64", **dict.fromkeys("eps inv_d offset".split(), "fp32"),
                 **dict.fromkeys("BLOCK_D ACCURATE EMU_BF16 HAS_KV".split(), "constexpr")})
    gate = _sig("a_ptr sa_t sa_h g_ptr sg_t sg_h out_ptr H D SILU BLOCK ACCURATE EMU_BF16",
                {**dict.fromkeys("a_ptr g_ptr out_ptr".split(), b),
                 **dict.fromkeys("SILU BLOCK ACCURATE EMU_BF16".split(), "constexpr")})
    w = lambda n: {"num_warps": n, **OPTS}      # noqa: E731
    return [
        ("(1 + w) norm, qwen3-next hidden 2048", "offset_norm_kernel", norm,
         dict(HAS_ADD=False, SHARED=False, BLOCK=2048, **ACC), w(4), []),
        ("add + norm, gpt-oss hidden 2880", "offset_norm_kernel", norm,
         dict(HAS_ADD=True, SHARED=False, BLOCK=4096, **ACC), w(8), []),
        ("add + shared gate/combine + norm", "offset_norm_kernel", norm,
         dict(HAS_ADD=True, SHARED=True, BLOCK=2048, **ACC), w(4), []),
        ("add + the routes' sum (10 per-route outputs) + shared gate/combine + norm", "offset_norm_kernel", parts,
         dict(HAS_ADD=True, SHARED=True, BLOCK=2048, PARTS=True, **ACC), w(4), []),
        ("shared expert silu * up", "gated_mul_kernel", gate, dict(SILU=True, BLOCK=512, **ACC), w(2), []),
        ("Gated DeltaNet decode pre (Dk = Dv = 128, r = 2, K = 4)", "gdn_pre_kernel", pre,
         dict(K=4, BLOCK_DK=128, BLOCK_V=256, BLOCK_R=2, **ACC), w(2), []),
        ("gated delta rule, decode, state rows in place (Dk = Dv = 128, Dv tile 32)", "gdn_recurrent_kernel", rule,
         dict(BLOCK_K=128, BLOCK_V=32, **ACC), w(4),
         "q_ptr sq_t sq_h k_ptr sk_t sk_h v_ptr sv_t sv_h state_ptr s_row s_h s_k o_ptr Dk Dv".split()),
        ("RMSNormGated (Dv = 128)", "gated_norm_kernel", gnorm, dict(BLOCK_D=128, **ACC), w(1), []),
        ("q/k (1 + w) norm + partial rope + KV write (D = 256)", "qk_norm_partial_rope_kernel", rope,
         dict(BLOCK_D=256, HAS_KV=True, **ACC), w(1), []),
        ("q/k (1 + w) norm + partial rope (D = 256)", "qk_norm_partial_rope_kernel", rope,
         dict(BLOCK_D=256, HAS_KV=False, **ACC), w(1), []),
        ("sigmoid output gate (D = 256)", "gated_mul_kernel", gate, dict(SILU=False, BLOCK=256, **ACC), w(1), []),
    ]


def main(argv: list[str] | None = None) -> int:
    return run_compile_check("compile the Qwen3-Next / gpt-oss decode kernels for an NVIDIA target", _cases(),
                             triton_kernels, argv)


if __name__ == "__main__":
    sys.exit(main())
