#!/usr/bin/env python3
"""Compile misuse cases and require that the compiler rejects each with its
expected diagnostic. Prints 'gshard-test-summary: passed=N failed=M' so
scripts/test can count them with the other test cases.

usage: compile_fail.py SOURCE --case NAME TEXT [TEXT...] [--case NAME TEXT...] -- COMPILER [FLAGS...]

SOURCE holds one case per `#if defined(GSHARD_CASE_<name>)` / `#elif ...`
block after a common preamble. All the cases given are compiled together,
once: each block in a namespace of its own, with #line directives so the
compiler's diagnostics name SOURCE's own lines, and each diagnostic is
given to the case whose lines it names. A case whose texts are not all found
that way (a type one case already failed to instantiate is not diagnosed
twice) is compiled again alone with -DGSHARD_CASE_<name>, which decides.
"""
import os
import re
import subprocess
import sys
import tempfile

CASE = re.compile(r"^#(?:el)?if defined\(GSHARD_CASE_(\w+)\)")
HEADER = re.compile(r"^(In file included from|\S+: (In|At) )")


def blocks(source):
    """The preamble's lines and each case's (first line number, lines)."""
    lines = open(source).read().splitlines()
    preamble, cases, name = [], {}, None
    for i, line in enumerate(lines, 1):
        m = CASE.match(line)
        if m:
            name = m.group(1)
            cases[name] = (i + 1, [])
        elif line.startswith("#else") or line.startswith("#endif"):
            if name is None:
                raise SystemExit(f"{source}:{i}: #else or #endif before the first case")
            name = ""
        elif name:
            cases[name][1].append(line)
        elif name is None:
            preamble.append(line)
    return preamble, cases


def compile_alone(compiler, source, name):
    try:
        p = subprocess.run(compiler + ["-fsyntax-only", f"-DGSHARD_CASE_{name}", source], capture_output=True, text=True,
                           timeout=300)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        return None, "(the compiler did not finish in 300 s)"


def attribute(out, source, spans):
    """Each case's share of the diagnostics: groups of lines from one context header to the next,
    given to the case whose lines they name (a group naming none continues the last one's). A group
    naming two cases is given to neither: those cases are compiled again alone."""
    where = re.compile(re.escape(os.path.abspath(source)) + r":(\d+)")
    shares = {name: [] for name in spans}
    group, owners, last = [], set(), set()

    def close():
        nonlocal group, owners, last
        if group:
            owner = owners or last
            if len(owner) == 1:
                shares[next(iter(owner))] += group
            last = owner
        group, owners = [], set()
    for line in out.splitlines():
        if HEADER.match(line) and any(": error: " in g for g in group):
            close()
        group.append(line)
        for n in where.findall(line):
            owners.update(name for name, (first, count) in spans.items() if first <= int(n) < first + count)
    close()
    return {name: "\n".join(lines) for name, lines in shares.items()}


def main() -> int:
    sep = sys.argv.index("--")
    source, args, compiler = sys.argv[1], sys.argv[2:sep], sys.argv[sep + 1:]
    wanted, name = {}, None
    for a in args:
        if a == "--case":
            name = None
        elif name is None:
            name = a
            wanted[name] = []
        else:
            wanted[name].append(a)
    preamble, cases = blocks(source)
    unknown = [n for n in wanted if n not in cases]
    if unknown:
        print(f"no such case in {source}: {unknown}")
        print(f"gshard-test-summary: passed=0 failed={len(wanted)} ranks=0")
        return 1
    path = os.path.abspath(source)
    text = preamble[:]
    for n in wanted:
        first, body = cases[n]
        text += [f"namespace gshard_case_{n} {{", f'#line {first} "{path}"'] + body + ["}"]
    with tempfile.TemporaryDirectory() as tmp:
        together = os.path.join(tmp, "cases.cpp")
        with open(together, "w") as f:
            f.write("\n".join(text) + "\n")
        try:
            p = subprocess.run(compiler + ["-fsyntax-only", f"-I{os.path.dirname(path)}", together], capture_output=True,
                               text=True, timeout=600)
            out = p.stdout + p.stderr
        except subprocess.TimeoutExpired:
            out = ""  # every case is compiled alone
    shares = attribute(out, source, {n: (cases[n][0], len(cases[n][1])) for n in wanted})
    failed = 0
    for n, expected in wanted.items():
        if ": error: " in shares[n] and all(e in shares[n] for e in expected):
            print(f"compile-fail case {n}: rejected with {expected!r}")
            continue
        code, out = compile_alone(compiler, source, n)  # alone, it decides
        missing = [e for e in expected if e not in out]
        if code != 0 and not missing:
            print(f"compile-fail case {n}: rejected with {expected!r} (compiled alone)")
            continue
        failed += 1
        print(f"compile-fail case {n}: compiler exit {code}")
        for e in missing:
            print(f"  missing text: {e!r}")
        print("\n".join(out.splitlines()[:60]))
    print(f"gshard-test-summary: passed={len(wanted) - failed} failed={failed} ranks=0")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
