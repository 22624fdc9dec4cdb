"""bench/sass_loops.py finds a kernel's loops in cuobjdump's SASS text and counts their opcodes; bench/
profile_quant_gemv.py summarizes an Nsight Compute CSV log (one block a launch, the stalls largest first) and
lists the raw metrics the quant_profile suite asks ncu for. No GPU: SASS text and CSV written here."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, BENCH)

import sass_loops  # noqa: E402  (bench/ on the path)

SASS = """
        code for sm_90
                Function : moe_gate_up_quant_kernel
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 BRA 0x80 ;                               /* 0x0000000000188947 */
        /*0020*/                   LDG.E.64 R16, desc[UR8][R16.64] ;        /* 0x0000000810107981 */
        /*0030*/                   PRMT R55, R16, 0x7770, RZ ;              /* 0x0000777010377816 */
        /*0040*/                   IMAD.SHL.U32 R58, R55, 0x10000000, RZ ;  /* 0x10000000373a7824 */
        /*0050*/                   SHF.R.S32.HI R59, RZ, 0x6, R58 ;         /* 0x000000063a3b7819 */
        /*0060*/                   FFMA R24, R4, R59, R24 ;                 /* 0x0000003b04187223 */
        /*0070*/              @!P1 BRA 0x20 ;                               /* 0xfffffff000d49947 */
        /*0080*/                   EXIT ;                                   /* 0x000000000000794d */
                Function : other_kernel
        /*0000*/                   IADD3 R1, R1, 0x1, RZ ;                  /* 0x0000000101017810 */
        /*0010*/                   IADD3 R1, R1, 0x1, RZ ;                  /* 0x0000000101017810 */
        /*0020*/                   BRA 0x0 ;                                /* 0xfffffff000d49947 */
"""


def test_the_loops_of_each_function_and_their_opcodes():
    found = sass_loops.loops(SASS)
    assert [(f["function"], f["start"], f["end"], f["count"]) for f in found] == [
        ("moe_gate_up_quant_kernel", 0x20, 0x70, 6), ("other_kernel", 0x0, 0x20, 3)]
    ops = found[0]["ops"]
    assert ops == {"LDG": 1, "PRMT": 1, "IMAD": 1, "SHF": 1, "FFMA": 1, "BRA": 1}    # the forward branch is not one
    assert sass_loops.opcode("@!P1 IMAD.SHL.U32 R58, R55, 0x10, RZ") == "IMAD"
    line = sass_loops.describe(found[0])
    assert "6 instructions" in line and "loop 0x0020-0x0070" in line


def _ncu_row(lid, kernel, section, name, unit, value):
    cells = [lid, "123", "python3", "host", kernel, "1", "7", "(128, 1, 1)", "(10, 64, 1)", "0", "9.0", section, name,
             unit, value]
    return ",".join(f'"{c}"' for c in cells)


def test_an_ncu_log_is_summarized_per_launch_with_the_stalls_largest_first(tmp_path):
    header = ",".join(f'"{c}"' for c in ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context",
                                          "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name",
                                          "Metric Name", "Metric Unit", "Metric Value"])
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    rows = [header,
            _ncu_row("0", "moe_gate_up_quant_kernel", "GPU Speed Of Light Throughput", "Duration", "us", "9.12"),
            _ncu_row("0", "moe_gate_up_quant_kernel", "Occupancy", "Achieved Occupancy", "%", "41.5"),
            _ncu_row("0", "moe_gate_up_quant_kernel", "Command line profiler metrics", stall.format("wait"), "", "0.40"),
            _ncu_row("0", "moe_gate_up_quant_kernel", "Command line profiler metrics", stall.format("long_scoreboard"),
                     "", "3.25"),
            _ncu_row("0", "moe_gate_up_quant_kernel", "Command line profiler metrics", stall.format("barrier"), "",
                     "0.01"),
            _ncu_row("1", "moe_down_quant_kernel", "GPU Speed Of Light Throughput", "Duration", "us", "7.00")]
    log = tmp_path / "ncu.csv"
    log.write_text("==PROF== Connected to process 123\n" + "\n".join(rows) + "\n")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "profile_quant_gemv.py"), "--summarize-ncu", str(log)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "== launch 0: moe_gate_up_quant_kernel" in out and "== launch 1: moe_down_quant_kernel" in out
    assert "Duration                             9.12 us" in out and "Achieved Occupancy                   41.5 %" in out
    stalls = next(line for line in out.splitlines() if "stalls per issued" in line)
    assert stalls.index("long_scoreboard 3.25") < stalls.index("wait 0.40") and "barrier" not in stalls


def test_an_empty_log_and_the_metrics_list(tmp_path):
    log = tmp_path / "ncu.csv"
    log.write_text("==ERROR== Failed to initialize the profiler\n")
    script = os.path.join(BENCH, "profile_quant_gemv.py")
    proc = subprocess.run([sys.executable, script, "--summarize-ncu", str(log)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "no CSV rows" in proc.stdout
    proc = subprocess.run([sys.executable, script, "--metrics-list"], capture_output=True, text=True, timeout=60)
    metrics = proc.stdout.strip().split(",")
    assert proc.returncode == 0 and "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio" in metrics
    assert len(metrics) == len(set(metrics)) > 18
