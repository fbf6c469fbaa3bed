#!/usr/bin/env python3
"""Every whole program in README.md and docs/*.md (a ```cpp block with
`int main(`) is compiled and run: the block must follow a marker
<!-- test: np=1,2 expect="text" --> naming the rank counts it claims and a
text its output must hold (printed once: rank 0 prints). A program without a
marker is a failure, so a new one cannot go untested.

usage: check_doc_programs.py SOURCE_ROOT WORKDIR -- COMPILER [FLAGS...] -- MPIEXEC [ARGS...]"""
import glob
import os
import re
import subprocess
import sys

from checks import verdict

BLOCK = re.compile(r"(?:<!--\s*test:\s*np=([\d,]+)(?:\s+expect=\"([^\"]*)\")?\s*-->\s*\n)?```cpp\n(.*?)```", re.S)


def main() -> int:
    first = sys.argv.index("--")
    second = sys.argv.index("--", first + 1)
    root, work = sys.argv[1], sys.argv[2]
    compiler, mpi = sys.argv[first + 1:second], sys.argv[second + 1:]
    os.makedirs(work, exist_ok=True)
    problems, ran = [], 0
    for md in [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
        text = open(md).read()
        for i, m in enumerate(BLOCK.finditer(text)):
            ranks, expect, code = m.group(1), m.group(2), m.group(3)
            if "int main(" not in code:
                continue
            where = f"{os.path.relpath(md, root)}, program at line {text[:m.start()].count(chr(10)) + 1}"
            if not ranks:
                problems.append(f"{where}: no <!-- test: np=... --> marker before it")
                continue
            base = os.path.join(work, re.sub(r"\W", "_", os.path.relpath(md, root)) + f"_{i}")
            open(base + ".cpp", "w").write(code)
            flags = [a for a in compiler if not a.startswith(("-l", "-L", "-Wl"))]
            libs = [a for a in compiler if a.startswith(("-l", "-L", "-Wl"))]  # after the source
            p = subprocess.run(flags + [base + ".cpp", "-o", base] + libs, capture_output=True, text=True, timeout=300)
            if p.returncode != 0:
                problems.append(f"{where}: does not compile:\n{(p.stdout + p.stderr)[-3000:]}")
                continue
            for np in ranks.split(","):
                r = subprocess.run(mpi + ["-np", np, base], capture_output=True, text=True, timeout=120)
                out = r.stdout + r.stderr
                if r.returncode != 0 or (expect and r.stdout.count(expect) != 1):
                    problems.append(f"{where} at {np} ranks: exit {r.returncode}, wanted {expect!r} once:\n{out[-2000:]}")
                ran += 1
    if ran == 0:
        problems.append("no documented program ran")
    print(f"{ran} runs of documented programs")
    return verdict(problems, 0)


if __name__ == "__main__":
    sys.exit(main())
