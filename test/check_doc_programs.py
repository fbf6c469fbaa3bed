#!/usr/bin/env python3
"""Every code block of README.md and docs/*.md is checked, by kind:

* a whole program (a ```cpp block with `int main(`) is compiled and run: the
  block follows a marker <!-- test: np=1,2 expect="text" --> naming the rank
  counts it claims and a text its output must hold once (rank 0 prints);
* a fragment (any other ```cpp block) follows <!-- compile: context=NAME -->
  and is compiled inside that context of test/doc_contexts.cpp (all fragments
  in one translation unit, -fsyntax-only, errors pointing into the Markdown);
  <!-- compile: sketch --> is accepted only for a block that shows its own
  elisions (`...` in the code);
* a block of commands (```sh) follows <!-- commands: run --> (this test runs
  each line, from a directory where `build/` is the build and `scripts/` the
  source's, and wants exit 0), <!-- commands: tested-by test/FILE --> (FILE
  runs them), or <!-- commands: long --> (minutes, a cluster, or an install);
* a block in another language (another stack's code, for comparison)
  follows <!-- not checked: REASON -->; a block without a language is output.

A block without its marker is a failure, so nothing new goes unchecked.

usage: check_doc_programs.py SOURCE_ROOT BUILD_ROOT WORKDIR -- COMPILER [FLAGS...] -- MPIEXEC [ARGS...]"""
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys

from checks import verdict

BLOCK = re.compile(r"(?:<!--\s*(test|compile|commands|not checked):\s*([^\n]*?)\s*-->\s*\n)?```(\w*)\n(.*?)```", re.S)
TEST = re.compile(r"np=([\d,]+)(?:\s+expect=\"([^\"]*)\")?$")


def blocks(root):
    """(markdown path, line, marker kind, marker text, language, code) for every fenced block."""
    for md in [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
        text = open(md).read()
        for m in BLOCK.finditer(text):
            line = text[:m.start(3)].count("\n") + 1  # the fence's line
            yield os.path.relpath(md, root), line, m.group(1), m.group(2) or "", m.group(3), m.group(4)


def contexts(path):
    """name -> (before, after, line of `before` in path, line of `after`)."""
    out, name, lines, start = {}, None, [], 0
    text = open(path).read().split("\n")
    for i, l in enumerate(text + ["// context: <end>"], 1):
        m = re.match(r"// context: (\S+)", l)
        if m:
            if name:
                body = "\n".join(lines)
                if ("//@fragment\n" not in body and name != "prelude") or name in out:
                    sys.exit(f"{path}: context {name} is defined twice or has no //@fragment line")
                before, _, after = body.partition("//@fragment\n")
                out[name] = (before, after, start, start + before.count("\n") + 1)
            name, lines, start = m.group(1), [], i + 1
        elif name:
            lines.append(l)
    return out


def split_flags(compiler):
    flags = [a for a in compiler if not a.startswith(("-l", "-L", "-Wl"))]
    libs = [a for a in compiler if a.startswith(("-l", "-L", "-Wl"))]  # after the source
    return flags, libs


def programs(work, compiler, mpi, found, problems, pool):
    """Compiles the whole programs on `pool`, then runs each at the rank counts its marker names."""
    flags, libs = split_flags(compiler)
    built = []
    for md, line, marker, ranks_expect, _, code in found:
        where = f"{md}, program at line {line}"
        m = TEST.match(ranks_expect) if marker == "test" else None
        if not m:
            problems.append(f"{where}: no <!-- test: np=... --> marker before it")
            continue
        base = os.path.join(work, re.sub(r"\W", "_", md) + f"_{line}")
        open(base + ".cpp", "w").write(f'#line {line + 1} "{md}"\n' + code)
        compiling = pool.submit(subprocess.run, flags + [base + ".cpp", "-o", base] + libs, capture_output=True,
                                text=True, timeout=300)
        built.append((where, m.group(1), m.group(2), base, compiling))
    ran = 0
    for where, ranks, expect, base, compiling in built:
        p = compiling.result()
        if p.returncode != 0:
            problems.append(f"{where}: does not compile:\n{(p.stdout + p.stderr)[-3000:]}")
            continue
        for np in ranks.split(","):
            r = subprocess.run(mpi + ["-np", np, base], capture_output=True, text=True, timeout=120)
            if r.returncode != 0 or (expect and r.stdout.count(expect) != 1):
                problems.append(f"{where} at {np} ranks: exit {r.returncode}, wanted {expect!r} once:\n"
                                f"{(r.stdout + r.stderr)[-2000:]}")
            ran += 1
    return ran


def fragments(root, work, compiler, found, problems, pool):
    """Compiles every fragment in its context as one unit on `pool`; returns (how many, a function that
    adds the compile's errors to `problems` once it is done)."""
    ctx_path = os.path.join(root, "test", "doc_contexts.cpp")
    ctx = contexts(ctx_path)
    unit = [f'#line {ctx["prelude"][2]} "{ctx_path}"', ctx["prelude"][0]]
    compiled = 0
    for i, (md, line, marker, spec, _, code) in enumerate(found):
        where = f"{md}, fragment at line {line}"
        m = re.fullmatch(r"context=(\S+)|(sketch)", spec) if marker == "compile" else None
        if not m:
            problems.append(f"{where}: no <!-- compile: context=NAME --> marker before it (contexts: "
                            f"{', '.join(n for n in ctx if n != 'prelude')})")
            continue
        if m.group(2):
            if "..." not in code:
                problems.append(f"{where}: marked a sketch but shows no elision (`...`): compile it in a context")
            continue
        if m.group(1) not in ctx:
            problems.append(f"{where}: no context {m.group(1)!r} in test/doc_contexts.cpp")
            continue
        before, after, before_line, after_line = ctx[m.group(1)]
        unit += [f"namespace doc_fragment_{i} {{", f'#line {before_line} "{ctx_path}"', before,
                 f'#line {line + 1} "{md}"', code, f'#line {after_line} "{ctx_path}"', after, "}"]
        compiled += 1
    source = os.path.join(work, "fragments.cpp")
    open(source, "w").write("\n".join(unit) + "\n")
    flags, _ = split_flags(compiler)
    compiling = pool.submit(subprocess.run, flags + ["-fsyntax-only", source], capture_output=True, text=True,
                            timeout=600)

    def done():
        p = compiling.result()
        if p.returncode != 0:
            lines = (p.stdout + p.stderr).split("\n")  # the errors and where in the Markdown they came from
            errors = list(dict.fromkeys(l for l in lines if "error" in l or ".md:" in l and "required from here" in l))
            problems.append(f"the documented fragments do not compile ({source}):\n" + "\n".join(errors[:40]))
    return compiled, done


def commands(root, build, work, found, problems):
    """Runs the blocks marked `run`; checks the others name a test that exists or say they are long."""
    ran = 0
    here = os.path.join(work, "commands")
    shutil.rmtree(here, ignore_errors=True)
    os.makedirs(here)
    if build:
        os.symlink(build, os.path.join(here, "build"))
        os.symlink(os.path.abspath(os.path.join(root, "scripts")), os.path.join(here, "scripts"))
    for md, line, marker, spec, _, code in found:
        where = f"{md}, commands at line {line}"
        if marker != "commands" or not re.fullmatch(r"run|long|tested-by \S+", spec):
            problems.append(f"{where}: no <!-- commands: run | long | tested-by test/FILE --> marker before it")
        elif spec.startswith("tested-by"):
            if not os.path.isfile(os.path.join(root, spec.split()[1])):
                problems.append(f"{where}: {spec.split()[1]} does not exist")
        elif spec == "run" and not build:
            print(f"{where}: not run (the examples are not built)")
        elif spec == "run":
            for cmd in code.replace("\\\n", " ").split("\n"):
                cmd = re.sub(r"(^|\s)#.*$", "", cmd).strip()  # a comment, not a '#' inside a word
                if not cmd:
                    continue
                r = subprocess.run(["bash", "-c", cmd], cwd=here, capture_output=True, text=True, timeout=300)
                if r.returncode != 0:
                    problems.append(f"{where}: `{cmd}` exited {r.returncode}:\n{(r.stdout + r.stderr)[-2000:]}")
                ran += 1
    return ran


def main() -> int:
    first = sys.argv.index("--")
    second = sys.argv.index("--", first + 1)
    root, build, work = sys.argv[1], sys.argv[2], sys.argv[3]
    compiler, mpi = sys.argv[first + 1:second], sys.argv[second + 1:]
    os.makedirs(work, exist_ok=True)
    found = list(blocks(root))
    problems = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two compiles at a time; the runs one at a time
        compiled, fragments_done = fragments(root, work, compiler,
                                             [b for b in found if b[4] == "cpp" and "int main(" not in b[5]], problems, pool)
        ran = programs(work, compiler, mpi, [b for b in found if b[4] == "cpp" and "int main(" in b[5]], problems, pool)
        fragments_done()
    shell = commands(root, build, work, [b for b in found if b[4] == "sh"], problems)
    for md, line, marker, spec, lang, _ in found:
        if lang not in ("cpp", "sh", "") and marker != "not checked":
            problems.append(f"{md}, {lang} block at line {line}: no <!-- not checked: REASON --> marker before it "
                            "(or make it cpp or sh, checked)")
    if ran == 0 or compiled == 0:
        problems.append("no documented program ran or no fragment compiled")
    print(f"{ran} runs of documented programs, {compiled} fragments compiled, {shell} documented commands run")
    return verdict(problems, 0)


if __name__ == "__main__":
    sys.exit(main())
