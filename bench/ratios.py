#!/usr/bin/env python3
"""Turns Google Benchmark JSON from bench_collectives into the docs table:
time of each gshard form over the raw MPI call measured in the same
iterations (median over repetitions; 1.00 = equal, lower is faster).

usage: ratios.py results.json"""
import json
import statistics
import sys
from collections import defaultdict


def main(path: str) -> None:
    data = json.load(open(path))
    rows = defaultdict(lambda: defaultdict(list))
    order = []
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        kind, size = b["run_name"].split("/")[:2]
        key = (kind, int(size))
        if key not in rows:
            order.append(key)
        for c in ("mpi_us", "gshard/mpi", "tensor/mpi"):
            if c in b:
                rows[key][c].append(b[c])
    print("| collective | bytes/rank | MPI (us) | gshard buffer / MPI | gshard tensor / MPI |")
    print("|---|---:|---:|---:|---:|")
    for kind, size in order:
        r = rows[(kind, size)]
        med = {c: statistics.median(v) for c, v in r.items()}
        label = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        ten = f"{med['tensor/mpi']:.3f}" if "tensor/mpi" in med else "-"
        print(f"| {kind} | {label} | {med['mpi_us']:.1f} | {med['gshard/mpi']:.3f} | {ten} |")


if __name__ == "__main__":
    main(sys.argv[1])
