#!/usr/bin/env python3
"""The header map (include/gshard/README.md) is true: every header of
include/gshard is listed once with its layer, none listed is missing, no
header includes one of a higher layer (nor <mpi.h> below layer 2), and each
compiles on its own (-fsyntax-only, two at a time).

usage: check_headers.py SOURCE_ROOT WORKDIR -- COMPILER [FLAGS...]"""
import concurrent.futures
import glob
import os
import re
import subprocess
import sys

from checks import verdict

ROW = re.compile(r"^\| `([\w/.]+\.hpp)` \| (\d+) \|", re.M)
INCLUDE = re.compile(r'^#include "gshard/([\w/.]+)"', re.M)


def main() -> int:
    sep = sys.argv.index("--")
    root, work = sys.argv[1], sys.argv[2]
    compiler = [a for a in sys.argv[sep + 1:] if not a.startswith(("-l", "-L", "-Wl"))]
    os.makedirs(work, exist_ok=True)
    inc = os.path.join(root, "include", "gshard")
    problems = []
    layer = {}
    for name, n in ROW.findall(open(os.path.join(inc, "README.md")).read()):
        if name in layer:
            problems.append(f"include/gshard/README.md lists {name} twice")
        layer[name] = int(n)
    headers = sorted(os.path.relpath(p, inc) for p in glob.glob(os.path.join(inc, "**", "*.hpp"), recursive=True))
    for h in headers:
        if h not in layer:
            problems.append(f"{h} is not in include/gshard/README.md's map: give it a layer and say what it owns")
    for h in layer:
        if h not in headers:
            problems.append(f"include/gshard/README.md lists {h}, which does not exist")
    for h in headers:
        text = open(os.path.join(inc, h)).read()
        if h in layer and layer[h] < 2 and re.search(r"^#include <mpi\.h>", text, re.M):
            problems.append(f"{h} (layer {layer[h]}) includes <mpi.h>: MPI starts at layer 2")
        for dep in INCLUDE.findall(text):
            if h in layer and dep in layer and layer[dep] > layer[h]:
                problems.append(f"{h} (layer {layer[h]}) includes {dep} (layer {layer[dep]}): an include runs up a layer")

    def alone(h):
        src = os.path.join(work, re.sub(r"\W", "_", h) + ".cpp")
        open(src, "w").write(f"#include <gshard/{h}>\n#include <gshard/{h}>\n")  # twice: its include guard works
        p = subprocess.run(compiler + ["-fsyntax-only", src], capture_output=True, text=True, timeout=300)
        errors = [l for l in (p.stdout + p.stderr).split("\n") if "error" in l]
        return h, p.returncode, errors

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for h, code, errors in pool.map(alone, headers):
            if code != 0:
                problems.append(f"{h} does not compile alone:\n  " + "\n  ".join(errors[:10]))
    print(f"{len(headers)} headers: mapped, layered, each compiled alone")
    return verdict(problems, 0)


if __name__ == "__main__":
    sys.exit(main())
