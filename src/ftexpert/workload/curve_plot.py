"""Plot the routing statistics against tokens trained (``train_moe --curve-points``), beside the published
figures of real checkpoints of the same routing shapes:

    python -m ftexpert.workload.curve_plot --out docs/workload/routing_curve.png MODEL_DIR_OR_JSON ...

Each argument is a checkpoint directory (its ``ft_workload.json``) or such a JSON file. Needs matplotlib
(``pip install matplotlib``; not a dependency of the service).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Published figures for real checkpoints of these routing shapes (docs/WORKLOAD.md, "Targets").
TARGETS = {"reuse": 0.37, "lru_layer_25": 0.51, "lru_layer_50": 0.80, "recall_k": (0.74, 0.85)}
PANELS = ("reuse", "lru_layer_25", "lru_layer_50", "recall_k", "imbalance", "held_out_loss")


def load(path: Path) -> dict:
    meta = path / "ft_workload.json" if path.is_dir() else path
    data = json.loads(meta.read_text())
    if not data.get("curve"):
        raise SystemExit(f"{meta}: no 'curve' (train with --curve-points N)")
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="curve_plot", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    try:        # optional: matplotlib (the soak extra)
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("curve_plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    runs = [load(r) for r in args.runs]
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, key in zip(axes.flat, PANELS):
        for run in runs:
            xs = [row["tokens"] / 1e6 for row in run["curve"]]
            ax.plot(xs, [row.get(key) for row in run["curve"]], marker="o", label=run["shape"])
        target = TARGETS.get(key)
        if isinstance(target, tuple):
            ax.axhspan(*target, color="grey", alpha=0.2, label="published")
        elif target is not None:
            ax.axhline(target, color="grey", linestyle="--", label="published")
        ax.set_title(key)
        ax.set_xlabel("tokens trained (M)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("Routing statistics on held-out text against tokens trained")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
