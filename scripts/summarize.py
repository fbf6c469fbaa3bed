#!/usr/bin/env python3
"""Adds up the test cases of meson test runs (one testlog.json per build): every test prints
"gshard-test-summary: passed=N failed=M"; a test that died before printing
it counts as one failed case; a skipped test (exit 77) is listed with its
reason and counted as neither. Ends with "N passed, N failed"."""
import json
import re
import sys

LINE = re.compile(r"gshard-test-summary: passed=(\d+) failed=(\d+)")
SKIP = re.compile(r'gshard-test-summary: skipped reason="([^"]*)"')


def main(paths: list) -> int:
    passed = failed = 0
    for path in paths:
        build = path.split("/meson-logs")[0]
        with open(path) as f:
            for raw in f:
                t = json.loads(raw)
                if t["result"] == "SKIP":  # the test said why it cannot run here
                    reason = SKIP.search(t.get("stdout") or "")
                    print(f"  {build:<11} {t['name']:<45} SKIP     {reason.group(1) if reason else ''}")
                    continue
                found = LINE.findall(t.get("stdout") or "")
                p = sum(int(a) for a, _ in found)
                q = sum(int(b) for _, b in found)
                if t["result"] != "OK" and q == 0:
                    q = 1  # died, timed out, or failed outside a test case
                if not found and t["result"] == "OK":
                    p = 1
                passed += p
                failed += q
                print(f"  {build:<11} {t['name']:<45} {t['result']:<8} {p} passed, {q} failed")
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
