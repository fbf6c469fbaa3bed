#!/usr/bin/env python3
"""Run an MPI program that must fail: require a non-zero exit well inside the
timeout and the expected text (rank and message) in its output. With --usage,
a usage error: exit status 2, each text said once, no MPI_Abort.

usage: expect_abort.py TIMEOUT_SECONDS [--usage] EXPECTED_TEXT [EXPECTED_TEXT...] -- MPIEXEC [ARGS...]
"""
import os
import subprocess
import sys
import time

from checks import NO_KILL_GRACE, refusal


def main() -> int:
    sep = sys.argv.index("--")
    timeout = float(sys.argv[1])
    usage = sys.argv[2] == "--usage"
    expected = sys.argv[2 + usage:sep]
    cmd = sys.argv[sep + 1:]
    start = time.monotonic()
    try:
        env = dict(os.environ, **NO_KILL_GRACE) if usage else None
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, out = None, (e.stdout or b"").decode() + (e.stderr or b"").decode()
    took = time.monotonic() - start
    if usage:
        wrong = refusal(code, out, *expected)
        missing = [wrong] if wrong else []
    else:
        missing = [e for e in expected if e not in out]
    ok = code not in (None, 0) and not missing
    print(f"exit code {code} after {took:.1f} s (limit {timeout:.0f} s)")
    for e in missing:
        print(f"wrong: {e}" if usage else f"missing text: {e!r}")
    if not ok:
        print(out[-4000:])
    print(f"gshard-test-summary: passed={int(ok)} failed={int(not ok)} ranks=0")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
