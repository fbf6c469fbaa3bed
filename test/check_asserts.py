#!/usr/bin/env python3
"""Every static_assert in include/gshard/ whose message starts with "gshard::"
must be checked by a compile-fail case (its text in test/meson.build), or be
listed in UNTESTED below with the reason. Prints the untested ones and
"gshard-test-summary: passed=1 failed=0" (or the reverse) for scripts/test.

usage: check_asserts.py INCLUDE_DIR TEST_MESON_BUILD"""
import pathlib
import re
import sys

# Asserts no user program can reach, with the reason.
UNTESTED = {
    "gshard::reshard: the planner did not reach the target (a gshard bug)":
        "an internal invariant of the planner; the exhaustive reshard test would fail first",
    "gshard::einsum: internal error: an operand slice needs communication":
        "an internal invariant of the einsum planner",
    "gshard::onednn_gemm: the element types are float and bf16":
        "an internal invariant: gemm and gemm_bf16, its only callers, admit no other type",
    "gshard::onednn: this is written for oneDNN 2.x (Debian 12's libdnnl-dev 2.6); "
    "configure with -Donednn=disabled for another version":
        "the build configures without oneDNN for another version (meson.build), so no build reaches it",
}


def asserts(include: pathlib.Path):
    for f in sorted(include.rglob("*.hpp")):
        text = f.read_text()
        for m in re.finditer(r"static_assert\s*\(", text):
            # the first string literal of the assert: its message (literals may be split)
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            body = text[m.end():i]
            lits = re.findall(r'"((?:[^"\\]|\\.)*)"', body)
            msg = "".join(lits).replace('\\"', '"')
            if re.search(r'"gshard::"\s*#', body):  # a macro's: "gshard::" #name ": ..." for each op it defines
                names = re.findall(r"^GSHARD_UNARY_\((\w+),", text, re.M)
                if not names:  # made from tensor/ops.hpp's list: GSHARD_ELEMENTWISE_FUNCTIONS(GSHARD_UNARY_)
                    names = re.findall(r"^\s*F\((\w+), \w+\)", (include / "tensor" / "ops.hpp").read_text(), re.M)
                for name in names:
                    yield f.relative_to(include.parent.parent), "gshard::" + name + msg[len("gshard::"):]
                continue
            start = msg.find("gshard::")
            if start >= 0:
                yield f.relative_to(include.parent.parent), msg[start:]


def main() -> int:
    include, meson = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).read_text()
    # The texts the compile-fail cases require.
    tested = set(re.findall(r"'(gshard::(?:[^'\\]|\\.)*)'", meson))
    tested = {t.replace("\\'", "'") for t in tested}
    missing = []
    seen = 0
    for path, msg in asserts(include):
        seen += 1
        if msg in UNTESTED:
            continue
        if not any(t in msg for t in tested if t.startswith("gshard::")):
            missing.append(f"{path}: {msg[:120]}")
    for m in missing:
        print("untested:", m)
    print(f"{seen} asserts, {len(missing)} without a compile-fail case, {len(UNTESTED)} listed as unreachable")
    ok = not missing
    print(f"gshard-test-summary: passed={int(ok)} failed={int(not ok)} ranks=0")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
