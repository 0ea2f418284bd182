"""The evaluation's human forms: a Markdown table and the accuracy-vs-tokens plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _row(name: str, r: dict[str, Any], scenarios: list[str]) -> str:
    cells = [f"{100 * r['accuracy'].get(s, float('nan')):.1f}" for s in scenarios]
    return (
        f"| {name} | {r['visual_tokens']:.1f} | " + " | ".join(cells) + f" | {r['ttft_ms']:.1f} |"
    )


def table(result: dict[str, Any]) -> str:
    """Accuracy (%) per scenario for every profile, every method and fraction, then every detail
    level."""
    rows = list(result["profiles"].items())
    for method, by_pruned in result.get("methods", {}).items():
        rows += [(f"{method} {p}% pruned", r) for p, r in by_pruned.items()]
    rows += [(f"detail={level}", r) for level, r in result.get("details", {}).items()]
    scenarios = sorted({s for _, r in rows for s in r["accuracy"]})
    head = "| setting | visual tokens | " + " | ".join(scenarios) + " | TTFT ms (median) |"
    rule = "|" + " --- |" * (len(scenarios) + 3)
    return "\n".join([head, rule, *(_row(name, r, scenarios) for name, r in rows)])


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel per scenario; in each, one line per method from no pruning (the `none`
    profile, when evaluated) down to 80% pruned; pooling is one point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = result.get("methods", {})
    base = result["profiles"].get("none")
    scenarios = sorted(next(iter(result["profiles"].values()))["accuracy"])
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4 * len(scenarios), 3.6), sharey=True)
    for ax, scenario in zip(axes, scenarios, strict=True):
        for method, by_pruned in methods.items():
            points = [base] if base is not None and len(by_pruned) > 1 else []
            points += [by_pruned[p] for p in sorted(by_pruned, key=int)]
            xs = [p["visual_tokens"] for p in points]
            ys = [100 * p["accuracy"][scenario] for p in points]
            ax.plot(xs, ys, marker="o" if len(xs) > 1 else "s", label=method)
        ax.set_title(scenario)
        ax.set_xlabel("visual tokens kept")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
