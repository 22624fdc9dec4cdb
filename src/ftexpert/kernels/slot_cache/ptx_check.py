"""Compile the slot-cache kernels for an NVIDIA target on a machine without a GPU and write their PTX
with register names canonicalised (in order of first use) and debug lines dropped, so that two
revisions of the kernels can be diffed at the instruction level:

    python -m ftexpert.kernels.slot_cache.ptx_check --out /tmp/ptx-new          # in each checkout
    diff -r /tmp/ptx-old /tmp/ptx-new

Each config's line also gives what a GPU-less review can compare: registers and local memory (spills)
of the cubin (cuobjdump of Triton's own ptxas output), and the PTX's block barriers (`bar.sync`),
global atomics (`atom`/`red`) and instruction count. `--out` also writes the table as resources.txt.

Unset TRITON_INTERPRET first (the interpreter's kernels cannot be compiled ahead of time).
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import re
import subprocess
import sys
import tempfile

import triton

from ftexpert.kernels.slot_cache import triton_decode, triton_kernels
from ftexpert.kernels.slot_cache.api import small_launch


def canonical_ptx(ptx: str) -> str:
    code = ptx.split(".section", 1)[0]                       # the debug sections follow the code
    lines = [line for line in code.splitlines()
             if not re.match(r"^\s*(\.loc|\.file|\.reg|//)|^\$L__(tmp|func_end)\d+:$", line)]
    names: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        kind = m.group(1)
        return names.setdefault(m.group(0), f"%{kind}#{sum(k.startswith('%' + kind + '#') for k in names.values())}")

    text = re.sub(r"%(rd|rs|r|p|fd|f|h|b)\d+", rename, "\n".join(lines))
    return re.sub(r"\$L__BB\d+_\d+", "BB", text)


def ptx_counts(text: str) -> dict[str, int]:
    """bar.sync, atom/red and instruction counts of canonical PTX (labels and directives excluded)."""
    body = text.split("{", 1)[-1]
    instrs = [line.strip() for line in body.splitlines()
              if line.strip() and not re.match(r"^(\S+:|[{}]|\.|\))", line.strip())]
    return {"bar.sync": sum("bar.sync" in i for i in instrs),
            "atom/red": sum(bool(re.search(r"(^|\s)(atom|red)\.", i)) for i in instrs),
            "instrs": len(instrs)}


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers and local memory (bytes; > 0 means spills) per cuobjdump --dump-resource-usage."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([tool, "--dump-resource-usage", fh.name], capture_output=True, text=True,
                             check=True).stdout
    return {"regs": int(re.search(r"REG:(\d+)", out).group(1)),
            "local": int(re.search(r"LOCAL:(\d+)", out).group(1)) + int(re.search(r"STACK:(\d+)", out).group(1))}


def compile_for_arch(fn, signature: dict, constexprs: dict, arch: int, *, divisible=(), options=None):
    """triton.compile of a @triton.jit `fn` for sm_<arch> without a GPU (Triton's front end, LLVM and its
    bundled ptxas). divisible: argument names the JIT would mark 16-divisible at launch (aligned
    pointers and sizes); options: compile options (default 4 warps)."""
    # lazy: not every triton has these (compile_driver.cannot_compile_ahead probes them before a compile)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible} or None
    signature, constexprs = dict(signature), dict(constexprs)
    for name, param in inspect.signature(fn.fn).parameters.items():    # constexprs left at their default
        if name not in signature and param.default is not inspect.Parameter.empty:
            signature[name] = "constexpr"
            constexprs.setdefault(name, param.default)
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=dict(options or {"num_warps": 4}))


def cases():
    i64, i32 = "*i64", "*i32"
    small = dict(ids_ptr=i64, num_routes="i32", slot_for_id_ptr=i32, id_of_slot_ptr=i32, usage_ptr=i64,
                 step_ptr=i64, recency_ptr=i64, mark_ptr=i64, evict_ptr=i32, src_ptr=i32, num_indices_ptr=i32,
                 num_missing_ptr=i32, error_ptr=i32, policy_ptr=i64, part_keys_ptr=i64, arrive_ptr=i32,
                 vkeys_ptr=i64, vowner_ptr=i32, count_ptr=i64, freq_weight="i32", freq_half_life="i32", num_counts="i32",
                 layer="i32", pool_base="i32", num_slots="i32", max_fetch="i32",
                 frac_q16="i32", round_mode="i32", promote="i32", seed="i32")
    general = {k: v for k, v in small.items() if k not in ("part_keys_ptr", "arrive_ptr", "vkeys_ptr", "vowner_ptr")}
    for k in ("NUM_EXPERTS", "E_BLOCK", "ROUTE_BLOCK", "PART", "V", "CAND", "MERGE_BLOCK", "USE_POLICY", "MULTI",
              "USE_FREQ"):
        small[k] = "constexpr"
    for k in ("NUM_EXPERTS", "E_BLOCK", "ROUTE_TILE", "SLOT_TILE", "USE_POLICY", "USE_FREQ"):
        general[k] = "constexpr"

    def small_case(name, experts, slots, victim_list, use_policy, use_freq=False):
        shape = small_launch(10, slots, victim_list)
        del shape["programs"]
        return (name, "ensure_small_kernel", small,
                dict(NUM_EXPERTS=experts, E_BLOCK=experts, USE_POLICY=use_policy, USE_FREQ=use_freq, **shape))

    return [
        small_case("small-2048-list", 128, 2048, 32, True),
        small_case("small-23197-multi", 512, 23197, 32, False),
        small_case("small-64-list", 128, 64, 32, False),
        small_case("small-64-nolist", 128, 64, 0, False),
        small_case("small-2048-freq", 128, 2048, 0, True, use_freq=True),        # with W > 0: no list (api.ensure)
        small_case("small-23197-multi-freq", 512, 23197, 0, False, use_freq=True),
        ("general", "ensure_kernel", general,
         dict(NUM_EXPERTS=512, E_BLOCK=512, ROUTE_TILE=1024, SLOT_TILE=2048, USE_POLICY=False, USE_FREQ=False)),
        ("general-freq", "ensure_kernel", general,
         dict(NUM_EXPERTS=512, E_BLOCK=512, ROUTE_TILE=1024, SLOT_TILE=2048, USE_POLICY=False, USE_FREQ=True)),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--out", default=None, help="write NAME.ptx (canonical) files here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("SKIP: TRITON_INTERPRET=1; unset it")
        return 0
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    table = [f"{'config':20s} {'sha256':16s} {'regs':>5s} {'local':>6s} {'bar.sync':>8s} {'atom/red':>8s} {'instrs':>6s}"]
    print(table[0])
    for name, kernel, signature, constexprs in cases():
        module = triton_decode if kernel == "ensure_small_kernel" else triton_kernels
        compiled = compile_for_arch(getattr(module, kernel), signature, constexprs, args.arch)
        text = canonical_ptx(compiled.asm["ptx"])
        res, counts = cubin_resources(compiled.asm["cubin"]), ptx_counts(text)
        table.append(f"{name:20s} {hashlib.sha256(text.encode()).hexdigest()[:16]} {res['regs']:5d} "
                     f"{res['local']:6d} {counts['bar.sync']:8d} {counts['atom/red']:8d} {counts['instrs']:6d}")
        print(table[-1])
        if args.out:
            with open(os.path.join(args.out, f"{name}.ptx"), "w") as fh:
                fh.write(text)
    if args.out:
        with open(os.path.join(args.out, "resources.txt"), "w") as fh:
            fh.write("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
