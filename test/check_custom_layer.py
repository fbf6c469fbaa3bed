#!/usr/bin/env python3
"""Runs examples/custom_layer (a user-written SwiGLU block, forward code
only) and checks that it learns (the last mean squared error under a third of
the first) and that one step ran exactly the collectives its shardings imply:
forward one all_reduce over "model" per block and one over "data" for the
loss; backward one over "model" per block (the input gradient) and one over
"data" for the 9 parameters' gradients together (all are replicated over
"data", so their reductions take the same steps and share one bucket) — or,
where the hidden units do not divide over "model" (3 ranks: 43, 43, 42), one
for the weights with equal blocks and one for each of the others (buckets
stack only equal blocks).

usage: check_custom_layer.py RANKS -- MPIEXEC [ARGS...] PROGRAM"""
import re
import subprocess
import sys

from checks import verdict


def main() -> int:
    sep = sys.argv.index("--")
    ranks = int(sys.argv[1])
    proc = subprocess.run(sys.argv[sep + 1:] + ["150"], capture_output=True, text=True, timeout=240)
    out = proc.stdout
    problems = []
    if proc.returncode != 0:
        problems.append(f"exited {proc.returncode}: {proc.stderr[-2000:]}")
    mse = [float(v) for v in re.findall(r"mse ([0-9.]+)", out)]
    if len(mse) < 2 or not mse[-1] < mse[0] / 3:
        problems.append(f"it did not learn: {mse}")
    params = len(re.findall(r"^  (block\d\.\w+|head)  ", out, re.M))
    uneven = len(re.findall(r"^  (block\d\.\w+|head)  .*\(uneven: ", out, re.M))
    reductions = uneven + (1 if params > uneven else 0)
    want = (f"forward 1 all_reduce(data), 2 all_reduce(model); "
            f"backward (derived) {reductions} all_reduce(data), 2 all_reduce(model)")
    if params != 9 or want not in out:
        problems.append(f"expected {params} = 9 parameters and the collectives '{want}' in:\n{out}")
    return verdict(problems, ranks)


if __name__ == "__main__":
    sys.exit(main())
