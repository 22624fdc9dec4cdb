"""The shared driver of the `compile_check` modules (kernels/moe_decode, kernels/dense_gemv): compile
each case ahead of time for an NVIDIA target on a machine without a GPU (Triton's front end, MLIR
passes, LLVM and the ptxas bundled with the wheel), print one line per case, exit 1 on a failure.
Prints SKIP and returns 0 where this triton cannot compile ahead of time or TRITON_INTERPRET=1."""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from types import ModuleType

import triton

from ftexpert.kernels.impl import interpreted
from ftexpert.kernels.slot_cache.ptx_check import compile_for_arch, cubin_resources


def cannot_compile_ahead() -> str:
    """Why kernels cannot be compiled ahead of time in this process ('' when they can)."""
    if interpreted():
        return "TRITON_INTERPRET=1 (the kernels are interpreted functions); unset it"
    try:        # a probe: not every triton has these
        from triton.backends.compiler import GPUTarget  # noqa: F401 (a triton that can compile ahead of time)
        from triton.compiler import ASTSource
        ASTSource.__init__.__code__.co_varnames.index("constexprs")
    except (ImportError, AttributeError, ValueError) as exc:
        return f"this triton cannot compile ahead of time here ({exc})"
    return ""


def run_compile_check(description: str, cases: list, kernels_module: ModuleType, argv: list[str] | None = None,
                      extra: Callable[[object], str] | None = None) -> int:
    """cases: (name, kernel attribute of kernels_module, signature, constexprs, options, 16-divisible args);
    extra(kernel) adds text to a case's line with --resources."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    parser.add_argument("--resources", action="store_true", help="registers / spills (cuobjdump) and more")
    args = parser.parse_args(argv)
    skip = cannot_compile_ahead()
    if skip:
        print(f"SKIP: {skip}")
        return 0
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    failed = 0
    for name, attr, sig, consts, opts, divisible in cases:
        fn = getattr(kernels_module, attr)
        try:
            kernel = compile_for_arch(fn, sig, consts, args.arch, divisible=divisible if args.resources else (),
                                      options=opts)
        except Exception as exc:                                          # report every failure
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            continue
        line = f"ok   {name}"
        if args.resources:
            if os.path.exists(cuobjdump):
                res = cubin_resources(kernel.asm["cubin"])
                line += f"  regs {res['regs']} local {res['local']}"
            if extra is not None:
                line += extra(kernel)
        print(line, flush=True)
    print(f"{len(cases) - failed} compiled, {failed} failed (sm_{args.arch})")
    return 1 if failed else 0
