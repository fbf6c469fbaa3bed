"""What the test scripts share: the verdict line scripts/summarize.py reads, and
running a program under a timeout (to its end, or until its first progress
line and a signal)."""
import os
import subprocess
import time


def verdict(problems, ranks):
    """Prints each problem and the summary line; returns the exit code."""
    for p in problems:
        print(p)
    ok = not problems
    print(f"gshard-test-summary: passed={int(ok)} failed={int(not ok)} ranks={ranks}")
    return 0 if ok else 1


def run(cmd, timeout=90, env=None):
    """Runs cmd to its end under a timeout; returns (exit code or None, stdout + stderr)."""
    e = dict(os.environ, **(env or {}))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as t:
        return None, (t.stdout or b"").decode(errors="replace") + (t.stderr or b"").decode(errors="replace")


# For runs whose ranks all end by themselves (a usage error): OpenMPI's
# mpirun otherwise waits its SIGTERM-to-SIGKILL grace (1 s) twice after a
# rank's non-zero exit, for ranks already gone — 2 of a refusal's 2.7 s.
# Never for the signal tests: the grace is what lets the ranks save.
NO_KILL_GRACE = {"OMPI_MCA_odls_base_sigkill_timeout": "0"}


def refusal(code, out, *wants):
    """'' when a run was refused as a usage error: each of `wants` said once (by rank 0), exit
    status 2, no MPI_Abort, no 'uncaught exception' banner and no training step; else what went
    wrong."""
    wrong = []
    if code != 2:
        wrong.append(f"exit {code}, not 2")
    for want in wants:
        lines = sum(want in line for line in out.splitlines())
        if lines != 1:
            wrong.append(f"'{want}' on {lines} lines, not one")
    for noise in ("MPI_ABORT", "MPI_Abort", "uncaught exception", "step     1"):
        if noise in out:
            wrong.append(f"'{noise}' in the output")
    return "; ".join(wrong)


def run_refusals(base, cases, timeout=90):
    """Runs base + args for each (args, want) of `cases` (want: a text or a tuple of texts), eight at a time (each run waits mostly on
    mpirun's start and end); returns a problem for each that was not refused as refusal() says."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: run(base + case[0], timeout=timeout, env=NO_KILL_GRACE), cases))
    return [f"{' '.join(args)}: {wrong}:\n{out[-1500:]}" for (args, want), (code, out) in zip(cases, results)
            if (wrong := refusal(code, out, *([want] if isinstance(want, str) else want)))]


def rank_pids(launcher):
    """The MPI ranks among the launcher's descendants, by their OpenMPI or PMI rank: found through the
    launcher's own process tree (parent ids in /proc), so another job's processes are never touched."""
    children = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    pids, todo = {}, list(children.get(launcher, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(b"OMPI_COMM_WORLD_RANK=") or kv.startswith(b"PMI_RANK="):
                pids[int(kv.split(b"=")[1])] = pid
    return pids


def interrupted(mpi, trainer, args, send, timeout=120, env=None):
    """Starts the trainer, waits for its first progress line, then `send(proc)`; returns (code, output)."""
    p = subprocess.Popen(mpi + [trainer] + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, **(env or {})))
    out, start = "", time.monotonic()
    while time.monotonic() - start < timeout:
        line = p.stdout.readline()
        if not line:
            break
        out += line
        if line.startswith("step "):
            send(p)
            break
    try:
        rest, _ = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))
        return p.returncode, out + rest
    except subprocess.TimeoutExpired:
        p.kill()
        return None, out + "\n(killed: timeout)"
