"""Static cost of our Triton kernels on Hopper, without a GPU: registers, local memory and the SASS
instructions of each loop, for the cases of tests/csrc_triton/test_compile_hopper.py.

    python scripts/sass_loops.py moe-w13-decode moe-w2-decode --kwargs narrow_scales=True

Each case's launch is captured and compiled for sm_90 as that test does, then disassembled with the
nvdisasm Triton ships. A loop is the body of a backward branch; its instruction count divided by the
work one iteration does (weight elements per thread, say) is the figure to compare between versions
of an arithmetic-bound kernel. A benchmark, not a test: the GPU's timings are the final word.
The device's compiler (vLLM 0.26 ships with triton 3.6) can differ from this venv's: install it beside
(``pip install --no-deps --target DIR triton==3.6.0``) and put DIR first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\s+(?:`\()?(\.L_x_\d+)")


def loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """``(start, end, opcode counts)`` of each backward branch's body, by address."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        if m := LABEL.match(line):
            pending.append(m.group(1))
        elif m := INSTRUCTION.match(line):
            address = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            instructions.append((address, m.group(2)))
    found = []
    for address, text in instructions:
        if (m := BRANCH.search(text)) and labels.get(m.group(1), address + 1) < address:
            start = labels[m.group(1)]
            body = [t for a, t in instructions if start <= a <= address]
            opcodes = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            found.append((start, address, opcodes))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", help="ids of test_compile_hopper.KERNEL_CASES")
    parser.add_argument("--kwargs", nargs="*", default=[], help="launcher keyword arguments, name=python-literal")
    args = parser.parse_args()
    import ast

    import triton

    from tests.csrc_triton.test_compile_hopper import KERNEL_CASES, captured_launches, compile_for_hopper

    kwargs = {k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.kwargs)}
    by_id = {case.id: case.values for case in KERNEL_CASES}
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for case_id in args.cases:
        kernel, launcher, build_args = by_id[case_id]
        (launch,) = captured_launches(kernel, functools.partial(launcher, **kwargs), *build_args())
        compiled = compile_for_hopper(kernel, *launch)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin.name], capture_output=True,
                                   text=True, check=True).stdout.strip().splitlines()[-1].split()
            sass = subprocess.run([tools / "nvdisasm", "-c", cubin.name], capture_output=True, text=True,
                                  check=True).stdout
        resources = " ".join(u for u in usage if u.split(":")[0] in ("REG", "STACK", "LOCAL"))
        print(f"{case_id}: {resources} SHARED:{compiled.metadata.shared}")
        for start, end, opcodes in loops(sass):
            top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(8))
            print(f"  loop {start:#x}-{end:#x}: {sum(opcodes.values())} instructions ({top})")


if __name__ == "__main__":
    main()
