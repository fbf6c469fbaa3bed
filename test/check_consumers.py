#!/usr/bin/env python3
"""gshard consumed three ways, as a user's project would (docs/00): installed
into a temporary prefix and found by pkg-config (-std=c++20 and Eigen as a
system include from the .pc: no warning under -Wall -Wextra) and by CMake's
find_package(gshard) (the imported target gshard::gshard); and as a Meson
subproject, where only the library is configured — no test, benchmark or
example target. Each consumer runs at 1 and 2 ranks and must print
"consumer ok" once.

usage: check_consumers.py SOURCE_ROOT WORKDIR -- MPIEXEC [ARGS...]"""
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys

from checks import verdict


def sh(cmd, cwd=None, env=None, timeout=600):
    p = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, **(env or {})), capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def main() -> int:
    sep = sys.argv.index("--")
    src, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    mpi = sys.argv[sep + 1:]
    consumer = os.path.join(src, "test", "consumer")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    prefix = os.path.join(work, "prefix")
    problems, binaries = [], {}

    code, out = sh(["meson", "setup", os.path.join(work, "install-build"), src, "--prefix", prefix,
                    "-Dtests=false", "-Dexamples=false", "-Dbenchmarks=false"])
    if code == 0:
        code, out = sh(["meson", "install", "-C", os.path.join(work, "install-build")])
    if code != 0:
        return verdict([f"installing gshard into {prefix} failed:\n{out[-3000:]}"], 2)
    for f in ["share/pkgconfig/gshard.pc", "share/cmake/gshard/gshardConfig.cmake", "include/gshard/gshard.hpp"]:
        if not os.path.exists(os.path.join(prefix, f)):
            problems.append(f"not installed: {prefix}/{f}")

    # The three consumers build two at a time: each is one compile of one file.
    def with_pkg_config():  # the .pc's flags alone, no -std given by the user
        env = {"PKG_CONFIG_PATH": os.path.join(prefix, "share", "pkgconfig")}
        code, flags = sh(["pkg-config", "--cflags", "--libs", "gshard"], env=env)
        if code != 0 or "-std=c++20" not in flags or "-isystem" not in flags:
            return f"pkg-config --cflags --libs gshard: {flags}", None
        for level in ["-O3", "-O2"]:
            exe = os.path.join(work, "consumer-pkgconfig")
            code, out = sh(["c++", level, "-Wall", "-Wextra", os.path.join(consumer, "consumer.cpp"), "-o", exe] + flags.split())
            if code != 0 or "warning" in out:
                return f"compiling with pkg-config's flags at {level}: exit {code}:\n{out[-3000:]}", None
        return None, exe

    def with_cmake():  # find_package(gshard) and the imported target
        cbuild = os.path.join(work, "cmake-build")
        code, out = sh(["cmake", "-S", consumer, "-B", cbuild, f"-DCMAKE_PREFIX_PATH={prefix}", "-DCMAKE_BUILD_TYPE=Release"])
        if code == 0:  # the configure's output too: a warning from gshardConfig.cmake counts
            code, built = sh(["cmake", "--build", cbuild])
            out += built
        if code != 0 or "warning" in out.lower().replace("-wno-", ""):
            return f"CMake consumer: exit {code}:\n{out[-3000:]}", None
        return None, os.path.join(cbuild, "consumer")

    def as_subproject():  # gshard in subprojects/, only the library configured
        mdir = os.path.join(work, "meson-consumer")
        os.makedirs(os.path.join(mdir, "subprojects"))
        for f in ["meson.build", "consumer.cpp"]:
            shutil.copy(os.path.join(consumer, f), mdir)
        os.symlink(src, os.path.join(mdir, "subprojects", "gshard"))
        mbuild = os.path.join(mdir, "build")
        code, out = sh(["meson", "setup", mbuild, mdir, "--buildtype=release"])
        wrong = []
        if code == 0:
            code, targets = sh(["meson", "introspect", "--targets", mbuild])
            names = [t["name"] for t in json.loads(targets)] if code == 0 else []
            if names != ["consumer"]:
                wrong.append(f"the subproject configured more than the library: targets {names}")
            code, tests = sh(["meson", "introspect", "--tests", mbuild])
            if code != 0 or tests.strip() != "[]":
                wrong.append(f"the subproject registered tests: {tests[:300]}")
            code, out = sh(["ninja", "-C", mbuild])
        if code != 0 or "warning" in out:
            wrong.append(f"Meson subproject consumer: exit {code}:\n{out[-3000:]}")
            return "\n".join(wrong), None
        return "\n".join(wrong) or None, os.path.join(mbuild, "consumer")

    ways = {"pkg-config": with_pkg_config, "CMake": with_cmake, "Meson subproject": as_subproject}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        built = {how: pool.submit(build) for how, build in ways.items()}
        for how, future in built.items():
            problem, exe = future.result()
            if problem:
                problems.append(problem)
            if exe:
                binaries[how] = exe

    for how, exe in binaries.items():
        for np in ["1", "2"]:
            code, out = sh(mpi + ["-np", np, exe], timeout=120)
            if code != 0 or out.count("consumer ok") != 1:
                problems.append(f"{how} consumer at {np} ranks: exit {code}:\n{out[-2000:]}")
    if len(binaries) != 3:
        problems.append(f"built {len(binaries)} of 3 consumers: {list(binaries)}")
    return verdict(problems, 2)


if __name__ == "__main__":
    sys.exit(main())
