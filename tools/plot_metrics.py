"""Draw reward, validation accuracy, response length, entropy and KL curves from ``metrics.jsonl`` logs.

    python tools/plot_metrics.py outputs/run/metrics.jsonl --out outputs/run/curves.png
    python tools/plot_metrics.py seed0/metrics.jsonl seed1/metrics.jsonl --labels seed0 seed1 --out cmp.png

Several logs (e.g. seeds) are drawn into the same panels, one colour per label: logs that share a label (the
seeds of one method) share a colour, so two methods' seeds compare at a glance:

    python tools/plot_metrics.py a/seed*/metrics.jsonl b/seed*/metrics.jsonl --labels A A A B B B \
        --panels "training reward" "validation accuracy" --out cmp.png

Needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchrlhf.utils.logging import read_metrics  # noqa: E402

# Panel -> metric-name patterns (verl names); every metric that matches and was logged is drawn.
PANELS = {
    "training reward": [r"critic/score/mean"],
    "validation accuracy": [r"val/.+/(acc|score|reward)"],
    "response length": [r"response_length/mean"],
    "entropy": [r"actor/entropy"],
    "kl to the reference": [r"actor/kl_loss", r"actor/reward_kl_penalty"],
    "turns per trajectory": [r"num_turns/mean"],  # agents
    "tool calls per trajectory": [r"agent/tool_calls/mean", r"agent/tool_errors/mean"],
}


def collect_series(rows: list[dict]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """panel -> metric -> (steps, values), for the metrics present in ``rows``."""
    out: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for panel, patterns in PANELS.items():
        names = sorted({k for row in rows for k in row if any(re.fullmatch(p, k) for p in patterns)})
        for name in names:
            points = [(row["step"], float(row[name])) for row in rows if isinstance(row.get(name), (int, float))]
            out.setdefault(panel, {})[name] = ([s for s, _ in points], [v for _, v in points])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="metrics.jsonl files written by the jsonl logger")
    parser.add_argument("--labels", nargs="*", default=None, help="one legend label per log (default: its folder)")
    parser.add_argument("--panels", nargs="*", default=None, help=f"only these panels, of {list(PANELS)}")
    parser.add_argument("--title", default=None)
    parser.add_argument("--out", default=None, help="PNG path (default: curves.png next to the first log)")
    args = parser.parse_args()
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in args.logs]
    if len(labels) != len(args.logs):
        raise SystemExit(f"--labels: {len(labels)} labels for {len(args.logs)} logs")
    try:  # imported here: matplotlib is optional, needed by this tool only
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_metrics needs matplotlib: pip install matplotlib") from None
    unknown = sorted(set(args.panels or ()) - set(PANELS))
    if unknown:
        raise SystemExit(f"--panels: unknown {unknown}; valid: {list(PANELS)}")
    runs = [(label, collect_series(read_metrics(path))) for label, path in zip(labels, args.logs)]
    colors = {label: f"C{k}" for k, label in enumerate(dict.fromkeys(labels))}
    panels = [p for p in (args.panels or PANELS) if any(p in series for _, series in runs)]
    if not panels:
        raise SystemExit(f"{', '.join(args.logs)}: no reward, accuracy, length, entropy or KL metrics to plot")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        legend: set[str] = set()
        for label, series in runs:
            for j, (name, (steps, values)) in enumerate(series.get(panel, {}).items()):
                key = label if len(runs) > 1 else name
                ax.plot(steps, values, color=colors[label], linestyle=["-", "--", ":"][j % 3],
                        marker="." if len(steps) < 20 else None, label="_nolegend_" if key in legend else key)
                legend.add(key)
        names = sorted({n for _, series in runs for n in series.get(panel, {})})
        ax.set_title(panel if len(runs) == 1 else f"{panel}\n{', '.join(names)}", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.logs[0])), "curves.png")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
