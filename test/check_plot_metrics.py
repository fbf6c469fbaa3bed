#!/usr/bin/env python3
"""scripts/plot_metrics.py as a hurried user meets it: every bad input is refused with one line naming
the file (and line) and exit status 2, never a traceback; a NaN or infinite loss (null in the file) is
left out of the curve with a note; a last line cut short is left out with a note.

usage: check_plot_metrics.py PLOT_METRICS WORK_DIR"""
import json
import os
import shutil
import subprocess
import sys


def main() -> int:
    script, work = sys.argv[1], sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    good = [{"step": s, "tokens": 1000 * s, "ce": 2.0 - 0.01 * s, "seconds": 0.1} for s in range(1, 41)]
    good[19]["held_out_bpb"] = 2.5
    good[39]["held_out_bpb"] = 2.4

    def write(name, text):
        path = os.path.join(work, name)
        with open(path, "w" if isinstance(text, str) else "wb") as f:
            f.write(text)
        return path

    lines = "".join(json.dumps(r) + "\n" for r in good)
    ok = write("ok.jsonl", lines)
    nan = write("nan.jsonl", lines + '{"step": 41, "tokens": 41000, "ce": null, "seconds": 0.1}\n'
                                     '{"step": 42, "tokens": 42000, "ce": Infinity, "seconds": 0.1, "held_out_bpb": null}\n')
    cut = write("cut.jsonl", lines + '{"step": 41, "tokens": 4')
    out = os.path.join(work, "out.svg")
    cases = [  # (what, args, expected exit, text expected in the output)
        ("good file", ["-o", out, ok], 0, "wrote " + out),
        ("NaN and Infinity losses", ["-o", out, nan], 0, "3 losses are NaN or infinite"),
        ("a last line cut short", ["-o", out, cut], 0, "cut.jsonl:41: the last line is incomplete; left out"),
        ("binary file", ["-o", out, write("bin.jsonl", bytes(range(256)))], 2, "bin.jsonl: not text"),
        ("a JSON array", ["-o", out, write("array.jsonl", "[1, 2]\n")], 2, "array.jsonl:1: a JSON list, not an object"),
        ("a JSON number", ["-o", out, write("number.jsonl", "3\n")], 2, "number.jsonl:1: a JSON int, not an object"),
        ("bad line inside", ["-o", out, write("mid.jsonl", "{\n" + lines)], 2, "mid.jsonl:1: not a JSON line"),
        ("no step", ["-o", out, write("nostep.jsonl", '{"ce": 1}\n')], 2, "no 'step' or 'ce'"),
        ("a step that is not a number", ["-o", out, write("strstep.jsonl", '{"step": "x", "ce": 1, "tokens": 1}\n')], 2,
         "'step' is \"x\", not a number"),
        ("a loss that is a string", ["-o", out, write("strce.jsonl", '{"step": 1, "tokens": 1, "ce": "2.1"}\n')], 2,
         "'ce' is \"2.1\", not a number"),
        ("only NaN losses", ["-o", out, write("allnan.jsonl", '{"step": 1, "tokens": 1, "ce": null}\n')], 2,
         "no finite training loss"),
        ("empty file", ["-o", out, write("empty.jsonl", "")], 2, "empty.jsonl holds no step"),
        ("missing file", ["-o", out, os.path.join(work, "absent.jsonl")], 2, "absent.jsonl: no such file"),
        ("-o into a missing directory", ["-o", os.path.join(work, "no", "dir", "x.svg"), ok], 2, "no directory"),
        ("a directory as the metrics file", ["-o", out, work], 2, ": a directory, not a --metrics file"),
        ("JSON nested 100000 deep", ["-o", out, write("deep.jsonl", "[" * 100000 + "]" * 100000 + "\n")], 2,
         "deep.jsonl:1: JSON that cannot be read (nested too deep)"),
        ("a step of 400 digits", ["-o", out, write("d400.jsonl", '{"step": ' + "9" * 400 + ', "ce": 1}\n')], 2,
         "d400.jsonl:1: 'step' is 9999"),
        ("a step of 5000 digits", ["-o", out, write("digits.jsonl", '{"step": ' + "9" * 5000 + ', "ce": 1}\n')], 2,
         "digits.jsonl:1: JSON that cannot be read"),
    ]
    problems = []
    for what, args, code, text in cases:
        p = subprocess.run([sys.executable, script] + args, capture_output=True, text=True, timeout=60)
        both = p.stdout + p.stderr
        if p.returncode != code or text not in both or "Traceback" in both or \
                (code == 2 and not p.stderr.startswith("gshard plot_metrics: ")):
            problems.append(f"{what}: exit {p.returncode} (want {code}), want {text!r} in:\n{both[-1500:]}")
    with open(out) as f:
        svg = f.read()
    if "<polyline" not in svg or "held-out 2.400" not in svg:
        problems.append("the last SVG written lacks the curve or the held-out label")
    for p in problems:
        print("FAIL", p)
    print(f"{len(cases) - len(problems)} of {len(cases)} cases behaved")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
