#!/usr/bin/env python3
"""examples/translate as a user meets it, on four small FreeDict languages:
bad options refused before step 1 on every rank, naming the option and the
value; a run that learns (its loss falls), evaluates every language at the
steps asked (bits per byte, exact matches and chrF of greedy and beam
decoding), writes its metrics and a checkpoint; the checkpoint resumes, and
is refused for other languages; SIGTERM stops, saves and says how to resume.

usage: check_translate.py WORKDIR RANKS -- MPIEXEC [ARGS...] PROGRAM"""
import json
import os
import re
import shutil
import signal
import sys

from checks import interrupted, run, run_refusals, verdict

LANGS = ["--languages", "kha,srp,gle,ces"]
SMALL = LANGS + ["--eval-sentences", "8", "--log-every", "10", "--show", "2"]


def main() -> int:
    sep = sys.argv.index("--")
    work, ranks = sys.argv[1], int(sys.argv[2])
    base = sys.argv[sep + 1:]
    missing = [l for l in ("kha", "srp", "gle", "ces", "slk") if not os.path.exists(f"/usr/share/dictd/freedict-{l}-eng.dict.dz")]
    if missing:  # scripts/setup installs them as root
        reason = " ".join(f"dict-freedict-{l}-eng" for l in missing) + " not installed"
        print(f'gshard-test-summary: skipped reason="{reason}"')
        return 77
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    problems = []
    ckpt, metrics = os.path.join(work, "run.ckpt"), os.path.join(work, "m.jsonl")

    refused = [
        (["--languages", "xyz"], "freedict-xyz-eng"),
        (["--languages", "kha,,srp"], "--languages 'kha,,srp' has an empty code"),
        (["--dropout", "1.5"], "--dropout takes a finite number from 0 to 0.99, not '1.5'"),
        (["--steps", "0"], "--steps takes a whole number from 1"),
        (["--temperature", "nan"], "--temperature takes a finite number"),
        (["--bogus"], "unknown option --bogus (--help lists them)"),
        (["corpus.txt"], "takes options only, not 'corpus.txt'"),
        (["--save-every", "5"], "--save-every needs --save FILE"),
        (["--experts", "8", "--slot-hidden", "64"], "--slot-hidden 64 is for a dense model; give --experts 0"),
        (["--experts", "1"], "--experts 1: top-2 routing needs 2 experts or more"),
        (["--model", "130"], "--model 130 is not a multiple of 4"),
        (["--experts", "65536"], ("--experts 65536 --layers 2 --batch 64 --max-bytes 32 needs about", "give smaller sizes")),
        (["--languages", "kha,kha"], "--languages names kha twice"),
        (["--resume", work], f"--resume {work}: not a file"),
        (LANGS + ["--max-bytes", "1"], "has no training pair of at most --max-bytes 1 bytes a side"),
        (LANGS + ["--resume", os.path.join(work, "missing.ckpt")], f"--resume {os.path.join(work, 'missing.ckpt')}: no such file"),
        (["--metrics", "/usr/share/dictd/freedict-kha-eng.index"],
         "--metrics /usr/share/dictd/freedict-kha-eng.index is a dictionary; writing it would destroy it"),
        (["--resume", ckpt, "--metrics", ckpt], f"--metrics {ckpt} is the --resume checkpoint; writing it would destroy it"),
        (["--save", metrics, "--metrics", metrics], f"--metrics {metrics} is also --save's file; give each its own"),
        (["--save", os.path.join(work, "no", "dir", "c.ckpt")], os.path.join(work, "no", "dir", "c.ckpt")),
    ]
    problems += run_refusals(base, refused)

    # A run: four languages, evaluated at steps 20 and 40, metrics and a checkpoint.
    code, out = run(base + SMALL + ["--steps", "40", "--eval-every", "20", "--metrics", metrics, "--save", ckpt], timeout=240)
    losses = [float(v) for v in re.findall(r"^step +\d+  loss ([0-9.]+)", out, re.M)]
    lines = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
    evals = [l for l in lines if "eval" in l]
    keys = {"pairs", "bpb", "exact_greedy", "exact_beam", "chrf_greedy", "chrf_beam"}
    means = {"bpb", "exact_greedy", "exact_beam", "chrf_greedy", "chrf_beam"}
    if code != 0 or "4 languages into English" not in out or len(losses) < 3 or not losses[-1] < losses[0] - 1 or \
            "held-out at step 20" not in out or "held-out at step 40" not in out or f"saved {ckpt} at step 40" not in out or \
            len(lines) != 40 or [l["step"] for l in evals] != [20, 40] or \
            any(sorted(e["eval"]) != ["ces", "gle", "kha", "srp"] or any(set(v) != keys for v in e["eval"].values()) or
                set(e.get("eval_mean", {})) != means for e in evals) or \
            not all(0 <= v["chrf_greedy"] <= 100 and v["bpb"] > 0 for e in evals for v in e["eval"].values()) or \
            len(re.findall(r"^  \[(kha|srp|gle|ces)\] .+ -> .*  \(.+\)$", out, re.M)) < 2:
        problems.append(f"a run of 40 steps: exit {code}, losses {losses}, {len(lines)} metrics lines, evaluations at "
                        f"{[l['step'] for l in evals]}:\n{out[-3000:]}")
    for lang in ("kha", "srp", "gle", "ces"):
        if not re.search(rf"^  {lang} +[0-9.]+ +[0-9.]+% +[0-9.]+% +[0-9.]+ +[0-9.]+$", out, re.M):
            problems.append(f"no held-out line for {lang}")

    # The checkpoint resumes; other languages are refused.
    code, out = run(base + SMALL + ["--steps", "45", "--eval-every", "0", "--resume", ckpt, "--log-every", "1"], timeout=240)
    if code != 0 or f"resumed {ckpt} at step 40" not in out or "step    41" not in out or "step    40 " in out:
        problems.append(f"resume at step 40: exit {code}:\n{out[-2000:]}")
    code, out = run(base + ["--languages", "kha,srp,gle,slk", "--eval-sentences", "8", "--steps", "45", "--resume", ckpt],
                    timeout=120)
    if code in (None, 0) or "was trained on 4 other languages; give the same --languages" not in out or "step    41" in out:
        problems.append(f"resume with other languages: exit {code}:\n{out[-2000:]}")

    # A dense model: no routing in its lines.
    code, out = run(base + SMALL + ["--experts", "0", "--slot-hidden", "512", "--steps", "2", "--log-every", "1"], timeout=120)
    if code != 0 or "dense: H 256, blocks 1, 3, ...: H 512" not in out or "aux" in out or "dropped" in out:
        problems.append(f"a dense model: exit {code}:\n{out[-2000:]}")

    # SIGTERM to mpirun after the first progress line: stopped, saved, resumable.
    stopped_ckpt = os.path.join(work, "stopped.ckpt")
    code, out = interrupted(base[:-1], base[-1], SMALL + ["--steps", "100000", "--log-every", "1", "--save", stopped_ckpt],
                            lambda p: p.send_signal(signal.SIGTERM))
    if code in (None, 0) or "stopped by SIGTERM after step" not in out or f"saved {stopped_ckpt}" not in out or \
            f"resume with the same options and --resume {stopped_ckpt}" not in out:
        problems.append(f"SIGTERM: exit {code}:\n{out[-2000:]}")
    return verdict(problems, ranks)


if __name__ == "__main__":
    sys.exit(main())
