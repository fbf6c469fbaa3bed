#!/usr/bin/env python3
"""The examples at a rank count whose extents do not divide give the losses
of 1 rank: the trainer, moe_transformer, custom_layer, the encoder-decoder
toy (seq2seq) and translate, each run briefly at 1 rank and at RANKS (3: 8
experts as 3, 3, 2; 6: a 2 x 3 mesh, batches of 8 over 6 ranks), with the
same seeds and data. Every printed loss (and translate's held-out figures,
which run greedy decoding and beam search) must agree to one unit of the
last printed digit; the programs' own output names which does not.

usage: check_any_ranks.py RANKS EXAMPLES_DIR -- MPIEXEC [ARGS...]"""
import os
import re
import sys

from checks import run, verdict

TEXT = "/usr/share/common-licenses/GPL-3"
FREEDICT = [f"/usr/share/dictd/freedict-{l}-eng.dict.dz" for l in ("kha", "srp")]

# program, its arguments, the pattern of the numbers compared.
CASES = [
    ("train", [TEXT, "--steps", "3", "--log-every", "1", "--batch", "8", "--seq", "32", "--sample-bytes", "0",
               "--weight-update", "sharded"], r"loss ([0-9.]+)"),
    ("moe_transformer", [TEXT, "2"], r"forward \d+: loss ([0-9.]+) \(cross-entropy ([0-9.]+), aux ([0-9.]+)\)"),
    ("custom_layer", ["20"], r"mse ([0-9.]+)"),
    ("seq2seq", ["30"], r"(?:cross-entropy ([0-9.]+)  aux ([0-9.]+))|(?:greedy (\d+)/32 exact, beam 4 (\d+)/32 exact)"),
    ("translate", ["--languages", "kha,srp", "--steps", "4", "--log-every", "1", "--batch", "16", "--eval-every", "0",
                   "--eval-sentences", "8", "--show", "0"],
     r"(?:loss ([0-9.]+))|(?:^  (?:kha|srp) +([0-9.]+) +([0-9.]+)% +([0-9.]+)% +([0-9.]+) +([0-9.]+)$)"),
]


def numbers(pattern, out):
    """The printed numbers as (value, the unit of their last digit)."""
    return [(float(v), 10.0 ** -len(v.partition(".")[2])) for m in re.finditer(pattern, out, re.M)
            for v in m.groups() if v is not None]


def main() -> int:
    sep = sys.argv.index("--")
    ranks, examples = int(sys.argv[1]), sys.argv[2]
    mpiexec = sys.argv[sep + 1:]
    problems = []
    for program, args, pattern in CASES:
        if program == "translate" and not all(os.path.exists(p) for p in FREEDICT):
            problems.append("translate: dict-freedict-kha-eng and dict-freedict-srp-eng are not installed (scripts/setup installs them)")
            continue
        seen = {}
        for np in (1, ranks):
            code, out = run(mpiexec + ["-np", str(np), os.path.join(examples, program)] + args, timeout=240)
            seen[np] = numbers(pattern, out)
            if code != 0 or not seen[np]:
                problems.append(f"{program} at {np} ranks: exit {code}, numbers {seen[np]}:\n{out[-2500:]}")
        one, many = seen[1], seen[ranks]
        print(f"{program}: {len(one)} numbers at 1 rank, {len(many)} at {ranks}")
        # Equal up to one unit of the last printed digit (a sum in another
        # order can round the other way).
        if len(one) != len(many) or any(abs(a - b) > 1.01 * unit for (a, unit), (b, _) in zip(one, many)):
            problems.append(f"{program}: 1 rank printed {[a for a, _ in one]},\n  {ranks} ranks printed {[b for b, _ in many]}")
    return verdict(problems, ranks)


if __name__ == "__main__":
    sys.exit(main())
