#!/usr/bin/env python3
"""Compile one misuse case and require that the compiler rejects it with the
expected diagnostic. Prints 'gshard-test-summary: passed=1 failed=0' (or the
reverse) so scripts/test can count it with the other test cases.

usage: compile_fail.py SOURCE CASE EXPECTED_TEXT [EXPECTED_TEXT...] -- COMPILER [FLAGS...]
"""
import subprocess
import sys


def main() -> int:
    sep = sys.argv.index("--")
    source, case, *expected = sys.argv[1:sep]
    compiler = sys.argv[sep + 1:]
    cmd = compiler + ["-fsyntax-only", f"-DGSHARD_CASE_{case}", source]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    missing = [e for e in expected if e not in out]
    ok = proc.returncode != 0 and not missing
    if not ok:
        print(f"compile-fail case {case}: compiler exit {proc.returncode}")
        for e in missing:
            print(f"  missing text: {e!r}")
        print("\n".join(out.splitlines()[:60]))
    else:
        print(f"compile-fail case {case}: rejected with {expected!r}")
    print(f"gshard-test-summary: passed={int(ok)} failed={int(not ok)} ranks=0")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
