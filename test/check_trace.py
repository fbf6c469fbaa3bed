#!/usr/bin/env python3
"""Runs the trainer for a few steps with --trace on one step and checks the
file: valid JSON in the Chrome trace-event format, one track per rank, and
for that step on every rank the expected spans — the step, forward,
backward, optimizer, every einsum of a block with its FLOPs, and exactly the
step's collectives with their axes and bytes.

usage: check_trace.py RANKS OUT.json -- MPIEXEC [ARGS...] TRAINER"""
import json
import subprocess
import sys
from collections import Counter


def main() -> int:
    sep = sys.argv.index("--")
    ranks, out = int(sys.argv[1]), sys.argv[2]
    cmd = sys.argv[sep + 1:] + ["--steps", "3", "--trace", out, "--trace-step", "1", "--log-every", "1000",
                                "--batch", str(4 * ranks), "--seq", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    problems = []
    if proc.returncode != 0:
        problems.append(f"trainer exited {proc.returncode}: {proc.stderr[-2000:]}")
    else:
        try:
            events = json.load(open(out))["traceEvents"]
        except Exception as e:  # noqa: BLE001 - any parse failure is the finding
            events = []
            problems.append(f"not valid JSON: {e}")
        spans = [e for e in events if e.get("ph") == "X"]
        names = {e["args"]["name"] for e in events if e.get("ph") == "M"}
        if names != {f"rank {r}" for r in range(ranks)}:
            problems.append(f"tracks {sorted(names)}")
        for r in range(ranks):
            mine = [e for e in spans if e["pid"] == r]
            count = Counter(e["name"] for e in mine)
            for want in ["train step 1", "forward", "backward", "optimizer", "block 1 MoE", "gating", "dispatch",
                         "combine"]:
                if count[want] < 1:
                    problems.append(f"rank {r}: no span '{want}'")
            for spec in ["BLM,MNK->BLNK", "BLNK,BTNK->BNLT", "BNLT,BTNK->BLNK", "BLNK,NKM->BLM", "EGCM,EMH->EGCH",
                         "EGCH,EHM->EGCM", "GSM,ME->GSE", "BLM,MV->BLV"]:
                spec_spans = [e for e in mine if e["name"] == spec]
                if not spec_spans or not all(e["args"]["flops"] > 0 for e in spec_spans):
                    problems.append(f"rank {r}: no einsum span {spec} with FLOPs")
            colls = Counter((e["name"], e["args"]["axes"]) for e in mine if e["cat"] == "collective")
            # 2 MoE blocks x (2 forward + 2 backward) all_to_alls
            if colls[("all_to_all", "expert")] != 8:
                problems.append(f"rank {r}: all_to_all spans {colls}")
            if not all(e["args"]["bytes"] >= 0 for e in mine if e["cat"] == "collective"):
                problems.append(f"rank {r}: a collective without bytes")
            step = [e for e in mine if e["name"] == "train step 1"]
            if step and any(e["ts"] < step[0]["ts"] - 1 or e["ts"] + e["dur"] > step[0]["ts"] + step[0]["dur"] + 1
                            for e in mine if e is not step[0]):
                problems.append(f"rank {r}: a span outside the traced step")
    for p in problems:
        print(p)
    ok = not problems
    print(f"gshard-test-summary: passed={int(ok)} failed={int(not ok)} ranks={ranks}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
