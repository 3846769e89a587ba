"""Human-readable records of the acceptance evaluations of one run (written by training/callbacks.py).

    report.write_all(run_dir, history, settings, eval_seconds, launch_seconds)

writes into the run folder, each file replaced atomically after every evaluation:
    report.md                  one row per evaluation: step, losses, tau per budget with the drafter's
                               own expectation, chain tau, eval time; the best checkpoint marked
    tau.png                    tau per budget vs step, the chain dashed, expectations dotted
    eval/accepted_depths.csv   step,method,depth,count: how deep each verification round got

`history` is AcceptanceEvaluation.history: [{"step", "train_loss", "val_loss", "seconds",
"checkpointed", "summary": {CHAIN | tree_key(B): {"tau", "expected_tau", "accepted_depth_counts", ...}}}]
(ddtree.bench.acceptance_summary per method key).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ddtree.bench import CHAIN, tree_key
from ddtree.files import atomic_file, write_text_atomic


def best_record(history: list[dict], primary_budget: int) -> dict | None:
    """The checkpointed evaluation with the highest primary tau; the latest on ties, as BestCheckpoint keeps it."""
    best = None
    for record in history:
        if record["checkpointed"]:
            tau = record["summary"][tree_key(primary_budget)]["tau"]
            if best is None or tau >= best["summary"][tree_key(primary_budget)]["tau"]:
                best = record
    return best


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_report(run_name: str, history: list[dict], settings: dict, eval_seconds: float, launch_seconds: float) -> str:
    budgets, primary = settings["budgets"], settings["primary_budget"]
    best = best_record(history, primary)
    lines = [
        f"# Acceptance during training: {run_name}",
        "",
        f"Measured by `ddtree.bench.run_benchmark` (the code behind `ddtree bench`) at temperature 0 on the first "
        f"{settings['num_prompts']} prompts of `{settings['prompts']}`, up to {settings['max_new_tokens']} new tokens "
        "each. tau = tokens committed per target verification (accepted draft tokens + the bonus token), at most the "
        f"block size ({settings['block_size']}). In brackets: the tau the drafter itself expected for the trees it "
        "built (1 + sum of their path probabilities); far above the measurement means an over-confident drafter.",
        "",
    ]
    if settings.get("lookup"):
        lines += [f"Every tree carries {settings['lookup']} tokens of context lookup (`eval.lookup`, `ddtree bench "
                  "--lookup`): its tau is the decoder's, not the drafter's alone; the chain is the drafter's.", ""]
    if settings.get("corpus"):
        lines += ["Every tree also carries the training replies' majority continuation (`model.corpus`; the "
                  "drafter's exports ship them, `ddtree bench --corpus none` leaves them out).", ""]
    if settings.get("redraft"):
        lines += [f"Each round re-drafts behind the {settings['redraft']} best depth-1 tokens (`eval.redraft`, `ddtree "
                  "bench --redraft`), the chain behind its first: one more drafter forward a round.", ""]
    if best is not None:
        lines += [
            f"**Best checkpoint by tau@{primary}: step {best['step']}** "
            f"(tau {best['summary'][tree_key(primary)]['tau']:.3f}; `checkpoints/best.ckpt` links to it).",
            "",
        ]
    header = ["step", "train loss", "val loss", *[f"tau@{b} (expected)" for b in budgets], "chain tau", "eval s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for record in history:
        summary = record["summary"]
        step = str(record["step"])
        if record is best:
            step = f"**{step}** (best)"
        elif not record["checkpointed"]:
            step = f"{step} (no checkpoint)"
        cells = [step, _number(record["train_loss"]), _number(record["val_loss"])]
        for b in budgets:
            stats = summary[tree_key(b)]
            cells.append(f"{stats['tau']:.3f} ({stats['expected_tau']:.2f})")
        cells += [f"{summary[CHAIN]['tau']:.3f}", f"{record['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    share = 100 * eval_seconds / launch_seconds if launch_seconds > 0 else 0.0
    lines += [
        "",
        f"This launch so far: evaluation took {eval_seconds:.1f} s of {launch_seconds:.1f} s wall time ({share:.1f}%).",
        "",
        "![tau per budget vs step](tau.png)",
        "",
    ]
    return "\n".join(lines)


def plot_tau(history: list[dict], settings: dict) -> Figure:
    """tau per budget vs step (solid), the drafter's expectation (dotted, same colour), the chain (dashed)."""
    budgets, primary = settings["budgets"], settings["primary_budget"]
    figure = Figure(figsize=(8, 4.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    steps = [record["step"] for record in history]
    values = []
    for i, budget in enumerate(budgets):
        key = tree_key(budget)
        measured = [r["summary"][key]["tau"] for r in history]
        expected = [r["summary"][key]["expected_tau"] for r in history]
        axes.plot(steps, measured, "o-", color=f"C{i}", label=f"DDTree, budget {budget}")
        axes.plot(steps, expected, ":", color=f"C{i}", alpha=0.8)
        values += measured + expected
    chain = [r["summary"][CHAIN]["tau"] for r in history]
    axes.plot(steps, chain, "s--", color="black", label="DFlash chain")
    axes.plot([], [], ":", color="grey", label="dotted: expected by the drafter")
    best = best_record(history, primary)
    if best is not None:
        axes.plot([best["step"]], [best["summary"][tree_key(primary)]["tau"]], "*", color="gold", markersize=16,
                  markeredgecolor="black", label=f"best checkpoint (budget {primary})", zorder=5)
    values += chain
    axes.set_ylim(0.9, max(2.0, max(values) * 1.08))  # tau >= 1 always; keep a flat start readable
    axes.ticklabel_format(axis="y", useOffset=False)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_xlabel("training step")
    axes.set_ylabel("tau (tokens per verification)")
    axes.set_title(f"Measured acceptance on {settings['num_prompts']} held-out prompts, T=0")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    figure.tight_layout()
    return figure


def depth_counts_csv(history: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", "method", "depth", "count"])
    for record in history:
        for key, stats in record["summary"].items():
            for depth, count in stats["accepted_depth_counts"].items():
                writer.writerow([record["step"], key, depth, count])
    return out.getvalue()


def write_all(run_dir: Path, history: list[dict], settings: dict, eval_seconds: float, launch_seconds: float) -> None:
    run_dir = Path(run_dir)
    write_text_atomic(run_dir / "report.md", markdown_report(run_dir.name, history, settings, eval_seconds, launch_seconds))
    with atomic_file(run_dir / "tau.png", "wb") as f:
        plot_tau(history, settings).savefig(f, format="png")
    write_text_atomic(run_dir / "eval" / "accepted_depths.csv", depth_counts_csv(history))
