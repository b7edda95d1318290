"""Render the issue-3 table of BENCHMARKS.md §1c from the rows quality_table.py wrote.

    python3 benchmarks/render_table.py benchmarks/results/issue3-table-pre_rope.jsonl \
        benchmarks/results/issue3-table-post_rope.jsonl

Rows are ordered by key mode, budget (50, 75, 37.5, 25 %) and method; the best PPL of each (key mode,
budget) is bold. Variant rows (a ``tag``) follow in a second table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BUDGETS = (0.5, 0.75, 0.375, 0.25)
ROWS = (
    "pca-uniform",
    "pca-dp",
    "stiefel-dp-seq",
    "stiefel-dp-indep",
    "stiefel-uniform-seq",
    "stiefel-uniform-indep",
)
ORDER = {"seq": "sequential", "indep": "independent"}


def describe(row: str) -> tuple[str, str, str]:
    parts = row.split("-")
    return parts[0], parts[1], ORDER[parts[2]] if len(parts) > 2 else "–"


def line(r: dict, bold: bool) -> str:
    method, allocation, order = describe(r["row"])
    delta = 100 * (r["ppl"] / r["ppl_original"] - 1)
    ppl, dppl = f"{r['ppl']:.2f}", f"{delta:+.1f} %"
    if bold:
        ppl, dppl = f"**{ppl}**", f"**{dppl}**"
    tag = f" | {r['tag']}" if r.get("tag") else ""
    return (
        f"| {r['key_mode']} | {100 * r['budget']:g} % | {method} | {allocation} | {order}{tag} | {ppl} | "
        f"{dppl} | {r['layer_rel_error_calib']:.4f} | {r['next_token_kl']:.4f} | "
        f"{r['first_pass_seconds']:.1f} + {r['second_pass_seconds']:.1f} |"
    )


def render(rows: list[dict]) -> str:
    head = (
        "| key mode | budget | method | allocation | order | PPL | ΔPPL | layer rel. err | next-token KL | "
        "calib. s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    main = [r for r in rows if not r.get("tag")]
    out = [head]
    for mode in ("pre_rope", "post_rope"):
        for budget in BUDGETS:
            cell = {r["row"]: r for r in main if r["key_mode"] == mode and r["budget"] == budget}
            if not cell:
                continue
            best = min(r["ppl"] for r in cell.values())
            out += [line(cell[name], cell[name]["ppl"] == best) for name in ROWS if name in cell]
            missing = [name for name in ROWS if name not in cell]
            if missing:
                out.append(
                    f"| {mode} | {100 * budget:g} % | not measured: {', '.join(missing)} | | | | | | | |"
                )
    variants = [r for r in rows if r.get("tag")]
    if variants:
        out += ["", head.replace("| order |", "| order | variant |").replace("|---|---|", "|---|---|---|", 1)]
        out += [line(r, False) for r in variants]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", nargs="+", type=Path)
    args = ap.parse_args()
    rows = [json.loads(text) for path in args.jsonl for text in path.read_text().splitlines() if text.strip()]
    print(render(rows))


if __name__ == "__main__":
    main()
