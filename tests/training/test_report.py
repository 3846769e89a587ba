"""Unit tests of what report.md, tau.png and the model card say (training/report.py, training/model_card.py).

    .venv/bin/pytest -q tests/training/test_report.py

Pure functions on hand-made records: no model, no training (test_eval_callback.py and test_publish.py run those end
to end). Each test pins a figure or a sentence that a real run's records reach only at sizes the end-to-end tests
are too small for: taus above 2, limits of hours, checkpoints short of max_steps.
"""

from __future__ import annotations

import math

from ddtree.bench import CHAIN, tree_key
from training.report import plot_tau

PROMPTS = "data/eval_prompts.jsonl"
SETTINGS = dict(prompts=PROMPTS, num_prompts=1, max_new_tokens=4, budgets=[8], primary_budget=8, block_size=8)


def record(step: int, tau: float, **extra) -> dict:
    """One evaluation as AcceptanceEvaluation.history holds it, every method at `tau`."""
    stats = {"tau": tau, "expected_tau": tau, "rounds": 1, "accepted_depth_counts": {}}
    return {"step": step, "train_loss": None, "val_loss": None, "seconds": 0.0, "checkpointed": True,
            "summary": {CHAIN: stats, tree_key(8): stats}, **extra}


def test_tau_png_shows_a_tau_above_2_and_the_floor_of_1():
    """Real runs measure taus of 3 to 6; a plot held at 2 drew them as a flat line along its top edge."""
    axes = plot_tau([record(2, math.nan), record(4, 3.5)], SETTINGS).axes[0]  # NaN: a step no round measured
    bottom, top = axes.get_ylim()
    assert top >= 3.5 and bottom <= 1.0
