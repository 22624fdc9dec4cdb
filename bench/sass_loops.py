"""The loops of a CUDA kernel's SASS and their instruction mix: `cuobjdump -sass` text in, one line per loop out
(its address range, instruction count and the most common opcodes). A loop is a backward branch's range.

    python bench/sass_loops.py FILE.cubin|FILE.sass [...]

Used by profile_quant_gemv.py (the kernels as the GPU machine's Triton compiled them) and by hand on cubins that
`python -m ftexpert.kernels.moe_decode.quant_compile_check` compiles here.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)|(0x[0-9a-f]+))")


def cuobjdump() -> str:
    """The cuobjdump of the CUDA toolkit on PATH, else the one Triton bundles."""
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if os.path.exists(os.path.join(d, "cuobjdump")):
            return os.path.join(d, "cuobjdump")
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass_of(path: str) -> str:
    if path.endswith(".cubin"):
        return subprocess.run([cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    with open(path) as fh:
        return fh.read()


def opcode(text: str) -> str:
    """`@!P0 IMAD.SHL.U32 R1, ...` -> IMAD (the predicate and the modifiers dropped)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text.strip())
    return text.split()[0].split(".")[0] if text else ""


def loops(sass: str) -> list[dict]:
    """Each backward branch of each function: {function, start, end, count, ops (Counter)}; innermost first is
    not promised (loops are listed in the order their branches appear)."""
    out, func, body = [], "", []
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            func, body = m.group(1), []
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        addr, text = int(m.group(1), 16), m.group(2)
        body.append((addr, text))
        b = _BRANCH.search(text)
        if b and b.group(1) and int(b.group(1), 16) < addr:
            start = int(b.group(1), 16)
            ins = [t for a, t in body if start <= a <= addr]
            out.append(dict(function=func, start=start, end=addr, count=len(ins), ops=Counter(map(opcode, ins))))
    return out


def describe(loop: dict, top: int = 12) -> str:
    mix = " ".join(f"{op} {n}" for op, n in loop["ops"].most_common(top))
    return (f"{loop['function'][:48]:<48} loop {loop['start']:#06x}-{loop['end']:#06x}: {loop['count']} instructions "
            f"({mix})")


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__)
        return 2
    for path in paths:
        for loop in loops(sass_of(path)):
            print(describe(loop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
