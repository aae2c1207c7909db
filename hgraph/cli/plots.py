"""PNG plots of a training run (matplotlib, headless): loss, strategy per iteration with pipeline
loads, predicted vs measured iteration time, and the communication timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from hgraph.core import atomic_files  # noqa: E402
from hgraph.runtime import timeline  # noqa: E402


def _save(fig: Any, path: Path) -> None:
    """Write ``fig`` to ``path`` atomically (the format from its suffix)."""
    with atomic_files.atomic_open(path, "wb") as fh:
        fig.savefig(fh, format=Path(path).suffix.lstrip(".") or "png", dpi=110)


def loss_curve(path: Path, history: Sequence[dict], baseline: Optional[Sequence[dict]] = None,
               heldout: Optional[Sequence[dict]] = None, label: str = "training, hgraph (planner)") -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["iteration"] for h in history], [h["loss"] for h in history], label=label)
    if baseline:
        ax.plot([h["iteration"] for h in baseline], [h["loss"] for h in baseline], "--",
                label=f"homogeneous {baseline[0]['strategy']}")
    if heldout:
        ax.plot([e["iteration"] for e in heldout], [e["loss"] for e in heldout], "o-", label="held-out")
    ax.set_xlabel("iteration")
    ax.set_ylabel("token-mean cross entropy")
    ax.set_title("loss")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def train_and_heldout(path: Path, history: Sequence[dict], evals: Sequence[dict]) -> None:
    """Training loss per iteration and held-out loss at each evaluation, on one axis."""
    loss_curve(path, history, heldout=evals, label="training (batch)")


def strategy_and_loads(path: Path, history: Sequence[dict]) -> None:
    """Top: which strategy ran each iteration. Bottom: tokens each pipeline got (stacked)."""
    names = sorted({h["strategy"] for h in history}, key=lambda s: [h["strategy"] for h in history].index(s))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    its = [h["iteration"] for h in history]
    top.scatter(its, [names.index(h["strategy"]) for h in history], marker="s")
    top.set_yticks(range(len(names)), names, fontsize=8)
    top.set_title("strategy chosen per iteration")
    width = max(len(h["dispatch"]) for h in history)
    bottoms = [0.0] * len(history)
    for p in range(width):
        loads = [
            sum(h["lengths"][i] for mb in h["dispatch"][p] for i in mb) if p < len(h["dispatch"]) else 0
            for h in history
        ]
        bottom.bar(its, loads, bottom=bottoms, label=f"pipeline {p}")
        bottoms = [b + x for b, x in zip(bottoms, loads)]
    bottom.set_xlabel("iteration")
    bottom.set_ylabel("tokens")
    bottom.set_title("tokens per pipeline")
    bottom.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def predicted_vs_measured(path: Path, history: Sequence[dict]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    its = [h["iteration"] for h in history]
    ax.plot(its, [h.get("measured_ms", h["seconds"] * 1000) for h in history], label="measured")
    if any(h.get("predicted_raw_ms") is not None for h in history):
        ax.plot(its, [h["predicted_raw_ms"] or 0 for h in history], ":", label="predicted (profiled, uncorrected)")
    ax.plot(its, [h["predicted_ms"] or 0 for h in history], label="predicted (online-corrected)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("ms")
    ax.set_title("iteration time: predicted vs measured")
    ax.legend()
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def timeline_files(out: Path, events: Sequence[Any]) -> list[str]:
    """Perfetto/Chrome trace and Gantt PNG of the recorded timeline (when the runtime recorded one)."""
    if not events:
        return []
    timeline.write_chrome_trace(events, out / "trace.json")
    last = max(e.iteration for e in events)
    recent = [e for e in events if e.iteration >= last - 1]  # the whole run is in trace.json
    timeline.plot_gantt(recent, out / "timeline.png", title=f"iterations {max(0, last - 1)}-{last}, every rank")
    return []
