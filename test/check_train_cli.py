#!/usr/bin/env python3
"""The trainer as a hurried user meets it (docs/07, the checklist): every bad
option value, path and text is refused before step 1 on every rank, naming
the option, the value and what is allowed; a damaged checkpoint step is
refused; SIGTERM or SIGINT to mpirun, or SIGTERM to one rank, stops every
rank after the same step, saves, says how to resume, exits non-zero, and the
saved run resumes; a second signal ends at once. Each run under a timeout.

usage: check_train_cli.py WORKDIR -- MPIEXEC [ARGS...] TRAINER"""
import gzip
import json
import os
import re
import shutil
import signal
import struct
import sys
import time

from checks import NO_KILL_GRACE, interrupted, rank_pids, refusal, run, run_refusals, verdict

SMALL = ["--batch", "4", "--seq", "32"]


def fnv1a(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def with_step(src, dst, value=None, rename=None):
    """A copy of checkpoint `src` whose metadata 'step' is `value` (or whose key is renamed), re-checksummed."""
    data = bytearray(open(src, "rb").read())
    at = 12
    (n_meta,) = struct.unpack_from("<Q", data, at)
    at += 8
    for _ in range(n_meta):
        (n,) = struct.unpack_from("<I", data, at)
        name = bytes(data[at + 4:at + 4 + n])
        if name == b"step":
            if rename:
                data[at + 4:at + 4 + n] = rename
            else:
                struct.pack_into("<d", data, at + 4 + n, value)
        at += 4 + n + 8
    body = data[:-(9 + 8)]
    open(dst, "wb").write(bytes(body) + b"GSHARDEND" + struct.pack("<Q", fnv1a(body)))


# OpenMPI 4.1.4's mpirun, given SIGTERM or SIGINT, sends the ranks SIGCONT at once, SIGTERM
# odls_base_sigkill_timeout (1 s) later and SIGKILL as long again after that, and stops reading
# the ranks' output from the start: a rank printing a line per step would fill the pipe and block
# before its SIGTERM comes, were it not for rank 0's stdout relay (one case below runs so). The
# other runs stopped through mpirun print a line every 10 steps, so their messages are forwarded.
# The step (~10 ms here), the save (~18 MB, ~60 ms) and the prints fit in the second between
# SIGTERM and SIGKILL.
SIGKILL_WAIT = {}


def main() -> int:
    sep = sys.argv.index("--")
    work = sys.argv[1]
    mpi, trainer = sys.argv[sep + 1:-1], sys.argv[-1]
    shutil.rmtree(work, ignore_errors=True)  # nothing from an earlier run (a checkpoint) may count
    os.makedirs(work)
    problems = []
    short = os.path.join(work, "short.txt")
    open(short, "w").write(open("/usr/share/common-licenses/GPL-3").read()[:5000])
    # The same text gzip-compressed, and cut short inside its compressed data.
    packed = os.path.join(work, "short.txt.gz")
    with gzip.open(packed, "wb") as f:
        f.write(open(short, "rb").read())
    truncated = os.path.join(work, "cut.txt.gz")
    open(truncated, "wb").write(open(packed, "rb").read()[:900])
    # A dictionary in dictd's format: 20 entries, indented continuation lines
    # and blank lines inside an entry; dictd's own header entry left out.
    dictionary = os.path.join(work, "tiny.dict")
    entries = ["00-database-short\n   a header entry\n\n"] + [
        f"Word{i} \\Word{i}\\, n.\n   {'a definition of the word ' * 5}\n\n   2. {'another sense, indented ' * 4}\n   [1913 Webster]\n\n"
        for i in range(20)]
    open(dictionary, "w").write("".join(entries))
    held_words = sum(fnv1a(f"word{i}".encode()) % 10 == 9 for i in range(20))  # a tenth of the headwords
    # The same with dictd's index beside it, and a header entry of unindented
    # paragraphs (as GCIDE's 00-database-info): the index alone says where
    # entries are.
    indexed = os.path.join(work, "indexed.dict")
    body = "00-database-info\n   converted from\n\nThe licence paragraph, unindented.\n\n" + "".join(entries[1:])
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(v):
        s = ""
        while True:
            s = digits[v % 64] + s
            v //= 64
            if v == 0:
                return s
    at = body.index("Word0")
    lines = [f"00-database-info\t{b64(0)}\t{b64(at)}"]
    for i in range(20):
        n = len(entries[i + 1]) - 2
        lines.append(f"Word{i}\t{b64(at)}\t{b64(n)}")
        at += n + 2
    open(indexed, "w").write(body)
    open(os.path.join(work, "indexed.index"), "w").write("\n".join(lines) + "\n")
    open(os.path.join(work, "bad.dict"), "w").write(body)
    open(os.path.join(work, "bad.index"), "w").write("Word0\tA\n")
    # An empty index beside its dictionary; a valid index beside a dictionary cut short.
    open(os.path.join(work, "noindex.dict"), "w").write(body)
    open(os.path.join(work, "noindex.index"), "w").write("")
    open(os.path.join(work, "cut.dict"), "w").write(body[:len(body) // 2])
    open(os.path.join(work, "cut.index"), "w").write("\n".join(lines) + "\n")
    # A dictionary of one headword, not among the held-out tenth: nothing held out.
    kept = next(f"word{i}" for i in range(20) if fnv1a(f"word{i}".encode()) % 10 != 9)
    open(os.path.join(work, "one.dict"), "w").write("".join(f"{kept} \\{kept}\\, n.\n   {'sense ' * 80}\n\n" for _ in range(12)))
    huge = os.path.join(work, "huge.txt")  # sparse: refused by its size, never read
    with open(huge, "wb") as f:
        f.truncate(3_000_000_000)
    empty_dir = os.path.join(work, "empty")
    os.makedirs(empty_dir, exist_ok=True)
    ckpt = os.path.join(work, "run.ckpt")
    base = mpi + [trainer]
    # Where the corpus is beside the point, the short text: reading the default dictionary takes a second.
    small = [short] + SMALL

    # Refused before step 1, on every rank (each message printed by rank 0 and rank 1). The refusals
    # found after the text is read take the short text: the default dictionary would add a second each.
    refused = [
        (["--steps", "1e3"], "--steps takes a whole number from 1 to 2147483647, not '1e3'"),
        (["--batch", "1.5"], "--batch takes a whole number from 1 to 2147483647, not '1.5'"),
        (["--steps", "3abc"], "not '3abc'"),
        (["--batch", "0"], "--batch takes a whole number from 1"),
        (["--steps", "abc"], "--steps takes a whole number from 1 to 2147483647, not 'abc'"),
        (["--aux-coef", "inf"], "--aux-coef takes a finite number >= 0, not 'inf'"),
        (["--weight-update", "zero"], "--weight-update is sharded or replicated, not 'zero'"),
        (["--attention", "flash"], "--attention is keep or recompute, not 'flash'"),
        (["--placement", "causal"], "--placement is by-choice or by-token, not 'causal'"),
        ([short, "--batch", "100000000"], "--batch 100000000 --seq 128 needs about"),
        # A model too large for the host: the option that costs the most is named, and only it.
        ([short, "--shared-experts", "100000"], ("--shared-experts 100000 needs about", "GiB less at the default --shared-experts), but",
                                                 "give a smaller --shared-experts")),
        ([short, "--experts", "100000"], ("--experts 100000 needs about", "give a smaller --experts")),
        ([short, "--layers", "100000", "--hidden", "512"], ("--layers 100000 needs about", "give a smaller --layers")),
        ([short, "--hidden", "100000000"], ("--hidden 100000000 needs about", "give a smaller --hidden")),
        ([short, "--optimizer", "adafactor", "--shared-experts", "100000"], "parameters, gradients and Adafactor"),
        (["--save-every", "5"], "--save-every needs --save FILE"),
        (["--stop-after", "3"], "--stop-after needs --save FILE"),
        ([short, "--save", "/nonexistent/x.ckpt"], "--save /nonexistent/x.ckpt: cannot write /nonexistent/x.ckpt: /nonexistent: No such file or directory"),
        ([short, "--save", work], f"--save {work}: {work} is a directory"),
        ([short, "--trace", "/nonexistent/t.json"], "--trace /nonexistent/t.json: cannot write"),
        ([short, "--trace", os.path.join(work, "t.json"), "--trace-step", "99", "--steps", "3"], "--trace-step 99 is after the last step (--steps 3)"),
        ([short, "--metrics", "/nonexistent/m.jsonl"], "--metrics /nonexistent/m.jsonl: cannot open it for writing: No such file or directory"),
        ([short, "--seq", "600"], "--seq 600 needs windows of 601 bytes, but the text's held-out part has 500 bytes"),
        # An output naming an input or another output: refused before anything is written.
        ([short, "--seq", "32", "--metrics", short], f"--metrics {short} is the training text; writing it would destroy it"),
        ([short, "--seq", "32", "--save", short], f"--save {short} is the training text; writing it would destroy it"),
        ([short, "--save", os.path.join(work, "o.ckpt"), "--trace", os.path.join(work, "o.ckpt")],
         f"--trace {os.path.join(work, 'o.ckpt')} is also --save's file; give each its own"),
        ([truncated], f"cannot read {truncated}: unexpected end of file"),
        ([os.path.join(work, "bad.dict")], "bad.index:1: not a dictd index line (headword, offset, length)"),
        ([os.path.join(work, "noindex.dict")], f"{work}/noindex.index lists no entry for the {len(body)} bytes of {work}/noindex.dict"),
        ([os.path.join(work, "cut.dict")], f"{work}/cut.dict holds {len(body) // 2} bytes, but {work}/cut.index:"),
        ([os.path.join(work, "one.dict")], "the text's held-out part has 0 bytes: give a longer text"),
        ([huge], f"{huge} holds 3000000000 bytes; at most 2147483647 are read"),
        (["--slot-hidden", "512"], "--slot-hidden 512 is for a dense model; give --experts 0"),
        (["--remat", "4"], "--remat is none, all, or blocks from 0 to 3 separated by commas (1,3); not '4'"),
        (["--layers", "2", "--remat", "0,x"], "--remat is none, all, or blocks from 0 to 1 separated by commas (1,3); not '0,x'"),
        (["--layers", "0"], "--layers takes a whole number from 1"),
        (["--bucket-kib", "-1"], "--bucket-kib takes a whole number from 0 to 1073741824, not '-1'"),
        (["--overlap-degree", "0"], "--overlap-degree takes a whole number from 1 to 65536, not '0'"),
        (["--micro-batches", "3"], "--micro-batches takes a whole number from 1 to 2, not '3'"),
        (["--micro-batches", "2", "--remat", "all"], "config.micro_batches = 2 with blocks in config.remat"),
        (["--sample-temperature", "-1"], "--sample-temperature takes a finite number >= 0, not '-1'"),
        (["--eval-every", "-5"], "--eval-every takes a whole number from 0"),
        (["/nonexistent.txt"], "cannot open /nonexistent.txt: No such file or directory"),
        ([empty_dir], f"{empty_dir} holds no regular file"),
        ([short, "--resume", work], f"gshard::checkpoint: {work}: cannot read {work}: Is a directory"),
        (["--stpes", "3"], "unknown option --stpes"),
        (["--top-k"], "--top-k needs a value"),
        (["--optimizer", "sgd"], "--optimizer is adam or adafactor, not 'sgd'"),
        (["--precision", "fp16"], "--precision is f32 or bf16, not 'fp16'"),
        (["--gradient-wire", "fp8"], "--gradient-wire is f32 or bf16, not 'fp8'"),
        (["--all-to-all-wire", "bf8"], "--all-to-all-wire is f32 or bf16, not 'bf8'"),
        (["--all-to-all-slots", "some"], "--all-to-all-slots is filled or all, not 'some'"),
        (["--weight-wire", "fp16"], "--weight-wire is f32 or bf16, not 'fp16'"),
        (["--lr", "0"], "--lr takes a finite number from 1e-09 to 1, not '0'"),
        ([short, short], f"two texts given, '{short}' and '{short}'; give one file or directory"),
        (["-s", "3"], "unknown option -s (--help lists them)"),
    ]
    short_bytes = open(short, "rb").read()
    problems += run_refusals(base, refused)
    if open(short, "rb").read() != short_bytes:
        problems.append(f"{short} changed: a refused run wrote to its training text")
    # Compressed and dictionary corpora; a held-out evaluation every step in the
    # metrics; no sample with --sample-bytes 0, a held-out prompt otherwise.
    metrics = os.path.join(work, "m.jsonl")
    code, out = run(base + [packed, "--steps", "2", "--eval-every", "1", "--metrics", metrics, "--sample-bytes", "0"] + SMALL)
    lines = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
    if code != 0 or f"text: {packed} (the last 10% held out)" not in out or "sample" in out or len(lines) != 2 or \
            not all("held_out_bpb" in l and l["mfu"] > 0 and l["grad_norm"] > 0 and l["tokens"] == 128 * l["step"] for l in lines):
        problems.append(f"a gzip text with --eval-every 1 --metrics: exit {code}, metrics {lines}:\n{out[-1500:]}")
    code, out = run(base + [dictionary, "--steps", "3", "--sample-bytes", "8", "--sample-temperature", "0"] + SMALL)
    if code != 0 or f"text: {dictionary}, 20 dictionary entries ({held_words} held out: a tenth of the headwords)" not in out or \
            "held-out at step" in out or "sample (prompt: " not in out or "temperature 0)" not in out:
        problems.append(f"a dictionary, greedy sampling: exit {code}:\n{out[-1500:]}")
    # bf16 GEMMs: the machine line says where they run (fp32 where the GEMM has no bf16 units),
    # and that the all_to_alls carry bf16; the optimizer's line, that the gradients do.
    code, out = run(base + [dictionary, "--steps", "2", "--sample-bytes", "0", "--precision", "bf16", "--gradient-wire", "bf16"] + SMALL)
    if code != 0 or not re.search(r"machine: fp32 FMA peak .*, gemm \w+ in (bf16 \(fp32 sums|fp32 \(--precision bf16).*, MoE all_to_alls in bf16", out) or \
            "held-out loss" not in out or not re.search(r"optimizer: .*, gradients reduced in bf16, bf16 weights with fp32 masters", out):
        problems.append(f"--precision bf16 --gradient-wire bf16: exit {code}:\n{out[-1500:]}")
    # The all_to_alls' and the weights' wires apart from the GEMMs' precision, both ways.
    for args, bf16_gemms, bf16_wire, bf16_weights in [
            (["--all-to-all-wire", "bf16", "--weight-wire", "bf16"], False, True, True),
            (["--precision", "bf16", "--all-to-all-wire", "f32"], True, False, True),
            (["--precision", "bf16", "--weight-wire", "f32"], True, True, False)]:
        code, out = run(base + ["--steps", "2", "--sample-bytes", "0", "--eval-every", "0"] + args + small)
        machine = next((l for l in out.splitlines() if l.startswith("machine: ")), "")
        optimizer = next((l for l in out.splitlines() if l.startswith("optimizer: ")), "")
        if code != 0 or (", MoE all_to_alls in bf16" in machine) != bf16_wire or \
                bool(re.search(r"gemm \w+ in (bf16|fp32 \(--precision bf16)", machine)) != bf16_gemms or \
                (", bf16 weights with fp32 masters" in optimizer) != bf16_weights:
            problems.append(f"{' '.join(args)}: exit {code}, machine line '{machine}', optimizer line '{optimizer}':\n{out[-1500:]}")
    code, out = run(base + [indexed, "--steps", "2", "--sample-bytes", "0"] + SMALL)
    if code != 0 or f"text: {indexed}, 20 dictionary entries (by its .index) ({held_words} held out" not in out:
        problems.append(f"a dictionary with its index: exit {code}:\n{out[-1500:]}")
    # A dense model: no routing in its lines, and a note for the first MoE
    # option given (two micro-batches overlap nothing without all_to_alls,
    # so they are no reason to refuse --remat there).
    code, out = run(base + ["--experts", "0", "--slot-hidden", "64", "--micro-batches", "2", "--remat", "all", "--top-k", "1",
                            "--steps", "2", "--log-every", "1", "--sample-bytes", "0"] + small)
    if code != 0 or "dense: H=256, blocks 1, 3, ...: H=64" not in out or "aux" in out or "dropped" in out or \
            "--micro-batches (and every MoE option) has no effect with --experts 0" not in out or "step     2" not in out:
        problems.append(f"a dense model (--experts 0 --slot-hidden 64): exit {code}:\n{out[-1500:]}")
    # Rematerialised blocks: said in the header, the same losses as kept ones;
    # so do gradients in buckets of 1 KiB, reduced while the backward computes,
    # and attention's probabilities computed again in the backward.
    losses = []
    for remat in ([], ["--remat", "all"], ["--bucket-kib", "1"], ["--attention", "recompute"]):
        code, out = run(base + ["--layers", "2", "--steps", "2", "--log-every", "1", "--sample-bytes", "0"] + remat + small)
        losses.append(re.findall(r"step +2  loss (\S+)", out))
        if code != 0 or ("--remat" in remat and "rematerialised blocks: 0, 1 (each keeps its input" not in out) or \
                ("--attention" in remat and "attention: each block's probabilities computed again" not in out):
            problems.append(f"--layers 2 {' '.join(remat)}: exit {code}:\n{out[-1500:]}")
    if not losses[0] or any(l != losses[0] for l in losses[1:]):
        problems.append(f"--remat all, --bucket-kib 1 or --attention recompute changed the losses: {losses}")
    # The same model to rounding, said in the header: the all_to_alls pipelined with the experts in 3
    # chunks (the experts' GEMMs run on fewer rows at a time, and each chunk adds its share of the
    # weights' gradients), and two micro-batches interleaved.
    for option, header in ((["--overlap-degree", "3"], "all_to_alls in up to 3 chunks of the capacity"),
                           (["--micro-batches", "2"], "each rank's batch in two interleaved micro-batches")):
        code, out = run(base + ["--layers", "2", "--steps", "2", "--log-every", "1", "--sample-bytes", "0"] + option + small)
        loss = re.findall(r"step +2  loss (\S+)", out)
        if code != 0 or header not in out or not loss or not losses[0] or abs(float(loss[0]) - float(losses[0][0])) > 2e-4:
            problems.append(f"{' '.join(option)}: exit {code}, loss {loss} against {losses[0]}:\n{out[-1500:]}")
    for var, value, want in [("GSHARD_GEMM", "fast", "GSHARD_GEMM=fast is not allowed; use eigen"),
                             # Below a second, a healthy collective could be taken for a stuck one.
                             ("GSHARD_WATCHDOG", "0.001", "GSHARD_WATCHDOG=0.001 is not allowed; use a number of seconds >= 1, or 0 (off)")]:
        code, out = run(base + ["--steps", "2"], env={var: value, **NO_KILL_GRACE}, timeout=60)
        if wrong := refusal(code, out, want):
            problems.append(f"{var}={value}: {wrong}:\n{out[-1500:]}")

    # A run to stop: SIGTERM to mpirun after the first progress line.
    args = small + ["--steps", "3000", "--log-every", "10", "--save", ckpt]
    code, out = interrupted(mpi, trainer, args, lambda p: p.send_signal(signal.SIGTERM), env=SIGKILL_WAIT)
    if code in (None, 0) or "stopped by SIGTERM after step" not in out or "saved " + ckpt not in out or \
            "resume with the same options and --resume " + ckpt not in out or not os.path.exists(ckpt):
        problems.append(f"SIGTERM to mpirun: exit {code}:\n{out[-2500:]}")
    stopped = [l for l in out.splitlines() if l.startswith("stopped by")]
    step = int(stopped[0].split("after step ")[1].split()[0]) if stopped else -1
    code, out = run(base + small + ["--steps", "3000", "--resume", ckpt, "--stop-after", str(step + 2), "--save", ckpt,
                                   "--log-every", "1"])
    grace = "note: SIGTERM or Ctrl-C to mpirun leaves the ranks 1 s to stop and save before SIGKILL"
    said = grace in out or "OMPI_MCA_odls_base_sigkill_timeout" in os.environ  # OpenMPI's default: said
    if code != 0 or f"resumed {ckpt} at step {step}" not in out or f"step {step + 1:5d}" not in out or not said:
        problems.append(f"resume after SIGTERM at step {step} (and the launcher's grace said): exit {code}:\n{out[-2500:]}")

    # --save-every dividing the last step: saved once there, not twice.
    every = os.path.join(work, "every.ckpt")
    code, out = run(base + small + ["--steps", "4", "--save-every", "2", "--save", every, "--sample-bytes", "0"])
    if code != 0 or out.count(f"saved {every} at step 2") != 1 or out.count(f"saved {every} at step 4") != 1:
        problems.append(f"--save-every 2 --steps 4: exit {code}, wanted one save at steps 2 and 4:\n{out[-1500:]}")
    # A metrics file that cannot be written (a full disk): the checkpoint is saved first, then the run ends.
    full = os.path.join(work, "full.ckpt")
    code, out = run(base + small + ["--steps", "5", "--metrics", "/dev/full", "--save", full, "--sample-bytes", "0"],
                    env=NO_KILL_GRACE)
    want = f"--metrics /dev/full: writing failed: No space left on device; saved {full} at step 1"
    if wrong := refusal(code, out.replace("step     1", ""), want):
        problems.append(f"--metrics /dev/full: {wrong}:\n{out[-1500:]}")
    elif not os.path.exists(full):
        problems.append(f"--metrics /dev/full: no checkpoint {full}:\n{out[-1500:]}")

    # A progress line every step: once signalled, mpirun stops reading the ranks' output, and a
    # rank printing into the full pipe would block before its step boundary. Rank 0's output goes
    # through a relay thread, so the checkpoint is still written (what mpirun no longer forwards
    # cannot be checked here: the file can).
    every_step = os.path.join(work, "every_step.ckpt")
    code, out = interrupted(mpi, trainer, small + ["--steps", "100000", "--log-every", "1", "--save", every_step],
                            lambda p: (time.sleep(0.5), p.send_signal(signal.SIGTERM)), env=SIGKILL_WAIT)
    if code in (None, 0) or not os.path.exists(every_step):
        problems.append(f"SIGTERM to mpirun with --log-every 1: exit {code}, checkpoint written: "
                        f"{os.path.exists(every_step)}:\n{out[-2500:]}")

    # SIGINT to mpirun (Ctrl-C): mpirun passes it on; the ranks stop the same way.
    code, out = interrupted(mpi, trainer, args, lambda p: p.send_signal(signal.SIGINT), env=SIGKILL_WAIT)
    if code in (None, 0) or "stopped by SIG" not in out or "saved " + ckpt not in out:
        problems.append(f"SIGINT to mpirun: exit {code}:\n{out[-2500:]}")

    # SIGTERM to the last rank only: every rank stops after the same step.
    def last_rank(p):
        pids = rank_pids(p.pid)
        if pids:
            os.kill(pids[max(pids)], signal.SIGTERM)
    # The signal itself is not said: a launcher ending a job after one rank's fault signals the
    # others too, and a line from each would promise a stop that never comes.
    code, out = interrupted(mpi, trainer, args, last_rank, env=SIGKILL_WAIT)
    if code in (None, 0) or "received" in out or out.count("stopped by SIGTERM after step") != 1 or \
            "saved " + ckpt not in out:
        problems.append(f"SIGTERM to one rank: exit {code}:\n{out[-2500:]}")

    # A stop during a long evaluation: the evaluation is cut short (no held-out figure in the
    # metrics' line of that step) and the run saves.
    long_eval, long_metrics = os.path.join(work, "long_eval.ckpt"), os.path.join(work, "long_eval.jsonl")
    code, out = interrupted(mpi, trainer, SMALL + ["--steps", "3000", "--eval-every", "2", "--eval-batches", "100000",
                                                   "--metrics", long_metrics, "--save", long_eval],
                            lambda p: p.send_signal(signal.SIGTERM), env=SIGKILL_WAIT)
    lines = [json.loads(l) for l in open(long_metrics)] if os.path.exists(long_metrics) else []
    if code in (None, 0) or "stopped by SIGTERM after step 2 of 3000" not in out or not os.path.exists(long_eval) or \
            len(lines) != 2 or any("held_out_ce" in l for l in lines):
        problems.append(f"SIGTERM during an evaluation of 100000 batches: exit {code}, metrics {lines}:\n{out[-2500:]}")

    # Without --save: it says nothing was saved.
    code, out = interrupted(mpi, trainer, small + ["--steps", "3000", "--log-every", "10"],
                            lambda p: p.send_signal(signal.SIGTERM), env=SIGKILL_WAIT)
    if code in (None, 0) or "nothing saved: no --save FILE was given" not in out:
        problems.append(f"SIGTERM without --save: exit {code}:\n{out[-2500:]}")

    # A second signal ends at once: SIGTERM to one rank in the middle of a long step (a step of 128 x 256
    # bytes takes 2 s on a Xeon core with AVX-512, 4 s on Zen 3; the signals come 0.2 s after the progress
    # line, 0.1 s apart: at 1 s after it, a step of 64 x 256 could end between them), so the first is only
    # noted and the second ends the rank before the step is done: mpirun reports the rank ended by the
    # signal, and nothing is saved.
    def twice(p):
        time.sleep(0.2)
        pids = rank_pids(p.pid)
        if pids:
            os.kill(pids[max(pids)], signal.SIGTERM)
            time.sleep(0.1)
            os.kill(pids[max(pids)], signal.SIGTERM)
    second = os.path.join(work, "second.ckpt")
    code, out = interrupted(mpi, trainer, ["--batch", "128", "--seq", "256", "--steps", "3000", "--log-every", "1",
                                           "--save", second], twice)
    if code in (None, 0) or "exited on signal 15" not in out or "stopped by" in out or os.path.exists(second):
        problems.append(f"a second SIGTERM: exit {code}:\n{out[-2500:]}")

    # Damaged metadata: a step that is NaN, negative or missing.
    for name, kw, want in [("nan", {"value": float("nan")}, "its step nan is not a whole number"),
                           ("negative", {"value": -3.0}, "its step -3.000000 is not a whole number"),
                           ("missing", {"rename": b"stap"}, "has no step in its metadata")]:
        bad = os.path.join(work, f"step_{name}.ckpt")
        if not os.path.exists(ckpt):
            problems.append(f"no checkpoint {ckpt} to damage")
            break
        with_step(ckpt, bad, **kw)
        code, out = run(base + small + ["--resume", bad, "--steps", "10"], env=NO_KILL_GRACE)
        if wrong := refusal(code, out, want):
            problems.append(f"checkpoint with a {name} step: {wrong}:\n{out[-1500:]}")
    # Another optimizer than the checkpoint's: refused, naming both; Adafactor
    # saves and resumes its own state.
    if os.path.exists(ckpt):
        code, out = run(base + small + ["--resume", ckpt, "--steps", "3000", "--optimizer", "adafactor"], env=NO_KILL_GRACE)
        want = f"{ckpt} holds the state of --optimizer adam, but this run uses --optimizer adafactor; resume with --optimizer adam"
        if wrong := refusal(code, out, want):
            problems.append(f"an Adam checkpoint resumed with --optimizer adafactor: {wrong}:\n{out[-1500:]}")
    factored = os.path.join(work, "adafactor.ckpt")
    code, out = run(base + small + ["--optimizer", "adafactor", "--steps", "4", "--stop-after", "2", "--save", factored,
                                    "--sample-bytes", "0"])
    code2, out2 = run(base + small + ["--optimizer", "adafactor", "--steps", "4", "--resume", factored, "--sample-bytes", "0"])
    code3, out3 = run(base + small + ["--steps", "4", "--resume", factored, "--sample-bytes", "0"])
    # Resumed with another --seed and --steps, and one block with experts: said.
    code4, out4 = run(base + small + ["--optimizer", "adafactor", "--steps", "5", "--seed", "7", "--resume", factored,
                                      "--sample-bytes", "0"])
    code5, out5 = run(base + small + ["--layers", "1", "--top-k", "1", "--steps", "1", "--sample-bytes", "0"])
    for c, o, note in [(code4, out4, "note: the checkpoint was trained with --seed 1; this run uses --seed 7"),
                       (code4, out4, "note: the checkpoint was trained with --steps 4; this run uses --steps 5"),
                       (code5, out5, "note: --layers 1 has no MoE block (blocks 1, 3, ... hold the MoE layers): the model is "
                                     "dense, and --top-k (every MoE option) has no effect")]:
        if c != 0 or note not in o:
            problems.append(f"wanted '{note}': exit {c}:\n{o[-1500:]}")
    if code != 0 or code2 != 0 or f"resumed {factored} at step 2" not in out2 or "optimizer: Adafactor" not in out2 or \
            code3 in (None, 0) or "holds the state of --optimizer adafactor, but this run uses --optimizer adam" not in out3:
        problems.append(f"Adafactor saved and resumed: exits {code}, {code2}, {code3}:\n{out[-800:]}\n{out2[-800:]}\n{out3[-800:]}")
    # Weights in fp32 resumed as bf16 (the masters taken from the weights),
    # and bf16 weights with their masters resumed in fp32.
    code6, out6 = run(base + small + ["--optimizer", "adafactor", "--steps", "4", "--resume", factored, "--sample-bytes", "0",
                                      "--weight-wire", "bf16", "--stop-after", "3", "--save", factored])
    code7, out7 = run(base + small + ["--optimizer", "adafactor", "--steps", "4", "--resume", factored, "--sample-bytes", "0"])
    if code6 != 0 or code7 != 0 or f"resumed {factored} at step 2" not in out6 or ", bf16 weights with fp32 masters" not in out6 or \
            f"resumed {factored} at step 3" not in out7 or "bf16 weights" in out7:
        problems.append(f"fp32 weights resumed as bf16 and back: exits {code6}, {code7}:\n{out6[-800:]}\n{out7[-800:]}")
    return verdict(problems, 2)


if __name__ == "__main__":
    sys.exit(main())
