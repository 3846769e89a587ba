"""Human-readable records of the acceptance evaluations of one run (written by training/callbacks.py).

    report.write_all(run_dir, history, settings, eval_seconds, launch_seconds)

writes into the run folder, each file replaced atomically after every evaluation:
    report.md                  one row per evaluation: step, losses, tau per budget with the drafter's
                               own expectation, chain tau, eval time; the best checkpoint marked
    tau.png                    tau per budget vs step, the chain dashed, expectations dotted
    eval/accepted_depths.csv   step,method,depth,count: how deep each verification round got

`history` is AcceptanceEvaluation.history: [{"step", "train_loss", "val_loss", "seconds",
"checkpointed", "summary": {CHAIN | tree_key(B): {"tau", "expected_tau", "accepted_depth_counts", ...}}}]
(ddtree.bench.acceptance_summary per method key). A record with "non_finite_tensors" was not decoded (the
drafter's weights held NaN or inf): its taus are NaN, its row says so and it ranks last. One with "unsaved" was
measured, but the launch stopped while saving its checkpoint (a full disk, Ctrl-C): its row says so, and it is no best.

    report.write_no_evaluation(run_dir, reason)

writes report.md alone for a run that ended before any evaluation, with the reason.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ddtree.bench import CHAIN, tree_key
from ddtree.files import atomic_file, write_text_atomic

from .loss import OBJECTIVE_SETTINGS, published_gamma


def ranking_score(tau: float) -> float:
    """A tau as checkpoints are ranked by it (BestCheckpoint, best_record): NaN, nothing measured, below every tau."""
    return -math.inf if math.isnan(tau) else tau


def primary_score(record: dict, primary_budget: int) -> float:
    return ranking_score(record["summary"][tree_key(primary_budget)]["tau"])


def best_record(history: list[dict], primary_budget: int) -> dict | None:
    """The checkpointed evaluation with the highest primary tau; the latest on ties, as BestCheckpoint keeps it."""
    best = None
    for record in history:
        if record["checkpointed"]:
            if best is None or primary_score(record, primary_budget) >= primary_score(best, primary_budget):
                best = record
    return best


def tau_bound(block_size: int, lookup: int) -> str:
    """The most a round can commit, as report.md and the model card word it: the block, or past it for a tree whose
    context lookup runs deeper (ddtree.decoding.draft_tree grafts its path beyond the drafted block)."""
    bound = f"at most {block_size} (the block size)"
    if lookup + 1 > block_size:
        bound += f" for the chain, and up to {lookup + 1} for a tree, whose {lookup}-token context lookup may run deeper"
    return bound


def objective_description(hyper_parameters: dict) -> str:
    """The training loss a run's hyper-parameters name, in words: its objective and any distillation."""
    objective = hyper_parameters.get("objective", "decayed_ce")
    text = f"`model.objective={objective}`"
    settings = {  # what each setting the objective reads says of it, as OBJECTIVE_SETTINGS lists them (gamma: elsewhere)
        "objective_smoothing": f"smoothing {hyper_parameters.get('objective_smoothing', 0.5):g}",
        "objective_top_k": f"top-{hyper_parameters.get('objective_top_k', 4)} survival",
        "objective_budget": f"the drafter's own tree of {hyper_parameters.get('objective_budget', 32)} nodes",
    }
    details = [said for name, said in settings.items() if objective in OBJECTIVE_SETTINGS[name]]
    if details:
        text += f" ({', '.join(details)})"
    distill = float(hyper_parameters.get("distill_weight") or 0.0)
    if distill:
        top_k = int(hyper_parameters.get("distill_top_k") or 0)
        teacher = f"the target's top {top_k}" if top_k else "the target's distribution"
        text += f" with {hyper_parameters.get('distill_loss', 'kl')} distillation from {teacher} at weight {distill:g}"
    return text


def target_note(hyper_parameters: dict) -> str | None:
    """What report.md says of a target given as a base model and a PEFT adapter (model.target_adapter; None without
    one): its taus are the merged model's, and that model, not the base one, is what decodes and serves."""
    adapter = hyper_parameters.get("target_adapter")
    if not adapter:
        return None
    files = hyper_parameters.get("target_adapter_sha256")
    recorded = f" (sha256 of its `adapter_*` files `{files}`)" if files else ""
    return (f"The target is `{hyper_parameters.get('target')}` with the PEFT adapter `{adapter}`{recorded} merged into "
            "its weights, and these taus are that merged model's: decode and serve it merged (docs/training.md, A "
            "target with a PEFT adapter). The base model alone decodes its own text, at an acceptance not measured here.")


def training_loss_note(hyper_parameters: dict, block_size: int) -> str | None:
    """What the train loss column holds where it is not the val loss column's loss (None where it is): the val loss is
    the published decayed cross-entropy at the published gamma for the block size (DistillModule.shared_step)."""
    gamma, published = hyper_parameters.get("gamma"), published_gamma(block_size)
    other_gamma = gamma is not None and gamma != published
    if (hyper_parameters.get("objective", "decayed_ce") == "decayed_ce" and not hyper_parameters.get("distill_weight")
            and not other_gamma):
        return None
    training = objective_description(hyper_parameters) + (f" at `model.gamma={gamma:g}`" if other_gamma else "")
    return (f"The train loss is the training objective ({training}) on that step's batch; the val loss is the "
            f"published decayed cross-entropy on the validation split (gamma {published:g}, the published one for block "
            f"size {block_size}), whatever the objective and gamma, so runs compare by it. The two columns are "
            "different losses: they do not compare with each other.")


def partial_data_note(record: dict | None) -> str | None:
    """What report.md and the card say of a run that drew from part of its training split (DistillDataModule.record,
    <run>/data.json: a time-boxed feature store holds only the sequences its build reached); None where it drew from
    all of it, or where nothing says."""
    record = record if isinstance(record, dict) else {}
    drawn, split = record.get("train_sequences"), record.get("train_split_sequences")
    if not (isinstance(drawn, int) and isinstance(split, int) and drawn < split):
        return None
    return (f"trained on {drawn} of the {split} sequences of the training split: its feature store was built under a "
            "time box (`data.store_max_minutes`) and holds only those")


def tokenization_note(record: dict | None) -> str | None:
    """What report.md and the card say of a run whose data lost conversations in the tokenization
    (DistillDataModule.record's counts, tokenize_conversations: the log's one warning said so, the report did not);
    None where it kept them all, or where nothing says (a run older than the counts)."""
    counts = record.get("tokenization") if isinstance(record, dict) else None
    counts = counts if isinstance(counts, dict) else {}
    kept, total = counts.get("kept"), counts.get("conversations")
    if not (isinstance(kept, int) and isinstance(total, int) and kept < total):
        return None
    cut = counts.get("reply_truncated") or 0
    reasons = [(counts.get("no_assistant"), "with no assistant turn"),
               (counts.get("too_few_supervised"), "with fewer supervised tokens than `data.min_supervised_tokens` within "
                "`data.max_length`" + (f" ({cut} of them because truncation cut their reply)" if cut else "")),
               (counts.get("unaligned"), "whose render the loss mask cannot follow (the log names the first)")]
    dropped = ", ".join(f"{count} {why}" for count, why in reasons if isinstance(count, int) and count > 0)
    return f"kept {kept} of the {total} conversations of its data in the tokenization" + (
        f": it dropped {dropped}" if dropped else "")


def data_notes(record: dict | None) -> list[str]:
    """Every sentence report.md and the card say of what a run drew from its data (<run>/data.json)."""
    return [note for note in (tokenization_note(record), partial_data_note(record)) if note]


def duration_text(seconds: float) -> str:
    """Seconds as trainer.max_time is written: DD:HH:MM:SS."""
    seconds = round(seconds)
    return f"{seconds // 86400:02d}:{seconds % 86400 // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def training_end(step: int, max_steps: int | None, time_spent: bool) -> str | None:
    """Which limit ended training at `step`: max_steps where the step reached it, else max_time where its budget was
    spent (the Timer `trainer.max_time` adds); None where neither did (training goes on, or stopped otherwise)."""
    planned = max_steps is not None and max_steps >= 0
    if planned and step >= max_steps:
        return f"max_steps ended training at step {step}"
    if time_spent:
        return f"max_time ended training at step {step}" + (f", {max_steps - step} steps short of max_steps"
                                                           if planned else "")
    return None


def _number(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def unmeasured_tau(value: float | None) -> bool:
    """A tau no round measured: NaN here (callbacks.measured_summary), null in eval/step-N.json."""
    return value is None or math.isnan(value)


def tau_text(value: float | None, digits: int = 3) -> str:
    """A tau, or "-" where no round measured it."""
    return "-" if unmeasured_tau(value) else f"{value:.{digits}f}"


def primary_digits(history: list[dict], primary_budget: int, best: dict | None) -> int:
    """Decimals for the primary tau: 3, or as many as tell the best checkpoint's from every other checkpointed step's
    that differs from it. At 3 a tau a hair below the best's printed equal to it, and the report then seemed to mark
    the earlier of two equal steps best, against the latest-wins rule it states."""
    if best is None or best.get("non_finite_tensors"):
        return 3
    value = primary_score(best, primary_budget)
    others = [primary_score(record, primary_budget) for record in history
              if record["checkpointed"] and record is not best and not record.get("non_finite_tensors")
              and tree_key(primary_budget) in record["summary"]]
    for digits in range(3, 7):
        if all(f"{other:.{digits}f}" != f"{value:.{digits}f}" for other in others if other != value):
            return digits
    return 7


def markdown_report(run_name: str, history: list[dict], settings: dict, eval_seconds: float, launch_seconds: float) -> str:
    budgets, primary = settings["budgets"], settings["primary_budget"]
    best = best_record(history, primary)
    digits = primary_digits(history, primary, best)
    lines = [
        f"# Acceptance during training: {run_name}",
        "",
        f"Measured by `ddtree.bench.run_benchmark` (the code behind `ddtree bench`) at temperature 0 on the first "
        f"{settings['num_prompts']} prompts of `{settings['prompts']}`, up to {settings['max_new_tokens']} new tokens "
        "each. tau = tokens committed per target verification (accepted draft tokens + the bonus token), "
        f"{tau_bound(settings['block_size'], settings.get('lookup') or 0)}. In brackets: the tau the drafter itself "
        "expected for the trees it "
        "built (1 + sum of their path probabilities); far above the measurement means an over-confident drafter.",
        "",
    ]
    if settings.get("target_note"):
        lines += [settings["target_note"], ""]
    if settings.get("lookup"):
        lines += [f"Every tree carries {settings['lookup']} tokens of context lookup (`eval.lookup`, `ddtree bench "
                  "--lookup`): its tau is the decoder's, not the drafter's alone; the chain is the drafter's.", ""]
    if settings.get("corpus"):
        lines += ["Every tree also carries the training replies' majority continuation (`model.corpus`; the "
                  "drafter's exports ship them, `ddtree bench --corpus none` leaves them out).", ""]
    if (settings.get("lookup") or settings.get("corpus")) and not settings.get("calibrated"):
        lines += ["The expected tau counts the lookups' nodes by the drafter's own probabilities, and the target accepts "
                  "them far more often than that (docs/objectives.md, Calibration): here the measured tau runs above "
                  "the expected one whatever the drafter's confidence. The chain's pair is the drafter's own.", ""]
    if settings.get("redraft"):
        lines += [f"Each round re-drafts behind the {settings['redraft']} best depth-1 tokens (`eval.redraft`, `ddtree "
                  "bench --redraft`), the chain behind its first: one more drafter forward a round.", ""]
    for note in settings.get("data_notes") or []:
        lines += [f"This run {note}.", ""]
    if settings.get("ended"):  # which limit, beside the planned length: a stop well short of max_steps reads as such
        lines += [f"Planned length: {settings['planned_length']}; {settings['ended']}.", ""]
    if best is not None and best.get("non_finite_tensors"):
        lines += [f"**Best checkpoint by tau@{primary}: step {best['step']}**, though nothing was measured: no "
                  "checkpointed step's drafter had finite weights (`checkpoints/best.ckpt` links to it).", ""]
    elif best is not None:
        best_tau = best["summary"][tree_key(primary)]["tau"]
        lines += [
            f"**Best checkpoint by tau@{primary}: step {best['step']}** "
            f"(tau {tau_text(best_tau, digits)}; `checkpoints/best.ckpt` links to it).",
            "",
        ]
    header = ["step", "train loss", "val loss", *[f"tau@{b} (expected)" for b in budgets], "chain tau", "eval s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for record in history:
        summary = record["summary"]
        step = str(record["step"])
        if record is best:
            step = f"**{step}** (best)"
        elif record.get("unsaved"):
            step = f"{step} (checkpoint not saved)"
        elif not record["checkpointed"]:
            step = f"{step} (no checkpoint)"
        cells = [step, _number(record["train_loss"]), _number(record["val_loss"])]
        if record.get("non_finite_tensors"):
            cells[0] += f" **weights not finite** ({record['non_finite_tensors']} tensors)"
            cells += ["not measured"] * len(budgets) + ["not measured"]
        else:
            for b in budgets:  # a budget added on a resume: the rows before it did not measure it
                stats = summary.get(tree_key(b))
                places = digits if b == primary else 3
                cells.append("-" if stats is None or unmeasured_tau(stats["tau"])
                             else f"{stats['tau']:.{places}f} ({tau_text(stats['expected_tau'], 2)})")
            cells.append(tau_text(summary[CHAIN]["tau"]))
        cells.append(f"{record['seconds']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    broken = [str(record["step"]) for record in history if record.get("non_finite_tensors")]
    if broken:
        lines += ["", f"Weights not finite at step{'s' if len(broken) > 1 else ''} {', '.join(broken)}: the drafter's "
                  "parameters held NaN or inf, so it was not decoded (decoding stays lossless whatever such a drafter "
                  "proposes, at tau 1.0, which measures nothing). Such a step ranks below every measured one."]
    unsaved = [str(record["step"]) for record in history if record.get("unsaved")]
    if unsaved:
        again = ("a resume from the last saved checkpoint trains and measures that step again" if best is not None
                 else "no checkpoint was saved, so the run starts again (the same command) to train and measure it")
        lines += ["", f"Checkpoint not saved at step {', '.join(unsaved)}: the launch stopped while saving it (a full "
                  f"disk, an interrupt or a crash), so it ranks for no best; {again}."]
    if any(unmeasured_tau(stats["tau"]) for record in history if not record.get("non_finite_tensors")
           for stats in record["summary"].values()):
        lines += ["", "A tau shown as `-` was not measured: no verification round ran (every prompt ended on the "
                  "target's first token). Such a step ranks below every measured one."]
    if settings.get("train_loss_note"):
        lines += ["", settings["train_loss_note"]]
    share = 100 * eval_seconds / launch_seconds if launch_seconds > 0 else 0.0
    lines += [
        "",
        f"This launch so far: evaluation took {eval_seconds:.1f} s of the {launch_seconds:.1f} s since training started "
        f"({share:.1f}%; the set-up before it, loading and data, not counted).",
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
        missing = {"tau": math.nan, "expected_tau": math.nan}  # a budget added on a resume: a gap before it
        measured = [r["summary"].get(key, missing)["tau"] for r in history]
        expected = [r["summary"].get(key, missing)["expected_tau"] for r in history]
        axes.plot(steps, measured, "o-", color=f"C{i}", label=f"DDTree, budget {budget}")
        axes.plot(steps, expected, ".:", color=f"C{i}", alpha=0.8)  # a point with no neighbour is a dot, not nothing
        values += measured + expected
    chain = [r["summary"][CHAIN]["tau"] for r in history]
    axes.plot(steps, chain, "s--", color="black", label="DFlash chain")
    axes.plot([], [], ".:", color="grey", label="dotted: expected by the drafter")
    best = best_record(history, primary)
    if best is not None and not best.get("non_finite_tensors"):
        axes.plot([best["step"]], [best["summary"][tree_key(primary)]["tau"]], "*", color="gold", markersize=16,
                  markeredgecolor="black", label=f"best checkpoint (budget {primary})", zorder=5)
    broken = [record["step"] for record in history if record.get("non_finite_tensors")]
    for i, step in enumerate(broken):  # their taus are NaN: the lines break there
        axes.axvline(step, color="red", linestyle="--", alpha=0.6,
                     label="weights not finite (not measured)" if i == 0 else None)
    values = [value for value in values + chain if not math.isnan(value)]
    axes.set_ylim(0.9, max(2.0, max(values, default=1.0) * 1.08))  # tau >= 1 always; keep a flat start readable
    axes.ticklabel_format(axis="y", useOffset=False)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.set_xlabel("training step")
    axes.set_ylabel("tau (tokens per verification)")
    # The prompts by name: nothing here knows whether they are held out (the exported card checks that).
    axes.set_title(f"Measured acceptance on {settings['num_prompts']} prompts of {Path(settings['prompts']).name}, T=0")
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


def no_evaluation_report(run_name: str, reason: str) -> str:
    return "\n".join([
        f"# Acceptance during training: {run_name}",
        "",
        f"**No evaluation ran**: {reason}. No tau was measured and no checkpoint was ranked by one; once an "
        "evaluation runs (a resume reaches a scheduled step), this report shows it, with tau.png.",
        "",
    ])


def write_no_evaluation(run_dir: Path, reason: str) -> None:
    run_dir = Path(run_dir)
    write_text_atomic(run_dir / "report.md", no_evaluation_report(run_dir.name, reason))


def write_all(run_dir: Path, history: list[dict], settings: dict, eval_seconds: float, launch_seconds: float) -> None:
    run_dir = Path(run_dir)
    write_text_atomic(run_dir / "report.md", markdown_report(run_dir.name, history, settings, eval_seconds, launch_seconds))
    with atomic_file(run_dir / "tau.png", "wb") as f:
        plot_tau(history, settings).savefig(f, format="png")
    write_text_atomic(run_dir / "eval" / "accepted_depths.csv", depth_counts_csv(history))
