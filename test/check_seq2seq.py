#!/usr/bin/env python3
"""Runs examples/seq2seq (an MoE encoder-decoder reversing and uppercasing
words) and checks that it learns the task: the cross-entropy falls below a
tenth of its first value, no padded position is routed, and greedy decoding
and beam search with the cache get at least 28 of the 32 held-out words
exactly.

usage: check_seq2seq.py RANKS STEPS -- MPIEXEC [ARGS...] PROGRAM"""
import re
import subprocess
import sys

from checks import verdict


def main() -> int:
    sep = sys.argv.index("--")
    ranks, steps = int(sys.argv[1]), sys.argv[2]
    proc = subprocess.run(sys.argv[sep + 1:] + [steps], capture_output=True, text=True, timeout=240)
    out = proc.stdout
    problems = []
    if proc.returncode != 0:
        problems.append(f"exited {proc.returncode}: {proc.stderr[-2000:]}")
    ce = [float(v) for v in re.findall(r"cross-entropy ([0-9.]+)", out)]
    if len(ce) < 2 or not ce[-1] < ce[0] / 10:
        problems.append(f"it did not learn: cross-entropy {ce}")
    if re.search(r"padded positions routed: none of 0\b", out) or "padded positions routed" not in out:
        problems.append("no padded position was counted")
    m = re.search(r"greedy (\d+)/32 exact, beam 4 (\d+)/32 exact", out)
    if not m or int(m.group(1)) < 28 or int(m.group(2)) < 28:
        problems.append(f"decoding the held-out words: {m.group(0) if m else 'no result line'}")
    if problems:
        problems.append(out[-3000:])
    return verdict(problems, ranks)


if __name__ == "__main__":
    sys.exit(main())
