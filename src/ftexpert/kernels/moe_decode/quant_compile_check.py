"""Compile the quantized-slot kernels (quant_kernels.py, and quant_mma_kernels.py's tensor-core gate/up for mxfp4
and nvfp4) for an NVIDIA target without a GPU, every format, even and ragged tiles, split and unsplit (see compile_check.py for what this catches and when it SKIPs).

    python -m ftexpert.kernels.moe_decode.quant_compile_check [--arch 90] [--resources]

--resources adds registers / spills, shared memory and `loop cvt`: the layout conversions Triton left
inside the K loop (each a round trip through shared memory every step; 0 is what the kernels aim at).
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

from ftexpert.kernels.compile_driver import run_compile_check
from ftexpert.kernels.dense_gemv.compile_check import loop_conversions
from ftexpert.kernels.moe_decode import quant_kernels, quant_mma_kernels

FORMATS = {"fp8": (0, 128, 128), "int4-g128": (1, 128, 1), "int4-g32": (1, 32, 1), "mxfp4": (2, 32, 1),
           "nvfp4": (3, 16, 1)}          # name: (FMT, GROUP, ROW_BLOCK)


def _cases() -> list[tuple[str, str, dict, dict, dict, list[str]]]:
    dt = "bf16"
    offs = ["codes_off", "scales_gate_off", "scales_up_off", "zeros_gate_off", "zeros_up_off", "glob_off"]
    gate_up_sig = {"x_ptr": f"*{dt}", "ids_ptr": "*i64", "rows_ptr": "*u8", "act_ptr": f"*{dt}",
                   "plan_ptr": "*i32", "nplan_ptr": "*i32", "extra_slot": "i32", "K": "i32", "H": "i32",
                   "I": "i32", "stride_xt": "i32", "stride_row": "i64", **{o: "i32" for o in offs}, "code_row_bytes": "i32",
                   "n_scale_cols": "i32"}
    gate_up_div = ["x_ptr", "ids_ptr", "rows_ptr", "act_ptr", "H", "I", "stride_xt", "stride_row", *offs, "code_row_bytes"]
    down_offs = ["codes_off", "scales_off", "zeros_off", "glob_off"]
    down_sig = {"act_ptr": f"*{dt}", "ids_ptr": "*i64", "rw_ptr": "*fp32", "rows_ptr": "*u8", "y_ptr": "*fp32",
                "plan_ptr": "*i32", "nplan_ptr": "*i32", "extra_slot": "i32", "H": "i32", "I": "i32",
                "stride_row": "i64", **{o: "i32" for o in down_offs}, "code_row_bytes": "i32", "n_scale_cols": "i32"}
    down_div = ["act_ptr", "ids_ptr", "rw_ptr", "rows_ptr", "y_ptr", "H", "I", "stride_row", *down_offs, "code_row_bytes"]
    dq_ints = ["H", "I", "stride_row", "stride_out", "codes13_off", "codes2_off", "code_row13", "code_row2", "scales_gate_off",
               "scales_up_off", "scales2_off", "zeros_gate_off", "zeros_up_off", "zeros2_off", "glob_off",
               "n_scale_cols13", "n_scale_cols2", "tiles_w13_k", "tiles_w13", "tiles_w2_k"]
    dq_sig = {"rows_ptr": "*u8", "ids_ptr": "*i64", "out_ptr": f"*{dt}", **{n: "i32" for n in dq_ints}}
    dq_sig["stride_row"] = dq_sig["stride_out"] = "i64"
    dq_div = ["rows_ptr", "ids_ptr", "out_ptr", "H", "I", "stride_row", "stride_out", *dq_ints[4:15]]
    w4 = {"num_warps": 4}
    whole = dict(PLAN=0, PLAN_MAX=1)
    cases = []
    for name, (fmt, group, row_block) in FORMATS.items():
        f = dict(FMT=fmt, GROUP=group, ROW_BLOCK=row_block)
        cases += [
            (f"{name} gate_up 4x512 even (the default)", "moe_gate_up_quant_kernel", gate_up_sig,
             dict(**f, BLOCK_N=4, BLOCK_K=512, EVEN_N=True, EVEN_K=True, ACCURATE=True, **whole), w4, gate_up_div),
            (f"{name} gate_up 16x256 ragged, split: in the plan", "moe_gate_up_quant_kernel", gate_up_sig,
             dict(**f, BLOCK_N=16, BLOCK_K=256, EVEN_N=False, EVEN_K=False, ACCURATE=True, PLAN=2, PLAN_MAX=8),
             w4, gate_up_div),
            (f"{name} down 16x256 even (the default)", "moe_down_quant_kernel", down_sig,
             dict(**f, BLOCK_N=16, BLOCK_K=256, EVEN_N=True, EVEN_K=True, **whole), w4, down_div),
            (f"{name} down 16x256 ragged, split: off the plan", "moe_down_quant_kernel", down_sig,
             dict(**f, BLOCK_N=16, BLOCK_K=256, EVEN_N=False, EVEN_K=False, PLAN=1, PLAN_MAX=8), w4, down_div),
            (f"{name} dequantize_rows 16x256", "dequantize_rows_kernel", dq_sig,
             dict(**f, BLOCK_N=16, BLOCK_K=256), w4, dq_div),
        ]
        if fmt != 0:                     # the 4-bit formats' scale a group's sum (GemvBlocks.quant_group_sum)
            cases += [
                (f"{name} gate_up 4x512 even, group sum", "moe_gate_up_quant_kernel", gate_up_sig,
                 dict(**f, BLOCK_N=4, BLOCK_K=512, EVEN_N=True, EVEN_K=True, ACCURATE=True, GSUM=True, **whole), w4,
                 gate_up_div),
                (f"{name} down 16x256 ragged, group sum, split", "moe_down_quant_kernel", down_sig,
                 dict(**f, BLOCK_N=16, BLOCK_K=256, EVEN_N=False, EVEN_K=False, GSUM=True, PLAN=1, PLAN_MAX=8), w4,
                 down_div),
            ]
    mma_sig = {**{k: v for k, v in gate_up_sig.items() if k not in ("zeros_gate_off", "zeros_up_off")},
               "parts_ptr": "*fp32", "P": "i32", "k_split": "i32", "b13_ptr": f"*{dt}", "stride_b": "i32",
               "alpha": "fp32", "limit": "fp32"}
    mma_div = [d for d in gate_up_div if d not in ("zeros_gate_off", "zeros_up_off")] + ["k_split"]
    parts_sig = {"parts_ptr": "*fp32", "ids_ptr": "*i64", "act_ptr": f"*{dt}", "plan_ptr": "*i32", "nplan_ptr": "*i32",
                 "extra_slot": "i32", "P": "i32", "I": "i32"}
    for name, fmt, group, bk in (("nvfp4", 3, 16, 256), ("mxfp4", 2, 32, 512)):
        f = dict(FMT=fmt, GROUP=group, BLOCK_K=bk, ACCURATE=True, ASM=True)
        cases += [
            (f"{name} gate_up mma 64x{bk} even, one range", "moe_gate_up_quant_mma_kernel", mma_sig,
             dict(**f, BLOCK_N=64, EVEN_N=True, EVEN_K=True, SPLIT=1, **whole), {"num_warps": 8}, mma_div),
            (f"{name} gate_up mma 32x{bk} ragged, 4 ranges, biases and SwiGLU, split: in the plan",
             "moe_gate_up_quant_mma_kernel", mma_sig,
             dict(**f, BLOCK_N=32, EVEN_N=False, EVEN_K=False, SPLIT=4, PLAN=2, PLAN_MAX=8, BIAS=True, SWIGLU=True), w4, mma_div),
        ]
    down_mma_sig = {**{k: v for k, v in down_sig.items() if k != "zeros_off"}, "parts_ptr": "*fp32", "P": "i32",
                    "k_split": "i32", "b2_ptr": f"*{dt}", "stride_b": "i32"}
    down_mma_div = [d for d in down_div if d != "zeros_off"] + ["k_split"]
    for name, fmt, group, bk in (("nvfp4", 3, 16, 256), ("mxfp4", 2, 32, 512)):
        f = dict(FMT=fmt, GROUP=group, BLOCK_K=bk, ASM=True)
        cases += [
            (f"{name} down mma 64x{bk} even, one range", "moe_down_quant_mma_kernel", down_mma_sig,
             dict(**f, BLOCK_N=64, EVEN_N=True, EVEN_K=True, SPLIT=1, **whole), {"num_warps": 8}, down_mma_div),
            (f"{name} down mma 32x{bk} ragged, 2 ranges, bias, split: off the plan", "moe_down_quant_mma_kernel",
             down_mma_sig, dict(**f, BLOCK_N=32, EVEN_N=False, EVEN_K=False, SPLIT=2, PLAN=1, PLAN_MAX=8, BIAS=True),
             w4, down_mma_div),
        ]
    cases.append(("down from 4 ranges' sums, bias", "moe_down_from_parts_kernel",
                  {"parts_ptr": "*fp32", "ids_ptr": "*i64", "rw_ptr": "*fp32", "y_ptr": "*fp32", "act_ptr": f"*{dt}",
                   "plan_ptr": "*i32", "nplan_ptr": "*i32", "extra_slot": "i32", "P": "i32", "H": "i32",
                   "b2_ptr": f"*{dt}", "stride_b": "i32"},
                  dict(BLOCK=1024, SPLIT=4, BIAS=True, **whole), w4, ["parts_ptr", "ids_ptr", "y_ptr", "H"]))
    cases.append(("act from 8 ranges' sums", "moe_act_from_parts_kernel", parts_sig,
                  dict(BLOCK=1024, ACCURATE=True, SPLIT=8, **whole), w4, ["parts_ptr", "ids_ptr", "act_ptr", "I"]))
    return cases


def _extra(kernel) -> str:
    return f"  shared {kernel.metadata.shared}  loop cvt {loop_conversions(kernel.asm['ttgir'])}"


def main(argv: list[str] | None = None) -> int:
    kernels = SimpleNamespace(**vars(quant_kernels), **{k: v for k, v in vars(quant_mma_kernels).items()
                                                        if k.endswith("_kernel")})
    return run_compile_check("compile the quantized-slot decode kernels for an NVIDIA target", _cases(), kernels,
                             argv, extra=_extra)


if __name__ == "__main__":
    sys.exit(main())
