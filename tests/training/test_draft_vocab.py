"""The draft vocabulary (model.draft_vocab_size): the drafter proposes only the reply tokens seen most in training.

    .venv/bin/pytest -q tests/training/test_draft_vocab.py

Its choice from the data, the training loss over its rows of the LM head, decoding's logits (-inf
elsewhere) and the rows gathered again for a changed or another head, the fit that records it in the
exported drafter, and lossless decoding with it.
"""

from __future__ import annotations

import copy
import json
import pickle

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Subset

from ddtree.cli import load_drafter
from ddtree.configuration_dflash import DFlashDrafterConfig
from ddtree.decoding import DrafterRunner, generate
from ddtree.errors import DDTreeError
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import stop_token_ids
from training.data import DistillDataModule, TokenizedConversations, replies, reply_vocabulary
from training.export import export_drafter
from training.loss import block_loss_sums, block_position_weights, draft_vocab_labels
from training.masks import IGNORE_INDEX
from training.module import DistillModule
from test_module import tiny_module  # tests/training is on the path, as for toy_data
from toy_data import write_conversations

BLOCK = 4


def test_reply_vocabulary_counts_reply_tokens_of_the_split_only():
    # sequence 0: prompt [9, 9, 9] then reply [5, 5, 7]; sequence 1: reply [7, 3]; sequence 2 (not in the split): [8, 8, 8]
    data = TokenizedConversations.from_examples([
        {"input_ids": [9, 9, 9, 5, 5, 7], "loss_mask": [0, 0, 0, 1, 1, 1]},
        {"input_ids": [9, 7, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [8, 8, 8], "loss_mask": [1, 1, 1]},
    ])
    split = Subset(data, [0, 1])
    assert reply_vocabulary(split, 2, vocab_size=12) == [5, 7]  # counts 5:2, 7:2, 3:1; the prompt's 9s do not count
    assert reply_vocabulary(split, 1, vocab_size=12) == [5]  # a tie goes to the lower id
    assert reply_vocabulary(split, 5, vocab_size=12) == [0, 1, 3, 5, 7]  # then the lowest ids never seen
    assert reply_vocabulary(split, 20, vocab_size=12) == list(range(12))  # at most the whole vocabulary


def test_reply_vocabulary_breaks_ties_by_the_lower_id_in_a_vocabulary_of_many_ids():
    """The tie rule holds past a handful of ids (an unstable sort keeps it below 17 ids only): ids 19, 11, 7 and 2
    are seen once each and 5 twice, so three ids are 5 and the two lowest of the ties, 2 and 7."""
    data = TokenizedConversations.from_examples([{"input_ids": [1, 19, 2, 11, 7, 5, 5], "loss_mask": [0] + [1] * 6}])
    assert reply_vocabulary(Subset(data, [0]), 3, vocab_size=20) == [2, 5, 7]
    assert reply_vocabulary(Subset(data, [0]), 4, vocab_size=40) == [2, 5, 7, 11]


def test_replies_are_the_supervised_runs_of_the_split_one_per_assistant_turn():
    data = TokenizedConversations.from_examples([
        {"input_ids": [9, 5, 5, 9, 9, 7, 3], "loss_mask": [0, 1, 1, 0, 0, 1, 1]},  # two turns
        {"input_ids": [8, 8, 8], "loss_mask": [1, 1, 1]},  # not in the split
        {"input_ids": [4, 6], "loss_mask": [1, 1]},  # a turn from the first token
    ])
    assert replies(Subset(data, [0, 2])) == [[5, 5], [7, 3], [4, 6]]


def test_labels_outside_the_draft_vocabulary_are_ignored():
    labels = torch.tensor([[IGNORE_INDEX, 7, 3, 11]])
    assert draft_vocab_labels(labels, torch.tensor([3, 7, 9]), 12).tolist() == [[IGNORE_INDEX, 1, 0, IGNORE_INDEX]]


def test_an_ignored_label_stays_ignored_where_the_draft_vocabulary_holds_token_0():
    """The anchor's and padding's IGNORE_INDEX index no row: looked up as token 0 (an end-of-text token, which replies
    hold), they would become that row's label, counted in the loss and the token counts."""
    labels = torch.tensor([[IGNORE_INDEX, 0, 7, IGNORE_INDEX]])
    assert draft_vocab_labels(labels, torch.tensor([7, 0, 3]), 12).tolist() == [[IGNORE_INDEX, 1, 0, IGNORE_INDEX]]


def test_decoding_logits_are_the_head_rows_of_the_vocabulary_and_minus_inf_elsewhere():
    module = tiny_module()
    drafter, lm_head = module.drafter, module.target.get_output_embeddings()
    hidden = torch.randn(3, lm_head.weight.shape[1])
    assert torch.equal(drafter.compute_logits(hidden, lm_head), lm_head(hidden))  # no vocabulary: the whole head
    drafter.config.draft_vocab = [40, 2, 17]  # stored ascending
    assert drafter.config.draft_vocab == [2, 17, 40]
    logits = drafter.compute_logits(hidden, lm_head)  # (3, V)
    full = lm_head(hidden)
    assert torch.allclose(logits[:, [2, 17, 40]], full[:, [2, 17, 40]], atol=1e-6)
    outside = torch.ones(full.shape[1], dtype=torch.bool)
    outside[[2, 17, 40]] = False
    assert torch.isneginf(logits[:, outside]).all()
    assert set(logits.argmax(-1).tolist()) <= {2, 17, 40}
    drafter.config.draft_vocab = None  # cleared: the config no longer names one, and the whole head decodes again
    assert "draft_vocab" not in drafter.config.dflash_config
    assert torch.equal(drafter.compute_logits(hidden, lm_head), lm_head(hidden))


def drafter_of_even_tokens() -> DFlashDraftModel:
    """A 1-layer drafter (H 64) of a 1000-token target, drafting from the even token ids only."""
    config = DFlashDrafterConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=1000, block_size=BLOCK,
                                 num_target_layers=6, dflash_config={"mask_token_id": 0, "target_layer_ids": [1, 3]})
    drafter = DFlashDraftModel(config).eval()
    drafter.config.draft_vocab = list(range(0, 1000, 2))
    return drafter


def test_the_draft_rows_are_gathered_again_after_the_head_changes_in_place():
    """The rows are gathered once and reused, the head being frozen; a change in place through its weight is seen by
    the weight's version counter and gathers them again, as draft_head's docstring promises."""
    drafter, hidden = drafter_of_even_tokens(), torch.randn(3, 64)
    head = nn.Linear(64, 1000, bias=False)
    drafter.compute_logits(hidden, head)
    with torch.no_grad():
        head.weight.mul_(2)
    assert torch.allclose(drafter.compute_logits(hidden, head)[:, ::2], head(hidden)[:, ::2])


def test_the_draft_rows_are_gathered_again_after_the_heads_data_is_replaced():
    """`weight.data = ...` (a weight loaded by assignment; Module.to through another dtype and back) keeps the Parameter
    and its version counter: only the address it now points at says the cached rows are another tensor's."""
    drafter, hidden = drafter_of_even_tokens(), torch.randn(3, 64)
    head = nn.Linear(64, 1000, bias=False)
    drafter.compute_logits(hidden, head)
    version = head.weight._version
    head.weight.data = -head.weight.data
    assert head.weight._version == version
    assert torch.allclose(drafter.compute_logits(hidden, head)[:, ::2], hidden @ head.weight[::2].T, atol=1e-6)


def test_a_new_draft_vocabulary_gets_its_own_rows():
    """The rows were cached by the head alone: a vocabulary set after a first forward (a fit that chooses one for a
    drafter already run, a test that swaps it) kept the old one's rows and ids, so the new one drafted the old tokens."""
    drafter, hidden = drafter_of_even_tokens(), torch.randn(3, 64)
    head = nn.Linear(64, 1000, bias=False)
    drafter.compute_logits(hidden, head)
    drafter.config.draft_vocab = list(range(1, 1000, 2))  # the odd tokens now
    logits = drafter.compute_logits(hidden, head)
    assert torch.isneginf(logits[:, ::2]).all()
    assert torch.allclose(logits[:, 1::2], head(hidden)[:, 1::2])


def test_a_new_head_at_a_freed_heads_address_gets_its_own_rows():
    """The rows were cached by the head's address, device, dtype and version only: a head freed, and another of the same
    shape allocated where it was (at version 0 as it was), as a drafter reused with a second target or a reloaded one
    can get, was served the freed head's rows (14 of 20 tries in a review). Two tensors over one numpy array reuse the
    address here every time."""
    drafter, hidden = drafter_of_even_tokens(), torch.randn(3, 64)
    memory = np.random.default_rng(0).standard_normal((1000, 64), dtype=np.float32)
    head = nn.Linear(64, 1000, bias=False)
    head.weight = nn.Parameter(torch.from_numpy(memory), requires_grad=False)
    drafter.compute_logits(hidden, head)
    address = head.weight.data_ptr()
    del head
    memory *= -1  # the next head's values, where the freed one's were: no torch version counter sees the write
    head = nn.Linear(64, 1000, bias=False)
    head.weight = nn.Parameter(torch.from_numpy(memory), requires_grad=False)
    assert head.weight.data_ptr() == address and head.weight._version == 0
    assert torch.allclose(drafter.compute_logits(hidden, head)[:, ::2], head(hidden)[:, ::2])
    # the weak reference to the head is left out of a pickle (torch.save of the whole model) and of a copy
    for copied in (pickle.loads(pickle.dumps(drafter)), copy.deepcopy(drafter)):
        assert torch.equal(copied.compute_logits(hidden, head), drafter.compute_logits(hidden, head))


def test_the_training_loss_is_the_cross_entropy_of_the_decoding_logits_on_labels_in_the_vocabulary():
    """Trained on the vocabulary's rows, the loss is exactly what decoding's masked logits give, labels outside left out."""
    module = tiny_module()
    drafter, lm_head = module.drafter, module.target.get_output_embeddings()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3 * BLOCK, lm_head.weight.shape[1], generator=generator)  # (S, n*B, H)
    vocab = torch.randperm(lm_head.weight.shape[0], generator=generator)[:50].sort().values
    drafter.config.draft_vocab = vocab.tolist()
    labels = vocab[torch.randint(0, 50, (2, 3, BLOCK), generator=generator)]  # (S, n, B)
    labels[0, 0, 2] = int(torch.isin(torch.arange(vocab.max() + 2), vocab, invert=True).nonzero()[0])  # outside
    labels[..., 0] = IGNORE_INDEX  # the anchor
    weights = block_position_weights(BLOCK, 4.0)
    ids, rows = drafter.draft_head(lm_head)
    weighted, total, hits, tokens, _ = block_loss_sums(
        hidden, draft_vocab_labels(labels, ids, lm_head.weight.shape[0]), lambda h: F.linear(h, rows), weights)
    logits = drafter.compute_logits(hidden, lm_head).view(2, 3, BLOCK, -1)  # (S, n, B, V)
    inside = (labels != IGNORE_INDEX) & torch.isin(labels, vocab)
    ce = F.cross_entropy(logits[inside], labels[inside], reduction="none")
    position_weights = weights.expand_as(labels)[inside]
    assert torch.allclose(weighted / total, (ce * position_weights).sum() / position_weights.sum(), atol=1e-5)
    assert int(tokens.sum()) == int(inside.sum()) == 2 * 3 * (BLOCK - 1) - 1


def fitted_module(tmp_path, **overrides):
    data = write_conversations(tmp_path / "conversations.jsonl", count=24, min_words=8, max_words=16)
    datamodule = DistillDataModule(target="tiny-random", data_path=str(data), max_length=128, batch_size=2,
                                   val_fraction=0.25, seed=1, min_supervised_tokens=8, cache_dir=str(tmp_path / "cache"))
    torch.manual_seed(0)
    module = DistillModule(target="tiny-random", num_layers=1, block_size=BLOCK, target_layer_ids=[0, 2, 4],
                           num_anchors=6, gamma=4.0, lr=3e-3, warmup_ratio=0.0, target_dtype="float32", **overrides)
    trainer = L.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=datamodule)
    return module, datamodule


def test_a_fit_chooses_the_vocabulary_from_its_training_replies_and_exports_it(tmp_path):
    module, datamodule = fitted_module(tmp_path, draft_vocab_size=1000)
    vocab = module.drafter.config.draft_vocab
    expected = reply_vocabulary(datamodule.train_set, 1000, module.target.get_output_embeddings().weight.shape[0])
    assert vocab == expected and len(vocab) == 1000
    replies = {int(t) for i in range(len(datamodule.train_set))
               for t in datamodule.train_set[i]["input_ids"][datamodule.train_set[i]["loss_mask"]]}
    assert replies <= set(vocab) and len(replies) < 100  # every training reply token, and low ids to fill
    out = export_drafter(module, tmp_path / "drafter")
    assert json.loads((out / "config.json").read_text())["dflash_config"]["draft_vocab"] == vocab


def test_draft_vocab_size_needs_training_data():
    with pytest.raises(DDTreeError, match="model.draft_vocab_size=100 is chosen from the training data"):
        tiny_module(draft_vocab_size=100)


def test_a_draft_vocabulary_of_the_whole_vocabulary_or_more_is_refused():
    """Cut to the whole vocabulary before: exported as a list of every id, which each decode scattered into -inf logits."""
    vocab_size = tiny_module().target.get_output_embeddings().weight.shape[0]
    for size in (vocab_size, vocab_size + 1):
        with pytest.raises(DDTreeError, match=rf"^model.draft_vocab_size={size} is not below the target's vocabulary of "
                                              rf"{vocab_size} tokens: leave it unset to draft from the whole vocabulary"):
            tiny_module(draft_vocab_size=size)


def test_decoding_with_a_draft_vocabulary_is_lossless(smollm2):
    """A random drafter limited to 300 tokens proposes only those, and the committed tokens are the target's greedy
    ones. 12 tokens (each a SmolLM2 forward for each of the three decodings) are rounds enough for both checks."""
    model, tokenizer = smollm2
    torch.manual_seed(0)
    drafter = load_drafter("random", model, tokenizer, "smollm2-135m")
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "Name three prime numbers."}],
                                                add_generation_prompt=True, return_dict=True)["input_ids"])
    stops = stop_token_ids(model, tokenizer)
    greedy = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            eos_token_id=stops)[0, len(prompt):]
    # the reply's own tokens are in the vocabulary, so some drafts can be accepted
    drafter.config.draft_vocab = sorted(set(greedy.tolist()) | set(range(1000, 1300)))
    runner = DrafterRunner(drafter, model)
    proposed = []
    propose = runner.propose

    def recording(*args):
        logits = propose(*args)
        proposed.append(logits.argmax(-1))
        return logits

    runner.propose = recording
    for budget in (0, 16):
        result = generate(model, prompt, "ddtree" if budget else "dflash", runner, budget, 12, stops)
        assert result.new_tokens == greedy.tolist()
    assert proposed and set(torch.cat(proposed).tolist()) <= set(drafter.config.draft_vocab)


def test_a_warm_start_keeps_the_folder_vocabulary_and_refuses_one_it_cannot_have(tmp_path):
    module = tiny_module()
    plain = export_drafter(module, tmp_path / "plain")
    with pytest.raises(DDTreeError, match=r"model.draft_vocab_size=100 but init_from .*plain drafts from the whole vocabulary"):
        tiny_module(init_from=str(plain), draft_vocab_size=100)
    module.drafter.config.draft_vocab = [5, 6, 7]
    limited = export_drafter(module, tmp_path / "limited")
    assert tiny_module(init_from=str(limited)).drafter.config.draft_vocab == [5, 6, 7]
    # another size was unused without a word (the folder's 3 kept), while config.yaml recorded 100
    said = (r"^model.draft_vocab_size=100 but init_from .*limited drafts from its own 3 tokens, which a warm start "
            r"keeps; drop model.draft_vocab_size or set it to 3")
    with pytest.raises(DDTreeError, match=said):
        tiny_module(init_from=str(limited), draft_vocab_size=100)
    assert tiny_module(init_from=str(limited), draft_vocab_size=3).drafter.config.draft_vocab == [5, 6, 7]
