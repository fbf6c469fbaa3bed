#!/usr/bin/env python3
"""Draws a gshard trace (Chrome trace-event JSON) as an SVG timeline: one lane
per rank, nested spans stacked, coloured by category, labelled where wide
enough. For the docs; open the JSON itself in https://ui.perfetto.dev.

usage: trace_to_svg.py trace.json out.svg [title]"""
import json
import sys
from html import escape

COLOURS = {"step": "#9e9e9e", "model": "#b3cde3", "moe": "#ccebc5", "einsum": "#fbb4ae",
           "collective": "#7b3294", "in flight": "#c2a5cf", "user": "#fed9a6"}


def main(src: str, dst: str, title: str) -> None:
    events = [e for e in json.load(open(src))["traceEvents"] if e["ph"] == "X"]
    if not events:
        raise SystemExit("no spans in " + src)
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    ranks = sorted({(e["pid"], e.get("tid", 0)) for e in events})  # a lane per rank and track
    width, left, row_h = 1400, 70, 18
    scale = (width - left - 10) / max(t1 - t0, 1e-9)
    lanes = []
    for r in ranks:
        spans = sorted((e for e in events if (e["pid"], e.get("tid", 0)) == r), key=lambda e: (e["ts"], -e["dur"]))
        stack, placed = [], []
        for e in spans:  # depth = number of enclosing spans
            while stack and stack[-1] <= e["ts"]:
                stack.pop()
            placed.append((len(stack), e))
            stack.append(e["ts"] + e["dur"])
        lanes.append((r, placed, 1 + max(d for d, _ in placed)))
    height = 40 + sum(depth * row_h + 14 for _, _, depth in lanes) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="10">',
           f'<text x="{left}" y="16" font-size="13">{escape(title)}</text>']
    y = 30
    for r, placed, depth in lanes:
        label = f"rank {r[0]}" if r[1] == 0 else "in flight"
        out.append(f'<text x="4" y="{y + 12}" font-size="12">{label}</text>')
        for d, e in placed:
            x = left + (e["ts"] - t0) * scale
            w = max(e["dur"] * scale, 0.5)
            fill = COLOURS.get(e.get("cat", ""), "#dddddd")
            tip = escape(f'{e["name"]} ({e["dur"] / 1000:.3f} ms) {json.dumps(e.get("args", {}))}')
            out.append(f'<rect x="{x:.2f}" y="{y + d * row_h}" width="{w:.2f}" height="{row_h - 2}" fill="{fill}" '
                       f'stroke="#555" stroke-width="0.2"><title>{tip}</title></rect>')
            if w > 6 * len(e["name"]):
                colour = "white" if e.get("cat") == "collective" else "black"
                out.append(f'<text x="{x + 2:.2f}" y="{y + d * row_h + 12}" fill="{colour}">{escape(e["name"])}</text>')
        y += depth * row_h + 14
    # time axis in ms
    span_ms = (t1 - t0) / 1000
    step = max(1, round(span_ms / 10))
    for k in range(0, int(span_ms) + 1, step):
        x = left + k * 1000 * scale
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 5}" stroke="black"/>'
                   f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle">{k} ms</text>')
    legend_x = left
    for cat, colour in COLOURS.items():
        out.append(f'<rect x="{legend_x}" y="{y + 24}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{legend_x + 14}" y="{y + 33}">{cat}</text>')
        legend_x += 90
    out.append("</svg>")
    open(dst, "w").write("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else sys.argv[1])
