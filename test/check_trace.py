#!/usr/bin/env python3
"""Runs the trainer for a few steps with --trace on one step and checks the
file: valid JSON in the Chrome trace-event format, one track per rank, and
for that step on every rank the expected spans — the step, forward,
backward, optimizer, every einsum of a block with its FLOPs, and exactly the
step's collectives with their axes and bytes, and each MoE layer's routing
as counters. With --metrics, one JSON line per step whose loads and drops
add up. Then once more with the routing variants (top-4, dropless, shared
experts, z-loss, bias balancing): nothing dropped, every choice placed.

usage: check_trace.py RANKS OUT.json -- MPIEXEC [ARGS...] TRAINER"""
import json
import subprocess
import sys
from collections import Counter

from checks import verdict


def check_metrics(path, steps, k, tokens, dropless):
    """One JSON line per step; per MoE layer: loads + drops + skips = k choices per token."""
    problems = []
    try:
        lines = [json.loads(line) for line in open(path)]
    except Exception as e:  # noqa: BLE001
        return [f"{path}: not JSON lines: {e}"]
    if [m["step"] for m in lines] != list(range(1, steps + 1)):
        problems.append(f"{path}: steps {[m.get('step') for m in lines]}")
    for m in lines:
        if len(m["moe"]) != 2 or not m["tokens_per_s"] > 0 or not m["loss"] > 0:
            problems.append(f"{path}: step {m['step']}: {str(m)[:300]}")
            continue
        for layer in m["moe"]:
            if layer["tokens"] != tokens or len(layer["dropped"]) != k or len(layer["skipped"]) != k:
                problems.append(f"{path}: step {m['step']}: layer {layer}")
            if sum(layer["load"]) + sum(layer["dropped"]) + sum(layer["skipped"]) != k * tokens:
                problems.append(f"{path}: step {m['step']}: choices do not add up: {layer}")
            if sum(layer["demand"]) != sum(layer["load"]) + sum(layer["dropped"]):
                problems.append(f"{path}: step {m['step']}: demand is not placed + dropped: {layer}")
            if dropless and (sum(layer["dropped"]) != 0 or not 0 < layer["capacity"] <= 32 * k):
                problems.append(f"{path}: step {m['step']}: dropless dropped: {layer}")
            if layer["dead_experts"] != sum(1 for v in layer["load"] if v == 0):
                problems.append(f"{path}: dead experts: {layer}")
    return problems


def main() -> int:
    sep = sys.argv.index("--")
    ranks, out = int(sys.argv[1]), sys.argv[2]
    metrics = out + ".metrics.jsonl"
    cmd = sys.argv[sep + 1:] + ["--steps", "3", "--trace", out, "--trace-step", "1", "--log-every", "1000",
                                "--batch", str(4 * ranks), "--seq", "32", "--metrics", metrics]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    problems = []
    if proc.returncode == 0:
        problems += check_metrics(metrics, steps=3, k=2, tokens=4 * ranks * 32, dropless=False)
    variant = cmd + ["--top-k", "4", "--dropless", "--shared-experts", "1", "--z-loss", "1e-3", "--balance", "bias"]
    variant[variant.index(metrics)] = metrics + ".variant"
    variant[variant.index(out)] = out + ".variant.json"  # the default run's trace is the one checked below
    vproc = subprocess.run(variant, capture_output=True, text=True, timeout=240)
    if vproc.returncode != 0:
        problems.append(f"trainer with routing variants exited {vproc.returncode}: {vproc.stderr[-2000:]}")
    else:
        problems += check_metrics(metrics + ".variant", steps=3, k=4, tokens=4 * ranks * 32, dropless=True)
        if "routing: top-4 (all later choices), dropless, balance by bias" not in vproc.stdout:
            problems.append(f"no routing line for the variant: {vproc.stdout[:600]}")
    if proc.returncode != 0:
        problems.append(f"trainer exited {proc.returncode}: {proc.stderr[-2000:]}")
    else:
        try:
            events = json.load(open(out))["traceEvents"]
        except Exception as e:  # noqa: BLE001 - any parse failure is the finding
            events = []
            problems.append(f"not valid JSON: {e}")
        spans = [e for e in events if e.get("ph") == "X"]
        names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
        if names != {f"rank {r}" for r in range(ranks)}:
            problems.append(f"tracks {sorted(names)}")
        for r in range(ranks):
            mine = [e for e in spans if e["pid"] == r]
            count = Counter(e["name"] for e in mine)
            for want in ["train step 1", "forward", "backward", "optimizer", "block 1 MoE", "gating", "dispatch",
                         "combine"]:
                if count[want] < 1:
                    problems.append(f"rank {r}: no span '{want}'")
            for spec in ["BLM,MNK->BLNK", "causal_attention", "causal_attention backward", "BLNK,NKM->BLM",
                         "EGCM,EMH->EGCH", "EGCH,EHM->EGCM", "GSM,ME->GSE", "BLM,MV->BLV"]:
                spec_spans = [e for e in mine if e["name"] == spec]
                if not spec_spans or not all(e["args"]["flops"] > 0 for e in spec_spans):
                    problems.append(f"rank {r}: no einsum span {spec} with FLOPs")
            # The gradient buckets' collectives run while the backward computes: on
            # the rank's "in flight" tracks (tid 1, 2, ...: spans of one never
            # overlap), from their start to the test that saw them end.
            flying = [e for e in mine if e["cat"] == "in flight"]
            if ranks > 1 and not flying:
                problems.append(f"rank {r}: no collective in flight")
            if not all(e.get("tid", 0) >= 1 and e["name"] in ("all_reduce", "reduce_scatter", "all_gather") for e in flying):
                problems.append(f"rank {r}: an in-flight span off its tracks: {flying[:3]}")
            for tid in {e["tid"] for e in flying}:
                lane = sorted((e["ts"], e["ts"] + e["dur"]) for e in flying if e["tid"] == tid)
                if any(b[0] < a[1] - 1e-3 for a, b in zip(lane, lane[1:])):
                    problems.append(f"rank {r}: in-flight track {tid} has overlapping spans")
            colls = Counter((e["name"], e["args"]["axes"]) for e in mine if e["cat"] == "collective")
            # 2 MoE blocks x (2 forward + 2 backward) all_to_alls
            if colls[("all_to_all", "expert")] != 8:
                problems.append(f"rank {r}: all_to_all spans {colls}")
            if not all(e["args"]["bytes"] >= 0 for e in mine if e["cat"] == "collective"):
                problems.append(f"rank {r}: a collective without bytes")
            counters = Counter(e["name"] for e in events if e.get("ph") == "C" and e["pid"] == r)
            for layer in ["block1", "block3"]:
                if counters[layer + " load"] != 1 or counters[layer + " routing"] != 1:
                    problems.append(f"rank {r}: counters {dict(counters)}")
            step = [e for e in mine if e["name"] == "train step 1"]
            if step and any(e["ts"] < step[0]["ts"] - 1 or e["ts"] + e["dur"] > step[0]["ts"] + step[0]["dur"] + 1
                            for e in mine if e is not step[0]):
                problems.append(f"rank {r}: a span outside the traced step")
    return verdict(problems, ranks)


if __name__ == "__main__":
    sys.exit(main())
