#!/usr/bin/env python3
"""The table and the per-language plots of scripts/m4, from its runs' logs and
metrics: OUT/<model>_s<seed>.log (the languages' training pairs, the model's
parameters) and .jsonl (the last evaluation's figures per language, the
steps' seconds and tokens/s). Writes OUT/table.md, and OUT/gain.svg and
OUT/gain_bpb.svg: each language's chrF and bits-per-byte gain of MoE over
the dense model of the same FLOPs against its training pairs.

usage: m4_report.py OUT SEED [SEED...]   Python's standard library only."""
import html
import json
import math
import re
import statistics
import sys

MODELS = [("moe", "MoE top-2, E = 8, H = 256"), ("dense_flops", "dense, same FLOPs/token (H = 512 in blocks 1, 3)"),
          ("dense_params", "dense, same parameters (H = 2048 in blocks 1, 3)")]


def read(out, name):
    log = open(f"{out}/{name}.log").read()
    pairs = {m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\w+) +(\d+) +\d+ +\d+ +[\d.]+%$", log, re.M)}
    params = re.search(r"([\d.]+)M parameters", log).group(1)
    lines = [json.loads(l) for l in open(f"{out}/{name}.jsonl")]
    evals = [l for l in lines if "eval" in l]
    if not evals:
        sys.exit(f"m4_report: {out}/{name}.jsonl has no evaluation (did the run finish?)")
    last = evals[-1]
    for lang, figures in last["eval"].items():
        if any(v is None for v in figures.values()):  # json_number writes null for NaN or Inf
            sys.exit(f"m4_report: {out}/{name}.jsonl: the last evaluation of {lang} holds a non-finite figure: {figures}")
    seconds = sum(l["seconds"] for l in lines)
    return {"pairs": pairs, "params": params, "eval": last["eval"], "seconds": seconds,
            "tokens_per_s": statistics.mean(l["tokens_per_s"] for l in lines)}


def main():
    out, seeds = sys.argv[1], sys.argv[2:]
    runs = {m: [read(out, f"{m}_s{s}") for s in seeds] for m, _ in MODELS}
    pairs = runs["moe"][0]["pairs"]
    langs = sorted(pairs, key=lambda l: -pairs[l])  # by training pairs, largest first
    high, low = langs[:len(langs) // 2], langs[len(langs) // 2:]

    def mean(model, key, among=langs):  # over seeds, then languages
        return statistics.mean(statistics.mean(r["eval"][l][key] for r in runs[model]) for l in among)

    rows = [f"| model | parameters | chrF greedy | chrF beam | bits/byte | chrF, {len(high)} largest | chrF, {len(low)} smallest | "
            "chrF per seed | bits/byte per seed | tokens/s | training time |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, label in MODELS:
        per_seed = lambda key, f: ", ".join(f"{statistics.mean(r['eval'][l][key] for l in langs):{f}}" for r in runs[m])
        rows.append(f"| {label} | {runs[m][0]['params']}M | {mean(m, 'chrf_greedy'):.1f} | {mean(m, 'chrf_beam'):.1f} | "
                    f"{mean(m, 'bpb'):.3f} | {mean(m, 'chrf_greedy', high):.1f} | {mean(m, 'chrf_greedy', low):.1f} | "
                    f"{per_seed('chrf_greedy', '.1f')} | {per_seed('bpb', '.3f')} | "
                    f"{statistics.mean(r['tokens_per_s'] for r in runs[m]):.0f} | "
                    f"{statistics.mean(r['seconds'] for r in runs[m]) / 60:.1f} min |")
    open(f"{out}/table.md", "w").write("\n".join(rows) + "\n")
    print("\n".join(rows))

    # The gains of MoE over the dense model of the same FLOPs, per language, against its training pairs:
    # chrF (MoE − dense) and bits per byte (dense − MoE: above 0, MoE predicts the references better).
    per_lang = lambda m, key, l: statistics.mean(r["eval"][l][key] for r in runs[m])
    plot(f"{out}/gain.svg", pairs, {l: per_lang("moe", "chrf_greedy", l) - per_lang("dense_flops", "chrf_greedy", l) for l in langs},
         "chrF gain", "chrF MoE − dense", 5.0, ".1f", len(seeds))
    plot(f"{out}/gain_bpb.svg", pairs, {l: per_lang("dense_flops", "bpb", l) - per_lang("moe", "bpb", l) for l in langs},
         "bits-per-byte gain", "bits/byte dense − MoE", 0.1, ".2f", len(seeds))
    print(f"m4: wrote {out}/table.md, {out}/gain.svg and {out}/gain_bpb.svg")


def plot(path, pairs, gain, what, axis, least_top, fmt, seeds):
    """Each language's gain against its training pairs (log scale), the axis at least ±least_top."""
    langs = list(gain)
    W, H, L, R, T, B = 860, 460, 70, 30, 40, 55
    xs = [math.log10(pairs[l]) for l in langs]
    x0, x1 = math.floor(min(xs)), max(math.ceil(max(xs)), math.floor(min(xs)) + 1)
    top = max(least_top, max(abs(g) for g in gain.values()) * 1.1)
    X = lambda v: L + (v - x0) / (x1 - x0) * (W - L - R)
    Y = lambda g: T + (top - g) / (2 * top) * (H - T - B)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{what} of MoE over the dense model of the same '
           f'FLOPs, per language ({seeds} seed{"s" if seeds > 1 else ""})</text>',
           f'<line x1="{L}" y1="{Y(0)}" x2="{W - R}" y2="{Y(0)}" stroke="#888"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>']
    for d in range(x0, x1 + 1):
        svg.append(f'<text x="{X(d)}" y="{H - B + 18}" text-anchor="middle">10^{d}</text>')
    for g in (-top, -top / 2, 0, top / 2, top):
        svg.append(f'<text x="{L - 6}" y="{Y(g) + 4}" text-anchor="end">{g:+{fmt}}</text>')
    svg.append(f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">training pairs of the language (log scale)</text>')
    svg.append(f'<text x="16" y="{H / 2}" transform="rotate(-90 16 {H / 2})" text-anchor="middle">{axis}</text>')
    for l in langs:
        x, y = X(math.log10(pairs[l])), Y(gain[l])
        colour = "#2ca02c" if gain[l] >= 0 else "#d62728"
        svg.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{colour}"/>')
        svg.append(f'<text x="{x + 6:.1f}" y="{y - 6:.1f}" font-size="10">{html.escape(l)}</text>')
    svg.append("</svg>")
    open(path, "w").write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
