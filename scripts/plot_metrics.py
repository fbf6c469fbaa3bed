#!/usr/bin/env python3
"""Loss curves from the trainer's --metrics files, as one SVG.

usage: plot_metrics.py [--x tokens|seconds] [--title T] -o OUT.svg [NAME=]FILE.jsonl ...

Each file is one run (name: the file's stem, or NAME=): its training loss
(a moving average of `ce`, thin) and its held-out loss (the steps that
evaluated it, `held_out_bpb`, thick with dots), both in bits per byte,
against the tokens trained (or the seconds of training: the sum of the steps'
`seconds`). A file resumed into (opened again with --resume) restarts its
steps; each line's own step and tokens are used, so a resumed run continues
its curve. Python's standard library only."""
import argparse
import html
import json
import math
import os
import sys

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
W, H, LEFT, RIGHT, TOP, BOTTOM = 860, 500, 70, 200, 40, 55


def fail(message):
    """Bad input: one line on stderr, exit status 2 (as argparse's usage errors)."""
    print(f"gshard plot_metrics: {message}", file=sys.stderr)
    sys.exit(2)


def number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def finite(v):
    try:
        return number(v) and math.isfinite(v)
    except OverflowError:  # an integer too large for a float
        return False


def load(path, x_kind):
    """The run's training curve and held-out points. A loss the trainer wrote as null (NaN) or that is
    infinite is left out of the curve and counted; a last line cut short (a run ended while writing it)
    is left out with a note; anything else that is not the trainer's JSON lines is refused."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail(f"{path}: {e.strerror}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        fail(f"{path}: not text; a --metrics file is JSON lines")
    lines = text.split("\n")
    steps = {}
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # no newline after it: the write was cut short
                print(f"gshard plot_metrics: {path}:{n}: the last line is incomplete; left out", file=sys.stderr)
                break
            fail(f"{path}:{n}: not a JSON line ({e.msg}); is it a --metrics file?")
        except (RecursionError, ValueError) as e:  # nested too deep; an integer of too many digits
            fail(f"{path}:{n}: JSON that cannot be read ({'nested too deep' if isinstance(e, RecursionError) else e}); "
                 "is it a --metrics file?")
        if not isinstance(r, dict):
            fail(f"{path}:{n}: a JSON {type(r).__name__}, not an object; is it the trainer's --metrics file?")
        if "step" not in r or "ce" not in r:
            fail(f"{path}:{n}: no 'step' or 'ce'; is it the trainer's --metrics file?")
        if not finite(r["step"]):
            fail(f"{path}:{n}: 'step' is {json.dumps(r['step'])}, not a number")
        if x_kind == "tokens" and "tokens" not in r:
            fail(f"{path}:{n}: no 'tokens' (written by an older trainer); plot it with --x seconds")
        if x_kind == "tokens" and not finite(r["tokens"]):
            fail(f"{path}:{n}: 'tokens' is {json.dumps(r['tokens'])}, not a number")
        for key in ("ce", "held_out_bpb"):  # null: the trainer's NaN; a number, maybe infinite
            if key in r and r[key] is not None and not number(r[key]):
                fail(f"{path}:{n}: '{key}' is {json.dumps(r[key])}, not a number")
        if "seconds" in r and not finite(r["seconds"]):
            fail(f"{path}:{n}: 'seconds' is {json.dumps(r['seconds'])}, not a number")
        steps[r["step"]] = r  # a resumed run repeats no step; a re-run from scratch replaces
    rows = [steps[s] for s in sorted(steps)]
    if not rows:
        fail(f"{path} holds no step")
    x, elapsed = [], 0.0
    for r in rows:
        elapsed += r.get("seconds", 0.0)
        x.append(r["tokens"] if x_kind == "tokens" else elapsed)
    train = [(xi, r["ce"] / math.log(2)) for xi, r in zip(x, rows) if finite(r["ce"])]
    held = [(xi, r["held_out_bpb"]) for xi, r in zip(x, rows) if finite(r.get("held_out_bpb"))]
    skipped = len(rows) - len(train) + sum(1 for r in rows if "held_out_bpb" in r and not finite(r["held_out_bpb"]))
    if skipped:
        print(f"gshard plot_metrics: {path}: {skipped} losses are NaN or infinite (null in the file); left out", file=sys.stderr)
    if not train:
        fail(f"{path}: no finite training loss to draw")
    curve = smooth(train, max(1, len(train) // 40))
    every = max(1, len(curve) // 300)  # a few hundred points draw the same line
    return curve[::every] + ([curve[-1]] if (len(curve) - 1) % every else []), held


def smooth(points, k):
    out, acc = [], 0.0
    for i, (x, y) in enumerate(points):
        acc += y
        if i >= k:
            acc -= points[i - k][1]
        out.append((x, acc / min(i + 1, k)))
    return out


def ticks(lo, hi, n=6):
    step = 10 ** math.floor(math.log10(max(hi - lo, 1e-12) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    t = math.ceil(lo / step) * step
    out = []
    while t <= hi + 1e-9 * step:
        out.append(t)
        t += step
    return out


def label(v, kind):
    if kind == "tokens":
        return f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}k" if v >= 1e3 else f"{v:g}"
    return f"{v / 60:g} min" if v >= 120 else f"{v:g} s"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--x", choices=["tokens", "seconds"], default="tokens")
    ap.add_argument("--title", default="")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args()
    folder = os.path.dirname(a.out) or "."
    if not os.path.isdir(folder):
        fail(f"-o {a.out}: no directory {folder}")
    runs = []
    for spec in a.runs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        if os.path.isdir(path):
            fail(f"{path}: a directory, not a --metrics file")
        if not os.path.isfile(path):
            fail(f"{path}: no such file")
        runs.append((name or os.path.splitext(os.path.basename(path))[0], *load(path, a.x)))
    xs = [p[0] for _, t, h in runs for p in t + h]
    ys = [p[1] for _, t, h in runs for p in t[len(t) // 10:] + h]  # the first steps' losses would flatten the rest
    x0, x1 = 0.0, max(xs)
    y0, y1 = min(ys), max(ys)
    pad = 0.05 * (y1 - y0 or 1)
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    X = lambda v: LEFT + (v - x0) / ((x1 - x0) or 1) * pw
    Y = lambda v: TOP + (1 - (min(max(v, y0), y1) - y0) / ((y1 - y0) or 1)) * ph
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="14">{html.escape(a.title or "loss, bits per byte")}</text>']
    for t in ticks(y0, y1):
        svg.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}" stroke="#e5e5e5"/>')
        svg.append(f'<text x="{LEFT - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    for t in ticks(x0, x1):
        svg.append(f'<line x1="{X(t):.1f}" x2="{X(t):.1f}" y1="{TOP}" y2="{TOP + ph}" stroke="#e5e5e5"/>')
        svg.append(f'<text x="{X(t):.1f}" y="{TOP + ph + 18}" text-anchor="middle">{label(t, a.x)}</text>')
    svg.append(f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    svg.append(f'<text x="{LEFT + pw / 2}" y="{H - 12}" text-anchor="middle">'
               f'{"tokens trained" if a.x == "tokens" else "training time (the steps alone)"}</text>')
    svg.append(f'<text transform="translate(18,{TOP + ph / 2}) rotate(-90)" text-anchor="middle">bits per byte</text>')
    for i, (name, train, held) in enumerate(runs):
        c = COLOURS[i % len(COLOURS)]
        above = next((i for i, (_, y) in enumerate(train) if y <= y1), len(train))  # the first steps, off the top
        pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in train[max(0, above - 1):])
        svg.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="1" opacity="0.6"/>')
        if held:
            pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in held)
            svg.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2.5"/>')
            svg += [f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{c}"/>' for x, y in held]
        ly = TOP + 10 + 36 * i
        svg.append(f'<line x1="{LEFT + pw + 14}" x2="{LEFT + pw + 40}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2.5"/>')
        last = f"held-out {held[-1][1]:.3f}" if held else "no held-out"
        svg.append(f'<text x="{LEFT + pw + 46}" y="{ly + 4}">{html.escape(name)}</text>')
        svg.append(f'<text x="{LEFT + pw + 46}" y="{ly + 18}" fill="#555">{last}</text>')
    svg.append(f'<text x="{LEFT + pw + 14}" y="{TOP + ph}" fill="#555">thin: training (smoothed)</text>')
    svg.append(f'<text x="{LEFT + pw + 14}" y="{TOP + ph + 14}" fill="#555">thick: held-out</text>')
    svg.append("</svg>")
    try:
        with open(a.out, "w") as f:
            f.write("\n".join(svg) + "\n")
    except OSError as e:
        fail(f"-o {a.out}: {e.strerror}")
    print(f"gshard plot_metrics: wrote {a.out} ({len(runs)} runs)")


if __name__ == "__main__":
    main()
