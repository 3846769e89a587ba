"""The numbers DistillModule logs, against their formulas: val/loss, val/acc_k, val/recall4_k and the chain estimates
(val/ and train/), and the anchor draws behind them.

    .venv/bin/pytest -q tests/training/test_module_metrics.py

These values feed report.md, `make ablate`'s table and the progress bar; a wrong divisor in one still trains and
logs a plausible number, so each is checked against the counts it is made of (a mutation review, 2026-12).
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from training.loss import RECALL_K, chain_acceptance
from training.masks import sample_anchors
from training.module import DistillModule, StepResult
from test_module import BLOCK, synthetic_batch, tiny_module  # tests/training is on the path, as for toy_data

# Replies made of six words, of which the drafter proposes the first four: a random drafter over a few words
# hits some labels (over the whole vocabulary it hits none, sharpened target or not, and every accuracy would
# read 0 whatever its divisor), and the two words outside its vocabulary count as misses.
WORDS = [1000, 2000, 3000, 4000, 5000, 6000]
DRAFT_VOCAB = WORDS[:4]


def few_word_batch(seed: int) -> dict:
    batch = synthetic_batch(length=32, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), batch["input_ids"].shape, generator=generator)
    batch["input_ids"] = torch.tensor(WORDS)[picks]
    return batch


@pytest.fixture
def few_word_module(monkeypatch):
    """Builds tiny modules that draft from DRAFT_VOCAB (chosen from no training split)."""
    monkeypatch.setattr(DistillModule, "_training_reply_vocabulary", lambda self, vocab_size: DRAFT_VOCAB)

    def build() -> DistillModule:
        torch.manual_seed(0)
        return tiny_module(draft_vocab_size=len(DRAFT_VOCAB))

    return build


def validate(module: DistillModule, batches: list[dict]) -> dict:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    return trainer.validate(module, dataloaders=DataLoader(batches, batch_size=None), verbose=False)[0]


def test_validation_metrics_are_the_formulas_over_the_counts_summed_over_its_batches(few_word_module):
    """val/loss is sum(w*CE) / sum(w) and val/acc_k is hits_k / tokens_k, each over the sums of every batch. Dividing
    the loss by the token count (0.5 for 2.5 in a review) or the accuracy at k by the tokens at k - 1 (val/acc_1 read
    30.0, a hit count, and the chain estimate 52.6) passed every test: none compared them with the counts."""
    module = few_word_module()
    batches = [few_word_batch(seed) for seed in range(3)]
    logged = validate(module, batches)
    with torch.no_grad():  # the same batches at the same indices draw the same anchors (validation's fixed draw)
        results = [module.shared_step(batch, index, "val") for index, batch in enumerate(batches)]
    total = {name: sum(getattr(result, name) for result in results)
             for name in ("weighted_ce", "weight_total", "hits", "tokens", "top_hits")}
    hits, tokens = total["hits"][1:], total["tokens"][1:]  # (B-1,): position 0 is the anchor, never counted
    assert hits.min() > 0 and torch.all(hits < tokens)  # accuracies strictly between 0 and 1
    assert total["weight_total"] < tokens.sum()  # decayed weights: a per-token mean would read otherwise
    accuracy = hits / tokens
    assert logged["val/loss"] == pytest.approx(float(total["weighted_ce"] / total["weight_total"]), rel=1e-5)
    assert [logged[f"val/acc_{k}"] for k in range(1, BLOCK)] == pytest.approx(accuracy.tolist(), rel=1e-5)
    assert logged["val/tau_chain_estimate"] == pytest.approx(float(chain_acceptance(accuracy)), rel=1e-5)
    recall = total["top_hits"][1:] / tokens
    assert [logged[f"val/recall{RECALL_K}_{k}"] for k in range(1, BLOCK)] == pytest.approx(recall.tolist(), rel=1e-5)


def test_a_second_validation_reports_the_weights_it_validates_not_an_average_with_the_first(few_word_module):
    """Each evaluation starts fresh sums: kept from the one before, val/loss became the average since the run began
    (10.8177 where the weights validated at 10.8097, a review), and no test validated a module twice."""
    module = few_word_module()
    batches = [few_word_batch(seed) for seed in range(3)]
    first = validate(module, batches)
    with torch.no_grad():  # what training would do between two evaluations
        for parameter in module.drafter.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    second = validate(module, batches)
    fresh = few_word_module()
    fresh.drafter.load_state_dict(module.drafter.state_dict())
    afresh = validate(fresh, batches)
    assert second["val/loss"] != pytest.approx(first["val/loss"], rel=1e-4)  # the weights changed it
    for key in ("val/loss", "val/tau_chain_estimate", "val/acc_1"):
        assert second[key] == pytest.approx(afresh[key], rel=1e-5), key


def test_training_logs_each_positions_accuracy_and_their_chain_estimate(monkeypatch):
    """train/acc_k is hits_k / tokens_k of the step, and train/tau_chain_estimate (on the progress bar) their chain:
    reading the counts one position early shifted every accuracy and pinned the estimate at 1.0, and the test of
    training's logs only asked that the keys exist."""
    module = tiny_module()
    hits, tokens = torch.tensor([0, 30, 20, 10]), torch.tensor([0, 36, 34, 30])  # (B,) position 0: the anchor
    step = StepResult(torch.tensor(2.5), torch.tensor(50.0), torch.tensor(20.0), hits, tokens, hits, lambda: 0.0)
    monkeypatch.setattr(module, "shared_step", lambda batch, batch_idx, stage: step)
    monkeypatch.setattr(module, "_logs_written", lambda: True)  # this step's details are written
    logged = {}
    monkeypatch.setattr(module, "log", lambda name, value, **kwargs: logged.__setitem__(name, float(value)))
    monkeypatch.setattr(module, "log_dict", lambda values, **kwargs: logged.update(
        {name: float(value) for name, value in values.items()}))
    module.training_step(synthetic_batch(), 0)
    accuracy = hits[1:] / tokens[1:]  # 30/36, 20/34, 10/30
    assert [logged[f"train/acc_{k}"] for k in range(1, BLOCK)] == pytest.approx(accuracy.tolist())
    assert logged["train/tau_chain_estimate"] == pytest.approx(float(chain_acceptance(accuracy)))
    assert logged["train/loss"] == 2.5


def test_anchor_draws_follow_epoch_and_rank_for_training_and_not_for_validation():
    """Validation reuses one draw per batch, so its numbers compare across evaluations; training draws afresh each
    epoch and on each rank (seeded by seed, epoch, batch and rank). A review found each of the three keys could be
    lost with every test passing."""
    module = tiny_module()
    loss_mask = synthetic_batch()["loss_mask"]

    def anchors(stage: str, epoch: int, rank: int) -> list[list[int]]:
        module._trainer = SimpleNamespace(current_epoch=epoch, global_rank=rank)  # all _step_seed reads of it
        drawn, _ = sample_anchors(loss_mask, 6, module._anchor_generator(0, stage))  # (S, 6)
        return drawn.tolist()

    assert anchors("val", epoch=0, rank=0) == anchors("val", epoch=3, rank=0)
    assert anchors("train", epoch=0, rank=0) != anchors("train", epoch=1, rank=0)
    assert anchors("train", epoch=0, rank=0) != anchors("train", epoch=0, rank=1)


def test_anchor_draws_follow_the_batch_and_the_seed_and_dropout_draws_apart_from_them():
    """Each micro-batch of an epoch draws its own anchors, model.seed redraws them all, and dropout's generator (stream
    1) is not the anchors'. A review dropped the batch index from the seed's key (every batch of an epoch drew the same
    random scores, so batches of one shape trained the same anchor positions), the seed (a new model.seed redrew
    nothing) and the stream (dropout replayed the anchors' sequence), each with every test passing."""
    module = tiny_module()
    module._trainer = SimpleNamespace(current_epoch=0, global_rank=0)  # all _step_seed reads of it
    loss_mask = synthetic_batch()["loss_mask"]

    def anchors(batch_idx: int, seed: int) -> list[list[int]]:
        module.hparams.seed = seed
        drawn, _ = sample_anchors(loss_mask, 6, module._anchor_generator(batch_idx, "train"))  # (S, 6)
        return drawn.tolist()

    assert anchors(0, seed=0) == anchors(0, seed=0)  # one micro-batch draws alike, in a run and in its resume
    assert anchors(0, seed=0) != anchors(1, seed=0)
    assert anchors(0, seed=0) != anchors(0, seed=1)
    module.hparams.seed = 0
    assert module._step_seed(0, "train", stream=1) != module._step_seed(0, "train")


def test_a_validation_batch_whose_every_label_is_outside_the_draft_vocabulary_counts_each_as_a_miss(few_word_module):
    """Decoding misses every such label, so validation counts them (a training step skips such a batch: nothing to
    learn). Skipped in validation too, in a review, with every test passing, they vanished from val/acc_k's counts."""
    module = few_word_module()
    batch = few_word_batch(0)
    outside = batch | {"input_ids": torch.where(batch["input_ids"] > DRAFT_VOCAB[-1], batch["input_ids"], WORDS[-1])}
    with torch.no_grad():  # the same loss mask at the same index draws the same anchors, so the same labels count
        inside, missed = module.shared_step(batch, 0, "val"), module.shared_step(outside, 0, "val")
    assert missed is not None and inside.tokens[1:].min() > 0
    assert torch.equal(missed.tokens, inside.tokens)
    assert missed.hits.sum() == missed.top_hits.sum() == 0


def test_recall_over_a_draft_vocabulary_of_recall_k_words_is_the_share_of_labels_in_it(few_word_module):
    """With RECALL_K draft words every label among them is in the drafter's top RECALL_K, whatever its weights: the
    top-RECALL_K hits at each position are the labels there in the vocabulary. StepResult carrying the top-1 hits in
    their place (val/recall4_k then read val/acc_k) passed every test."""
    assert len(DRAFT_VOCAB) == RECALL_K
    module = few_word_module()
    batch = few_word_batch(1)
    with torch.no_grad():
        result = module.shared_step(batch, 0, "val")
        _, labels, _, _ = module.block_predictions(batch, 0, "val")  # (S, n, B)
    in_vocabulary = torch.isin(labels, torch.tensor(DRAFT_VOCAB)).sum(dim=(0, 1))  # (B,)
    assert torch.equal(result.top_hits, in_vocabulary)
    assert torch.all(result.hits <= result.top_hits) and (result.hits < result.top_hits).any()
