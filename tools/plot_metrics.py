"""Draw reward, KL and response-length curves from a ``metrics.jsonl`` log into a PNG.

    python tools/plot_metrics.py outputs/run/metrics.jsonl --out outputs/run/curves.png

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
    "reward": [r"critic/score/mean", r"critic/rewards/mean", r"val/.+/(acc|score|reward)"],
    "kl": [r"actor/ppo_kl", r"actor/kl_loss", r"actor/reward_kl_penalty", r"actor/reward_kl_penalty_coeff"],
    "length": [r"response_length/mean", r"response_length/clip_ratio"],
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
    parser.add_argument("log", help="metrics.jsonl written by the jsonl logger")
    parser.add_argument("--out", default=None, help="PNG path (default: curves.png next to the log)")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_metrics needs matplotlib: pip install matplotlib") from None
    series = collect_series(read_metrics(args.log))
    if not series:
        raise SystemExit(f"{args.log}: no reward, KL or length metrics to plot")
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.6), squeeze=False)
    for ax, (panel, metrics) in zip(axes[0], series.items()):
        for name, (steps, values) in metrics.items():
            ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=name)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.log)), "curves.png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
