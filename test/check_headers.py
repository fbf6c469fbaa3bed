#!/usr/bin/env python3
"""The header map (include/gshard/README.md) is true: the folders of
include/gshard are its floors, in the order the map lists them, and a
header's floor is its folder's; every header is listed once, none listed is
missing, no header includes one of a higher floor (nor <mpi.h> below
runtime/), and each compiles on its own (-fsyntax-only, two at a time).

usage: check_headers.py SOURCE_ROOT WORKDIR -- COMPILER [FLAGS...]"""
import concurrent.futures
import glob
import os
import re
import subprocess
import sys

from checks import verdict

FLOOR = re.compile(r"^\| (\d+) \| `(\w+)/` \|", re.M)       # | 0 | `core/` | what it owns |
ROW = re.compile(r"^\| `([\w/.]+\.hpp)` \|", re.M)          # | `core/types.hpp` | what it owns |
INCLUDE = re.compile(r'^#include "gshard/([\w/.]+)"', re.M)
MPI_FLOOR = "runtime"


def main() -> int:
    sep = sys.argv.index("--")
    root, work = sys.argv[1], sys.argv[2]
    compiler = [a for a in sys.argv[sep + 1:] if not a.startswith(("-l", "-L", "-Wl"))]
    os.makedirs(work, exist_ok=True)
    inc = os.path.join(root, "include", "gshard")
    text = open(os.path.join(inc, "README.md")).read()
    problems = []
    floors = {}
    for n, folder in FLOOR.findall(text):
        if int(n) != len(floors):
            problems.append(f"include/gshard/README.md numbers the floor {folder}/ {n}, after {len(floors)} floors")
        floors[folder] = int(n)
    top = len(floors)  # the umbrella, gshard.hpp, stands above every floor
    dirs = sorted(d for d in os.listdir(inc) if os.path.isdir(os.path.join(inc, d)))
    for d in dirs:
        if d not in floors:
            problems.append(f"include/gshard/{d}/ is not a floor of include/gshard/README.md's map: list it with what it owns")
    for d in floors:
        if d not in dirs:
            problems.append(f"include/gshard/README.md lists the floor {d}/, which does not exist")

    def floor_of(h):
        parts = h.split("/")
        if len(parts) == 1:
            return top if h == "gshard.hpp" else None
        return floors.get(parts[0]) if len(parts) == 2 else None

    listed = ROW.findall(text)
    seen = set()
    for h in listed:
        if h in seen:
            problems.append(f"include/gshard/README.md lists {h} twice")
        seen.add(h)
    headers = sorted(os.path.relpath(p, inc) for p in glob.glob(os.path.join(inc, "**", "*.hpp"), recursive=True))
    for h in headers:
        if floor_of(h) is None:
            problems.append(f"{h} is not in a floor's folder (one level below include/gshard/; only gshard.hpp stands at the top)")
        if h not in seen:
            problems.append(f"{h} is not in include/gshard/README.md's map: say what it owns")
    for h in seen:
        if h not in headers:
            problems.append(f"include/gshard/README.md lists {h}, which does not exist")
    for h in headers:
        here = floor_of(h)
        if here is None:
            continue
        body = open(os.path.join(inc, h)).read()
        if here < floors.get(MPI_FLOOR, 0) and re.search(r"^#include <mpi\.h>", body, re.M):
            problems.append(f"{h} (floor {here}) includes <mpi.h>: MPI starts at {MPI_FLOOR}/")
        for dep in INCLUDE.findall(body):
            there = floor_of(dep)
            if there is None:
                problems.append(f"{h} includes gshard/{dep}, which is in no floor")
            elif there > here:
                problems.append(f"{h} (floor {here}) includes {dep} (floor {there}): an include runs up a floor")

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
    print(f"{len(headers)} headers on {len(floors)} floors: mapped, layered, each compiled alone")
    return verdict(problems, 0)


if __name__ == "__main__":
    sys.exit(main())
