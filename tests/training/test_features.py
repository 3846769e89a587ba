"""Tests of training/features.py: the offline feature store, training from it, its CLI and train.py's auto-build.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/training/test_features.py -x -q

Everything runs on the tiny random target (6 layers, hidden 64) on CPU, on a dozen short conversations.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
import torch

import toy_data  # tests/training/toy_data.py
import training.feature_store
import training.features
import training.module
import training.train
from ddtree.errors import run_cli
from ddtree.modeling_dflash import fuse_target_features
from ddtree.targets import DDTreeError, load_target
from training.data import DistillDataModule
from training.feature_store import (FORMAT_VERSION, FeatureStore, build_feature_store, build_lock, coverage,
                                    differing_fields, is_complete, lock_path, partial_path, read_manifest,
                                    store_teacher, target_fingerprint)
from training.arguments import features_parser
from training.features import main
from training.masks import IGNORE_INDEX
from training.module import DistillModule
from training.target import dtype_for_precision, load_frozen_target, target_layer_features
from test_module import forward_log_probs, fp32_target, transformed_target_folder  # tests/training: on the path
from training.train import main as train_main

LAYER_IDS = [1, 3, 4]
HIDDEN = 64  # the tiny target's hidden size

pytestmark = pytest.mark.usefixtures("undrawn_plots")  # the launches' tau.png, read by none of these tests: undrawn


def write_conversations(path, count=12, seed=0):
    """Replies of 10 to 40 words, so the sequences have many different lengths."""
    return toy_data.write_conversations(path, count, 10, 40, seed)


def make_datamodule(tmp_path, **overrides) -> DistillDataModule:
    path = tmp_path / "conversations.jsonl"
    if not path.exists():  # rewriting it would change the tokenization key
        write_conversations(path)
    settings = dict(target="tiny-random", data_path=str(path), max_length=128, batch_size=2, val_fraction=0.25,
                    seed=1, min_supervised_tokens=8, cache_dir=str(tmp_path / "cache"))
    settings.update(overrides)
    return DistillDataModule(**settings)


def shard_bytes(sequences: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """A shard limit that fits about `sequences` of these sequences (~70 tokens each), to get several shards."""
    return sequences * 70 * len(LAYER_IDS) * HIDDEN * dtype.itemsize


def tiny_module(**overrides) -> DistillModule:
    settings = dict(target="tiny-random", num_layers=1, block_size=4, target_layer_ids=LAYER_IDS, num_anchors=4,
                    gamma=4.0, lr=3e-3, warmup_ratio=0.0, target_dtype="float32")
    settings.update(overrides)
    torch.manual_seed(0)
    module = DistillModule(**settings)
    module.configure_model()
    return module


def one_line(error: Exception) -> str:
    message = str(error)
    assert len(message.splitlines()) == 1, message
    return message


# ----------------------------------------------------------------------------- the store's content


def test_a_store_on_a_read_only_place_is_one_line_before_the_target_loads(tmp_path, monkeypatch):
    """A read-only mount (simulated: root may write anywhere): mkdir's OSError traceback before."""
    import errno
    import pathlib
    import training.feature_store

    dm = make_datamodule(tmp_path)
    mkdir = pathlib.Path.mkdir

    def read_only(path, *args, **kwargs):
        if path.name.endswith(".partial"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    monkeypatch.setattr(training.feature_store, "load_frozen_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(DDTreeError) as error:
        build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    assert one_line(error.value).startswith(f"cannot write {tmp_path / 'store'}: Read-only file system")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_holds_exactly_the_online_features_of_every_sequence(tmp_path, dtype):
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS, dtype=dtype, sequences_per_batch=1,
                              max_shard_bytes=shard_bytes(3, dtype))
    store = FeatureStore(out)
    data, _, key = dm.load_tokenized()
    assert len(store.shards) > 2 and len(store) == len(data) == 12  # several shards, all sequences
    assert (store.layer_ids, store.hidden_size, store.width, store.dtype) == (LAYER_IDS, HIDDEN, 3 * HIDDEN, dtype)
    assert store.tokenization_key == key and store.lengths == data.lengths()
    target, _ = load_target("tiny-random", dtype)
    for i in range(len(data)):
        online = target_layer_features(target, data[i]["input_ids"][None], LAYER_IDS)[0]  # (T_i, K*H)
        assert store[i].dtype == dtype and torch.equal(store[i], online), f"sequence {i}"
    with pytest.raises(IndexError):
        store[len(data)]
    with pytest.raises(IndexError, match="outside feature store"):  # not read from the end: offsets give other rows
        store[-1]


def test_final_hidden_states_are_the_targets_and_older_manifests_still_read(tmp_path):
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS, dtype=torch.float32, sequences_per_batch=1,
                              final_hidden=True, max_shard_bytes=shard_bytes(3, torch.float32))
    store = FeatureStore(out)
    data, _, _ = dm.load_tokenized()
    target, _ = load_target("tiny-random", torch.float32)
    assert store.final_hidden and len(store.shards) > 2
    for i in range(len(data)):
        features, final = target_layer_features(target, data[i]["input_ids"][None], LAYER_IDS, final_hidden=True)
        assert torch.equal(store[i], features[0]) and torch.equal(store.final(i), final[0]), f"sequence {i}"
    # A store built before final_hidden existed has no such field: it is read as one without them.
    plain = build_feature_store(dm, tmp_path / "plain", layer_ids=LAYER_IDS)
    manifest = json.loads((plain / "store.json").read_text())
    del manifest["final_hidden"]
    (plain / "store.json").write_text(json.dumps(manifest))
    assert not FeatureStore(plain).final_hidden
    assert build_feature_store(dm, plain, layer_ids=LAYER_IDS) == plain  # the same build: nothing to do, no error
    with pytest.raises(DDTreeError) as error:
        FeatureStore(plain).final(0)
    assert "distill_weight" in one_line(error.value)
    assert FeatureStore(plain).teacher_top_k == 0
    with pytest.raises(DDTreeError) as error:
        FeatureStore(plain).teacher(0)
    assert "distill_top_k" in one_line(error.value)


def test_a_store_of_another_or_no_format_version_is_refused_not_misread(tmp_path):
    """The layout's offsets and tensor names are those of FORMAT_VERSION: a manifest of another version, or one written
    before the field existed, is refused with the rebuild to run rather than read as this layout."""
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    manifest = json.loads((out / "store.json").read_text())
    for version in (FORMAT_VERSION + 1, None):
        if version is None:
            del manifest["format_version"]
        else:
            manifest["format_version"] = version
        (out / "store.json").write_text(json.dumps(manifest))
        with pytest.raises(DDTreeError) as error:
            FeatureStore(out)
        assert f"has format version {version}, this code reads {FORMAT_VERSION}" in one_line(error.value)
        assert "--force" in one_line(error.value)


def test_a_top_k_teacher_store_holds_the_targets_likeliest_next_tokens(tmp_path):
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS, dtype=torch.float32, sequences_per_batch=2,
                              teacher_top_k=5, max_shard_bytes=shard_bytes(3, torch.float32))
    store = FeatureStore(out)
    data, _, _ = dm.load_tokenized()
    target, _ = load_target("tiny-random", torch.float32)
    assert store.teacher_top_k == 5 and not store.final_hidden and len(store.shards) > 2
    for i in range(len(data)):
        _, final = target_layer_features(target, data[i]["input_ids"][None], LAYER_IDS, final_hidden=True)
        log_probs = target.get_output_embeddings()(final[0]).float().log_softmax(-1)  # (T_i, V)
        ids, stored = store.teacher(i)
        assert ids.shape == (len(data[i]["input_ids"]), 5) and ids.dtype == torch.long
        # Rows where the next token is supervised hold the teacher; no loss reads the others, which are left p = 0.
        needed = torch.cat([data[i]["loss_mask"][1:], torch.zeros(1, dtype=torch.bool)])
        assert 0 < needed.sum() < len(needed), f"sequence {i}: both kinds of row"
        log_probs, ids, stored = log_probs[needed], ids[needed], stored[needed]
        torch.testing.assert_close(stored.sort(dim=1).values, log_probs.topk(5, dim=1).values.sort(dim=1).values)
        torch.testing.assert_close(log_probs.gather(1, ids), stored)  # each id with its own log-probability
        skipped = store.teacher(i)
        assert (skipped[0][~needed] == IGNORE_INDEX).all() and (skipped[1][~needed] == float("-inf")).all()
    with pytest.raises(DDTreeError, match="model.distill_top_k=1000000 is above"):
        build_feature_store(dm, tmp_path / "wide", layer_ids=LAYER_IDS, teacher_top_k=10**6)
    assert not (tmp_path / "wide").exists() and not partial_path(tmp_path / "wide").exists()
    # a Llama-style target's forward transforms nothing: its manifest is as before, so its earlier stores are reused
    assert "teacher_logits" not in json.loads((out / "store.json").read_text()) and store.teacher_logits is None


def test_a_top_1_teacher_stores_items_carry_their_teacher(tmp_path):
    """model.distill_top_k=1 is a teacher too (the target's argmax and its log-probability): the data's items read it
    from the store as they do any k's, or a run distilling from it would find no teacher in its batches."""
    out = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS, teacher_top_k=1)
    dm = make_datamodule(tmp_path, feature_store=str(out))
    dm.setup("fit")
    item, store = dm.train_set[0], FeatureStore(out)
    ids, log_probs = store.teacher(dm.train_set.indices[0])
    assert ids.shape == (len(item["input_ids"]), 1)
    assert torch.equal(item["teacher_ids"], ids) and torch.equal(item["teacher_log_probs"], log_probs)


@pytest.mark.parametrize("family, transform", [("gemma2", "final_logit_softcapping=30"), ("granite", "logits_scaling=16")])
def test_a_top_k_store_of_a_target_that_transforms_its_logits_holds_its_forwards_distribution(tmp_path, family,
                                                                                              transform):
    """The store's teacher was the softmax of the LM head's raw output: Gemma-2's forward softcaps it, Granite's divides
    it by logits_scaling. Now it is the forward's, the manifest says which transform it took, and a store without it
    (built before) is another build for `make features` and one line for a run that would train from it."""
    folder = transformed_target_folder(tmp_path / family, family)
    # 6 conversations, not make_datamodule's 12: every sequence's teacher is compared with the forward's, and half of
    # them is half of its two builds and forwards (~-0.8 s a case on a 2-core AVX2 EPYC)
    write_conversations(tmp_path / "conversations.jsonl", count=6)
    dm = make_datamodule(tmp_path, target=str(folder))
    out = build_feature_store(dm, tmp_path / "store", layer_ids=[0, 1], dtype=torch.float32, teacher_top_k=5)
    store = FeatureStore(out)
    assert store.teacher_logits == transform
    data, _, _ = dm.load_tokenized()
    target = fp32_target(folder)  # once, not per sequence (it was half of this test)
    for i in range(len(data)):
        needed = torch.cat([data[i]["loss_mask"][1:], torch.zeros(1, dtype=torch.bool)])
        ids, stored = (t[needed] for t in store.teacher(i))
        true = forward_log_probs(target, data[i]["input_ids"][None])[0][needed]  # (rows, V)
        torch.testing.assert_close(stored, true.gather(1, ids), rtol=0, atol=1e-5)
        assert torch.equal(ids.sort(dim=1).values, true.topk(5, dim=1).indices.sort(dim=1).values)
    module = tiny_module(target=str(folder), target_layer_ids=[0, 1], distill_weight=0.5, distill_top_k=5)
    module.check_feature_store(store)  # accepted
    manifest = json.loads((out / "store.json").read_text())
    del manifest["teacher_logits"]  # as a store built before the teacher took the transform
    (out / "store.json").write_text(json.dumps(manifest))
    with pytest.raises(DDTreeError) as error:
        module.check_feature_store(FeatureStore(out))
    assert one_line(error.value).startswith(f"feature store {out} holds the target's top 5 next tokens with logit "
                                            f"transform none, and its forward applies {transform}")
    differs = rf"another build \(differs in teacher_logits \(None there, {transform} here\)\); pass --force"
    with pytest.raises(DDTreeError, match=differs):
        build_feature_store(dm, out, layer_ids=[0, 1], dtype=torch.float32, teacher_top_k=5)
    assert build_feature_store(dm, out, layer_ids=[0, 1], dtype=torch.float32, teacher_top_k=5, force=True) == out
    assert FeatureStore(out).teacher_logits == transform


def test_length_sorted_batches_give_the_per_sequence_features(tmp_path):
    # Padding changes the float rounding a little (a different matmul shape), not the values.
    dm = make_datamodule(tmp_path)
    store = FeatureStore(build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS, dtype=torch.float32,
                                             sequences_per_batch=5))
    data, _, _ = dm.load_tokenized()
    target, _ = load_target("tiny-random", torch.float32)
    lengths = data.lengths()
    assert len(set(lengths)) > 3  # the batches really mix lengths, so padding happens
    for i in range(len(data)):
        online = target_layer_features(target, data[i]["input_ids"][None], LAYER_IDS)[0]
        torch.testing.assert_close(store[i], online, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- training from it


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def fit(module: DistillModule, dm: DistillDataModule, steps: int = 4, precision: str = "32"):
    recorder = LossRecorder()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, precision=precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[recorder], log_every_n_steps=1)
    trainer.fit(module, datamodule=dm)
    return recorder.losses, trainer


@pytest.mark.parametrize("batch_size, sequences_per_batch, lr, tolerance, distill", [
    (1, 1, 3e-3, 0.0, {}),  # every target forward sees one unpadded sequence, online and offline: bit for bit
    # Padded batches round differently (~1e-8 on the features); Adam divides near-zero gradients by
    # their own size, so a large lr turns that noise into 1e-6-sized steps on a few weights.
    # The tolerance is relative for the losses (~11 in fp32), absolute for the weights.
    (2, 8, 1e-4, 1e-6, {}),
    # Distillation's soft targets from the store's final hidden states, as online from the full forward.
    (1, 1, 3e-3, 0.0, {"distill_weight": 0.5}),
    (1, 1, 3e-3, 0.0, {"distill_weight": 0.5, "distill_loss": "lk"}),
    # The store's top-k teacher, as online from the target's final states at the block tokens.
    (1, 1, 3e-3, 0.0, {"distill_weight": 0.5, "distill_top_k": 4}),
])
def test_training_from_the_store_equals_online_training(tmp_path, monkeypatch, batch_size, sequences_per_batch, lr,
                                                        tolerance, distill):
    final_hidden, teacher_top_k = store_teacher(distill.get("distill_weight", 0.0), distill.get("distill_top_k", 0))
    store = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS,
                                dtype=torch.float32, sequences_per_batch=sequences_per_batch,
                                final_hidden=final_hidden, teacher_top_k=teacher_top_k)
    assert (FeatureStore(store).final_hidden, FeatureStore(store).teacher_top_k) == (final_hidden, teacher_top_k)
    online_module = tiny_module(lr=lr, **distill)
    online_losses, online_trainer = fit(online_module, make_datamodule(tmp_path, batch_size=batch_size))
    assert online_trainer.callback_metrics["perf/target_forward_s"] > 0  # timed, and logged after the step

    def target_must_not_run(*args, **kwargs):
        raise AssertionError("the target ran although the batch carried features")

    monkeypatch.setattr(training.module, "target_layer_features", target_must_not_run)
    offline_module = tiny_module(lr=lr, **distill)
    offline_dm = make_datamodule(tmp_path, batch_size=batch_size, feature_store=str(store))
    offline_losses, trainer = fit(offline_module, offline_dm)
    assert offline_dm.store is not None and len(offline_losses) == len(online_losses) == 4
    torch.testing.assert_close(torch.tensor(offline_losses), torch.tensor(online_losses), rtol=tolerance, atol=0)
    online_weights, offline_weights = online_module.drafter.state_dict(), offline_module.drafter.state_dict()
    initial = tiny_module().drafter.state_dict()
    assert any((online_weights[name] - initial[name]).abs().max() > 1e-4 for name in initial)  # training moved them
    for name, weight in online_weights.items():
        torch.testing.assert_close(offline_weights[name], weight, rtol=0, atol=tolerance, msg=name)
    assert trainer.callback_metrics["perf/target_forward_s"] == 0


@pytest.mark.parametrize("target_dtype, distill", [
    ("float32", {}),  # model.target_dtype float32: the user's fp32 target
    ("float32", {"distill_weight": 0.5, "distill_top_k": 4}),  # and the LM head of the online top-k teacher
    ("bfloat16", {}),  # what target_dtype auto gives under bf16-mixed: bf16 both ways, as it was
])
def test_under_a_mixed_precision_online_training_equals_training_from_the_store(tmp_path, target_dtype, distill):
    """Lightning runs the step under bf16 autocast: online, an fp32 target's matmuls (and the top-k teacher's LM head)
    ran in bf16, while the store is built, and decoding runs, without autocast. The losses differed from the first
    step (10.806742 online, 10.806920 from the store). The target's forward now runs without autocast online too."""
    final_hidden, teacher_top_k = store_teacher(distill.get("distill_weight", 0.0), distill.get("distill_top_k", 0))
    store = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS,
                                dtype=dtype_for_precision("bf16-mixed", target_dtype), sequences_per_batch=1,
                                final_hidden=final_hidden, teacher_top_k=teacher_top_k)
    online_module = tiny_module(target_dtype=target_dtype, **distill)
    online_losses, _ = fit(online_module, make_datamodule(tmp_path, batch_size=1), steps=3, precision="bf16-mixed")
    assert online_module.target.dtype == getattr(torch, target_dtype)
    offline_dm = make_datamodule(tmp_path, batch_size=1, feature_store=str(store))
    offline_losses, _ = fit(tiny_module(target_dtype=target_dtype, **distill), offline_dm, steps=3,
                            precision="bf16-mixed")
    assert offline_dm.store is not None and len(online_losses) == 3
    assert offline_losses == online_losses


def test_batches_carry_right_padded_features_from_the_store(tmp_path):
    store = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS)
    dm = make_datamodule(tmp_path, feature_store=str(store))
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    features, mask = batch["features"], batch["attention_mask"]
    assert features.shape == (*batch["input_ids"].shape, 3 * HIDDEN) and features.dtype == torch.bfloat16
    for row, position in enumerate(list(dm.train_dataloader().sampler)[:2]):
        n = int(mask[row].sum())
        index = dm.train_set.indices[position]  # the sampler walks the train split; the store is indexed like the data
        assert torch.equal(features[row, :n], dm.store[index]) and not features[row, n:].any()


def test_store_of_other_data_is_refused_in_one_line(tmp_path):
    store = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS)
    with pytest.raises(DDTreeError) as error:
        make_datamodule(tmp_path, max_length=100, feature_store=str(store)).setup("fit")
    message = one_line(error.value)
    assert str(store) in message and "make features" in message and "tokenization key" in message


def test_a_store_of_fewer_sequences_names_the_first_the_data_has_more_of(tmp_path):
    """Data that only added sequences after the store's differs in no shared length: the line points at the first
    sequence the store lacks, not at sequence 0, which it holds as the data does."""
    store = FeatureStore(build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS))
    with pytest.raises(DDTreeError) as error:
        store.check_matches((store.tokenization_key,), [*store.lengths, 7])
    assert f"{len(store)} sequences vs {len(store) + 1}, first different length at sequence {len(store)}:" in (
        one_line(error.value))


def test_a_store_of_as_many_sequences_of_other_lengths_is_refused_at_the_first_that_differs(tmp_path):
    """A store whose sequence count still matches the data's but whose lengths do not holds other tokens' features:
    reused, it would hand each sequence rows of another length. The line names the first sequence that differs."""
    store = FeatureStore(build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS))
    lengths = [*store.lengths]
    lengths[1] += 1
    with pytest.raises(DDTreeError) as error:
        store.check_matches((store.tokenization_key,), lengths)
    assert f"{len(store)} sequences vs {len(store)}, first different length at sequence 1:" in one_line(error.value)


def test_store_of_other_layers_or_with_soft_targets_stops_the_fit(tmp_path):
    store = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=[0, 2])
    with pytest.raises(DDTreeError) as error:
        fit(tiny_module(), make_datamodule(tmp_path, feature_store=str(store)))
    message = one_line(error.value)
    assert "[0, 2]" in message and str(LAYER_IDS) in message and str(store) in message
    with pytest.raises(DDTreeError) as error:
        fit(tiny_module(target_layer_ids=[0, 2], distill_weight=0.5), make_datamodule(tmp_path, feature_store=str(store)))
    assert "distill_weight" in one_line(error.value)
    with pytest.raises(DDTreeError) as error:
        fit(tiny_module(target_layer_ids=[0, 2], distill_weight=0.5, distill_top_k=8),
            make_datamodule(tmp_path, feature_store=str(store)))
    assert "distill_top_k=8" in one_line(error.value) and "top 0" in one_line(error.value)


def test_a_store_of_the_drafters_layers_in_another_order_is_refused(tmp_path):
    """The store concatenates its layers' features in its own order, and the drafter's fusion reads them in its own:
    layers [4, 1, 3] stored for a drafter of [1, 3, 4] would feed each slot another layer's features."""
    store = FeatureStore(build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=[4, 1, 3],
                                             dtype=torch.float32))
    with pytest.raises(DDTreeError) as error:
        tiny_module().check_feature_store(store)
    assert "[4, 1, 3]" in one_line(error.value) and f"reads layers {LAYER_IDS}" in one_line(error.value)


def test_a_store_built_with_an_adapter_before_its_sha256_was_recorded_is_refused_to_a_run_without_one(tmp_path):
    """Training's side of differing_fields' rule: with no adapter here and no sha256 recorded there, the two missing
    sha256s are no proof of the same target, and the store's features are of the adapted one."""
    store = FeatureStore(build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS,
                                             dtype=torch.float32))
    module = tiny_module()
    module.check_feature_store(store)  # the store of this very target: taken
    store.target_adapter, store.target_adapter_sha256 = "/adapters/lora-1", None  # as an older store's manifest reads
    with pytest.raises(DDTreeError) as error:
        module.check_feature_store(store)
    assert "(adapter /adapters/lora-1)" in one_line(error.value) and "(adapter None)" in one_line(error.value)


def test_a_store_without_layer_ids_holds_the_distinct_ones_a_new_drafter_reads(tmp_path, capsys):
    """The tiny target has 6 layers, too few for the published spread: it stored [1, 2, 2, 2, 3], layer 2 three times."""
    path = build_feature_store(make_datamodule(tmp_path), tmp_path / "store")
    assert FeatureStore(path).layer_ids == [0, 1, 2, 3, 4] == tiny_module(target_layer_ids=None).target_layer_ids
    assert "set model.target_layer_ids to choose others" in capsys.readouterr().err
    with pytest.raises(DDTreeError, match=r"^model.target_layer_ids \[1, 6\] must be within 0..5"):
        build_feature_store(make_datamodule(tmp_path), tmp_path / "outside", layer_ids=[1, 6])


def test_a_store_of_repeated_layer_ids_holds_the_online_features_of_a_run_trained_on_the_old_default(tmp_path):
    """A run from before 2026-12-03 on a target under 8 layers read [1, 2, 2, 2, 3]; its resume keeps those ids
    (training.train.run_layer_ids), and where its store had to be built again the build refused them as not distinct
    (found in a review): the store holds each copy, as the drafter reads them online."""
    old_default = [1, 2, 2, 2, 3]
    dm = make_datamodule(tmp_path)
    store = FeatureStore(build_feature_store(dm, tmp_path / "store", layer_ids=old_default, dtype=torch.float32,
                                             sequences_per_batch=1))  # one a batch: the online forward's shapes
    assert (store.layer_ids, store.width) == (old_default, 5 * HIDDEN)
    assert store.layer_ids == tiny_module(target_layer_ids=old_default).target_layer_ids
    data, _, _ = dm.load_tokenized()
    target, _ = load_target("tiny-random", torch.float32)
    for i in range(len(data)):
        online = target_layer_features(target, data[i]["input_ids"][None], old_default)[0]  # (T_i, 5*H)
        assert torch.equal(store[i], online), f"sequence {i}"


def test_a_resume_given_target_layer_ids_is_not_given_the_checkpoints_instead(tmp_path):
    """run_layer_ids adds the checkpoint's ids to the resume of a run whose config left them to the default; where
    the command names its own (or init_from), they stand, and the resume's check refuses them if they are not the
    run's. Replacing them passed every test, and the user's override was dropped without a word (mutation review m16,
    T20)."""
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  target_layer_ids: null\n")  # as a run from before 2026-12-03 wrote it
    saved = {"drafter_config": {"dflash_config": {"target_layer_ids": [1, 2, 2, 2, 3]}}}
    assert training.train.run_layer_ids(saved, config, []) == ["--model.target_layer_ids=[1, 2, 2, 2, 3]"]
    for given in (["--model.target_layer_ids=[0, 1, 2, 3, 4]"], ["--model.target_layer_ids", "[0, 1, 2, 3, 4]"],
                  ["--model.init_from=drafter"]):
        assert training.train.run_layer_ids(saved, config, given) == [], given


def test_a_warm_started_runs_config_naming_init_from_gets_no_layer_ids_added_on_resume(tmp_path):
    """A warm start's layers are its init_from drafter's: the resume adds no --model.target_layer_ids beside the
    init_from its config.yaml names, as it adds none beside one the command gives."""
    config = tmp_path / "config.yaml"
    config.write_text("model:\n  target_layer_ids: null\n  init_from: outputs/tiny/a/drafter\n")
    saved = {"drafter_config": {"dflash_config": {"target_layer_ids": [1, 2, 2, 2, 3]}}}
    assert training.train.run_layer_ids(saved, config, []) == []


def test_a_warm_started_runs_resume_keys_its_store_by_the_checkpoints_layers_not_the_gone_init_from(tmp_path,
                                                                                                    monkeypatch):
    """A warm start's resume builds its drafter from the checkpoint (DistillModule.configure_model), as its init_from
    folder may have moved or gone: build_missing_feature_store takes the layers from there too. Read from init_from,
    such a resume with data.feature_store was refused as the folder is not there, or keyed another folder's layers."""
    from types import SimpleNamespace

    from ddtree.configuration_dflash import DFlashDrafterConfig

    drafter = DFlashDrafterConfig(num_target_layers=8, dflash_config={"mask_token_id": 1, "target_layer_ids": [2, 5]})
    hparams = SimpleNamespace(distill_weight=0.0, distill_top_k=0, target_layer_ids=None, init_from=str(tmp_path / "gone"),
                              target_adapter=None, target_dtype="auto")
    cli = SimpleNamespace(datamodule=SimpleNamespace(feature_store="auto"), config=SimpleNamespace(
        trainer=SimpleNamespace(precision="32-true")), trainer=SimpleNamespace(world_size=1, callbacks=[]),
        model=SimpleNamespace(hparams=hparams, resumed_drafter_config=drafter.to_dict()))
    keyed = []

    def resolve(store, recipe, datamodule, final_hidden, teacher_top_k, **features):
        keyed.append(features["layer_ids"])
        return tmp_path / "store"

    monkeypatch.setattr(training.train, "resolve_store_path", resolve)
    monkeypatch.setattr(training.train, "is_complete", lambda store: True)
    training.train.build_missing_feature_store(cli, "tiny", [])
    assert keyed == [[2, 5]] and cli.datamodule.feature_store == str(tmp_path / "store")


def test_a_store_of_the_last_layer_holds_it_normed_and_an_older_raw_one_is_refused(tmp_path):
    """Decoding reads the target's last layer as the decoder's normed output (training/target.py)."""
    layer_ids = [1, 5]  # the tiny target has 6 layers
    path = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=layer_ids, dtype=torch.float32)
    store = FeatureStore(path)
    module = tiny_module(target_layer_ids=layer_ids)
    data, _, _ = make_datamodule(tmp_path).load_tokenized()
    with torch.no_grad():
        hidden_states = module.target(data[0]["input_ids"][None], output_hidden_states=True).hidden_states
    assert store.last_layer_normed  # recorded in the manifest
    assert torch.allclose(store[0][:, HIDDEN:], hidden_states[-1][0], atol=1e-5)  # layer 5: the normed output
    module.check_feature_store(store)  # accepted
    manifest = json.loads((path / "store.json").read_text())
    del manifest["last_layer"]  # as stores were built before
    (path / "store.json").write_text(json.dumps(manifest))
    with pytest.raises(DDTreeError) as error:
        module.check_feature_store(FeatureStore(path))
    message = one_line(error.value)
    assert str(path) in message and "layer 5, the last" in message and "--force" in message


def test_a_store_in_another_dtype_than_the_target_is_used_and_says_so(tmp_path, capsys):
    """A bf16 store read by a run whose target computes in fp32 (another precision than it was built for)."""
    module = tiny_module()  # fp32 target
    bf16 = FeatureStore(build_feature_store(make_datamodule(tmp_path), tmp_path / "bf16", layer_ids=LAYER_IDS,
                                            dtype=torch.bfloat16))
    capsys.readouterr()
    module.check_feature_store(bf16)
    line = capsys.readouterr().out.strip()
    assert str(bf16.path) in line and "bfloat16 features" in line and "computes in float32" in line
    fp32 = FeatureStore(build_feature_store(make_datamodule(tmp_path), tmp_path / "fp32", layer_ids=LAYER_IDS,
                                            dtype=torch.float32))
    capsys.readouterr()
    module.check_feature_store(fp32)
    assert capsys.readouterr().out == ""  # the same dtype: nothing to say


def test_a_missing_or_unfinished_store_says_how_to_build_it(tmp_path):
    with pytest.raises(DDTreeError) as error:
        FeatureStore(tmp_path / "nowhere")
    assert "does not exist" in one_line(error.value) and "make features RECIPE=" in str(error.value)
    partial_path(tmp_path / "nowhere").mkdir()
    with pytest.raises(DDTreeError) as error:
        FeatureStore(tmp_path / "nowhere")
    assert "incomplete" in one_line(error.value) and "make features RECIPE=" in str(error.value)


def test_a_cut_short_or_incomplete_manifest_is_one_line_saying_to_rebuild(tmp_path):
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    manifest = (out / "store.json").read_text()
    (out / "store.json").write_text(manifest[:len(manifest) // 2])  # a copy that stopped
    for read in (lambda: FeatureStore(out), lambda: build_feature_store(dm, out, layer_ids=LAYER_IDS)):
        with pytest.raises(DDTreeError) as refused:
            read()
        assert f"{out / 'store.json'} is unreadable" in one_line(refused.value) and "--force" in str(refused.value)
    without_lengths = {key: value for key, value in json.loads(manifest).items() if key != "lengths"}
    (out / "store.json").write_text(json.dumps(without_lengths))
    with pytest.raises(DDTreeError) as refused:
        FeatureStore(out)
    assert "store.json lacks lengths" in one_line(refused.value) and "--force" in str(refused.value)
    # --force replaces it, as the line says.
    build_feature_store(dm, out, layer_ids=LAYER_IDS, force=True)
    assert len(FeatureStore(out)) == len(json.loads(manifest)["lengths"])


# ----------------------------------------------------------------------------- building: atomic, resumable, safe


class Interrupt(Exception):
    pass


def stop_after_first_shard(monkeypatch) -> tuple:
    """Make builds stop after their first shard (as a kill would): (the real save_file, the list saves go to)."""
    real_save, saved = training.feature_store.save_file, []

    def save_then_stop(tensors, filename, **kwargs):
        if saved:
            raise Interrupt  # the second shard never gets written
        saved.append(filename)
        real_save(tensors, filename, **kwargs)

    monkeypatch.setattr(training.feature_store, "save_file", save_then_stop)
    return real_save, saved


def same_build(manifest: dict, other: dict) -> bool:
    """Two builds' manifests alike but for their build ids (each build draws its own)."""
    return {**manifest, "build_id": None} == {**other, "build_id": None}


def same_shard(path: Path, other: Path) -> bool:
    """Two builds' shards hold the same tensors (their metadata differs: each carries its own build's id)."""
    from safetensors.torch import load_file

    tensors, others = load_file(path), load_file(other)
    return tensors.keys() == others.keys() and all(tensors[name].equal(others[name]) for name in tensors)


def interrupted_build(monkeypatch, dm, out, **settings) -> list:
    """Run a build that stops after its first shard; returns the list saves are appended to."""
    real_save, saved = stop_after_first_shard(monkeypatch)
    with pytest.raises(Interrupt):
        build_feature_store(dm, out, **settings)
    monkeypatch.setattr(training.feature_store, "save_file", real_save)
    return saved


def test_interrupted_build_resumes_and_ends_equal_to_an_uninterrupted_one(tmp_path, monkeypatch):
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    straight = build_feature_store(dm, tmp_path / "straight", **settings)

    out = tmp_path / "resumed"
    real_save, saved = training.feature_store.save_file, interrupted_build(monkeypatch, dm, out, **settings)
    assert not out.exists()
    assert sorted(p.name for p in partial_path(out).iterdir()) == ["shard-00000.safetensors", "store.json"]
    first_shard = os.stat(partial_path(out) / "shard-00000.safetensors")

    def save_counting(tensors, filename, **kwargs):
        saved.append(filename)
        real_save(tensors, filename, **kwargs)

    saved.clear()
    monkeypatch.setattr(training.feature_store, "save_file", save_counting)
    build_feature_store(dm, out, **settings)
    manifest = json.loads((out / "store.json").read_text())
    assert len(saved) == len(manifest["shards"]) - 1 > 1  # every shard but the finished one
    kept = os.stat(out / "shard-00000.safetensors")
    assert (kept.st_ino, kept.st_mtime_ns) == (first_shard.st_ino, first_shard.st_mtime_ns)
    assert not partial_path(out).exists()
    assert same_build(manifest, json.loads((straight / "store.json").read_text()))
    for shard in manifest["shards"]:
        assert same_shard(out / shard["file"], straight / shard["file"]), shard["file"]


def boxed_build(monkeypatch, dm, out, seconds_per_shard: float, max_seconds: float, **settings):
    """A time-boxed build on a clock that moves `seconds_per_shard` while each shard is computed."""
    clock = [0.0]
    real_shard = training.feature_store.shard_tensors

    def slow_shard(*args, **kwargs):
        clock[0] += seconds_per_shard
        return real_shard(*args, **kwargs)

    monkeypatch.setattr(training.feature_store.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(training.feature_store, "shard_tensors", slow_shard)
    try:
        return build_feature_store(dm, out, max_seconds=max_seconds, **settings)
    finally:
        monkeypatch.undo()


def test_a_damaged_shard_is_computed_again_on_resume_and_named_at_open(tmp_path, monkeypatch, capsys):
    """A shard renamed into place before its bytes reached the disk (a power cut) reads as an empty file."""
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    straight = build_feature_store(dm, tmp_path / "straight", **settings)
    out = tmp_path / "resumed"
    interrupted_build(monkeypatch, dm, out, **settings)
    (partial_path(out) / "shard-00000.safetensors").write_bytes(b"")
    build_feature_store(dm, out, **settings)
    assert "shard-00000.safetensors is unreadable; computing it again" in capsys.readouterr().out
    assert same_shard(out / "shard-00000.safetensors", straight / "shard-00000.safetensors")

    # A finished store with a shard cut short (a copy that stopped) or lost: one line naming it, at open, not at the
    # first read of its sequences (hours in, at the first validation, for a shard of validation sequences).
    cut = out / "shard-00001.safetensors"
    intact = cut.read_bytes()
    cut.write_bytes(intact[:1000])
    with pytest.raises(DDTreeError) as refused:
        FeatureStore(out)
    assert "shard-00001.safetensors is unreadable" in one_line(refused.value) and "--force" in str(refused.value)
    cut.write_bytes(intact)
    (out / "shard-00000.safetensors").unlink()
    with pytest.raises(DDTreeError) as refused:
        FeatureStore(out)
    assert "lacks shard-00000.safetensors" in one_line(refused.value) and "--force" in str(refused.value)
    # one of the build's own shards, whole, but of another shape than the manifest plans (a shard of another store
    # copied over it, say): named at open too, not read as rows of other sequences
    with safe_open(str(cut), framework="pt") as handle:
        metadata = handle.metadata()  # this build's id
    save_file(load_file(straight / "shard-00000.safetensors"), out / "shard-00000.safetensors", metadata=metadata)
    tensors = load_file(cut)
    planned = list(tensors["features"].shape)
    save_file({**tensors, "features": tensors["features"][:-1]}, cut, metadata=metadata)
    with pytest.raises(DDTreeError) as refused:
        FeatureStore(out)
    assert one_line(refused.value) == (
        f"feature store {out}: shard-00001.safetensors holds features of shape {[planned[0] - 1, planned[1]]}, its "
        f"manifest plans {planned}: rebuild it with `make features RECIPE=<recipe>` and --force (FORCE=1)")


def test_a_finished_shard_of_another_build_is_computed_again_on_resume(tmp_path, monkeypatch):
    """Two builds of one store at once where the filesystem has no locks (take_lock): the one of other settings starts
    over in the same <out>.partial, and the other's next shard lands there, whole and of the planned shape. A resume
    that judged finished shards by their shape alone kept it, and the store it finished, its manifest naming another
    build than that shard, was refused at open as replaced (mutation review 16, m9)."""
    from safetensors.torch import load_file, save_file

    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    straight = build_feature_store(dm, tmp_path / "straight", **settings)
    out = tmp_path / "resumed"
    interrupted_build(monkeypatch, dm, out, **settings)
    shard = partial_path(out) / "shard-00000.safetensors"
    other = {name: tensor if name == "offsets" else torch.zeros_like(tensor)  # other layers' features: zeros here
             for name, tensor in load_file(shard).items()}
    save_file(other, shard, metadata={"build_id": "another build"})
    store = FeatureStore(build_feature_store(dm, out, **settings))
    assert same_shard(out / "shard-00000.safetensors", straight / "shard-00000.safetensors")
    assert store[0].equal(FeatureStore(straight)[0])


@pytest.mark.parametrize("full", [
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    # what safetensors' save_file raises on a full disk (a 2 MiB tmpfs filled by another job): not an OSError
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    # and on a full quota (a shared cluster's): it was re-raised, a traceback
    SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)"),
    OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)),
])
def test_a_disk_that_fills_during_the_build_is_one_line_and_leaves_no_stray_file(tmp_path, monkeypatch, full):
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    real_save, saved = training.feature_store.save_file, []

    def save_until_full(tensors, filename, **kwargs):
        if saved:  # the second shard: half written, then the disk is full
            Path(filename).write_bytes(b"x" * 100)
            raise full
        saved.append(filename)
        real_save(tensors, filename, **kwargs)

    monkeypatch.setattr(training.feature_store, "save_file", save_until_full)
    out = tmp_path / "store"
    with pytest.raises(DDTreeError) as refused:
        build_feature_store(dm, out, **settings)
    said = os.strerror(errno.EDQUOT if "122" in str(full) or getattr(full, "errno", None) == errno.EDQUOT
                       else errno.ENOSPC)
    assert f"store.partial/shard-00001.safetensors failed ({said};" in one_line(refused.value)
    assert "resumes" in str(refused.value)
    assert "data.feature_store" in str(refused.value)  # where `make train` builds the store: it has no --out
    assert ("within your disk quota" in str(refused.value)) == (said == os.strerror(errno.EDQUOT))
    assert sorted(p.name for p in partial_path(out).iterdir()) == ["shard-00000.safetensors", "store.json"]


def test_a_safetensors_error_that_is_no_write_failure_keeps_its_traceback(tmp_path, monkeypatch):
    """Only the OS's write errors are the user's to fix (space, a quota): anything else safetensors raises is a bug."""
    def refuse(tensors, filename, **kwargs):
        raise SafetensorError("invalid tensor layout")

    monkeypatch.setattr(training.feature_store, "save_file", refuse)
    with pytest.raises(SafetensorError):
        build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS)


@pytest.mark.parametrize("failing", [".time_box.json", "store.json"])
def test_a_full_disk_at_the_box_clock_or_the_boxed_manifest_is_one_line_and_the_build_resumes(tmp_path, monkeypatch,
                                                                                             failing):
    """The time box's clock, written after each shard, and the manifest a boxed build rewrites at its end were written
    outside the handler: a raw OSError traceback. The finished shards stay, and a rerun resumes after them (on the
    clock it had, where the manifest failed)."""
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    real_write, writes = training.feature_store.write_json_atomic, []

    def write_until_full(path, payload):
        writes.append(Path(path).name)
        if Path(path).name == failing and (failing != "store.json" or writes.count("store.json") == 2):  # boxed end
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, payload)

    monkeypatch.setattr(training.feature_store, "write_json_atomic", write_until_full)
    out = tmp_path / "store"
    with pytest.raises(DDTreeError) as refused:
        boxed_build(monkeypatch, dm, out, 10.0, 25.0, **settings)
    assert f"store.partial/{failing} failed (No space left on device;" in one_line(refused.value)
    left = sorted(p.name for p in partial_path(out).iterdir())
    shards = {path.name: path.stat().st_ino for path in partial_path(out).glob("shard-*")}
    if failing == "store.json":  # every shard the box allowed, and its clock
        assert left == [".time_box.json", "shard-00000.safetensors", "shard-00001.safetensors", "store.json"]
    else:
        assert left == ["shard-00000.safetensors", "store.json"]
    store = FeatureStore(boxed_build(monkeypatch, dm, out, 10.0, 25.0, **settings))
    assert {name: (out / name).stat().st_ino for name in shards} == shards  # kept, not computed again
    if failing == "store.json":  # resumed on its clock: the box (25 s, 20 spent) allows no third shard
        assert [shard["file"] for shard in store.shards] == list(shards)


def test_a_time_boxed_build_holds_a_seeded_share_validation_first_and_training_draws_from_it(tmp_path, monkeypatch,
                                                                                           capsys):
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    whole = FeatureStore(build_feature_store(dm, tmp_path / "whole", **settings))
    # 10 s a shard, 25 s of box: after two shards the third would end at 30 s, so it is not started
    store = FeatureStore(boxed_build(monkeypatch, dm, tmp_path / "boxed", 10.0, 25.0, **settings))
    order, num_val = dm.split_order(12)
    held = order[:sum(shard["num_sequences"] for shard in store.shards)]
    assert len(store.shards) == 2 and num_val < len(held) < 12
    assert store.covered() == set(held)  # the seeded order's first sequences, validation first
    for index in held:  # each the very features the whole store holds for it
        assert torch.equal(store[index], whole[index]), index
    with pytest.raises(IndexError, match="not in time-boxed feature store"):
        store[next(i for i in range(12) if i not in held)]
    captured = capsys.readouterr()
    out = captured.out
    assert f"{len(held)} of 12 sequences (time-boxed)" in out and "data.store_max_minutes" in out
    assert "features (box 0.4 min)" in captured.err  # its bar's estimate is the whole plan's, and says it is boxed

    boxed_dm = make_datamodule(tmp_path, feature_store=str(store.path))
    boxed_dm.setup("fit")
    whole_dm = make_datamodule(tmp_path, feature_store=str(whole.path))
    whole_dm.setup("fit")
    assert boxed_dm.val_set.indices == whole_dm.val_set.indices == order[:num_val]
    assert boxed_dm.train_set.indices == held[num_val:]  # training draws from the share...
    assert boxed_dm.train_split.indices == whole_dm.train_set.indices == order[num_val:]  # ...corpus and vocabulary not
    losses, _ = fit(tiny_module(), make_datamodule(tmp_path, feature_store=str(store.path)), steps=2)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))

    # Built again: the same build whatever its share, and a whole store in the data's order serves a boxed plan too.
    assert boxed_build(monkeypatch, dm, store.path, 10.0, 25.0, **settings) == store.path
    assert boxed_build(monkeypatch, dm, whole.path, 10.0, 25.0, **settings) == whole.path
    assert capsys.readouterr().out.count("already holds these features") == 2
    # A split its store does not hold the validation of: one line, not a silent mix.
    with pytest.raises(DDTreeError) as refused:
        make_datamodule(tmp_path, seed=3, feature_store=str(store.path)).setup("fit")
    assert "validation split" in one_line(refused.value)


def test_a_resume_onto_another_share_of_the_split_names_the_store_not_the_data(tmp_path, monkeypatch):
    """The box's own line says to build the whole store with FORCE=1; a resume of a run trained on the boxed share was
    then refused with "resume with the same data and devices", though neither had changed."""
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    boxed = boxed_build(monkeypatch, dm, tmp_path / "boxed", 10.0, 25.0, **settings)
    whole = build_feature_store(dm, tmp_path / "whole", **settings)
    loaders = {}
    for name, store in [("boxed", boxed), ("whole", whole)]:
        datamodule = make_datamodule(tmp_path, feature_store=str(store))
        datamodule.setup("fit")
        loaders[name] = datamodule.train_dataloader()
    run_share = len(loaders["boxed"].dataset)
    assert run_share < len(loaders["whole"].dataset) == 9
    with pytest.raises(DDTreeError) as refused:
        loaders["whole"].load_state_dict(loaders["boxed"].state_dict())
    assert one_line(refused.value).startswith(f"--resume: the run trained on {run_share} training sequences and "
                                              f"feature store {whole} holds 9 of the 9 (another share")
    assert "data.store_max_minutes" in str(refused.value) and "--model.init_from=<folder>" in str(refused.value)
    # Another split (data.val_fraction) is no store's doing: the data's line, as without a store.
    other_split = make_datamodule(tmp_path, feature_store=str(whole), val_fraction=0.5)
    other_split.setup("fit")
    with pytest.raises(DDTreeError, match="resume with the same data and devices"):
        other_split.train_dataloader().load_state_dict(loaders["whole"].state_dict())
    loaders["whole"].load_state_dict(loaders["whole"].state_dict())  # the same share resumes


def test_a_box_that_ends_at_the_validation_split_still_builds_training_sequences(tmp_path, monkeypatch):
    """One sequence a shard: the 3 validation shards fill the box, and the first training shard is built anyway."""
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(1))
    store = FeatureStore(boxed_build(monkeypatch, dm, tmp_path / "store", 10.0, 25.0, **settings))
    order, num_val = dm.split_order(12)
    assert [shard["num_sequences"] for shard in store.shards] == [1] * (num_val + 1)
    assert store.covered() == set(order[:num_val + 1])
    boxed_dm = make_datamodule(tmp_path, feature_store=str(store.path))
    boxed_dm.setup("fit")
    assert boxed_dm.train_set.indices == [order[num_val]]

    # A store of the validation split alone (as a build could leave before): one line, not a run with no batches.
    manifest = json.loads((store.path / "store.json").read_text())
    manifest["shards"] = manifest["shards"][:num_val]
    (store.path / "store.json").write_text(json.dumps(manifest))
    with pytest.raises(DDTreeError) as refused:
        make_datamodule(tmp_path, feature_store=str(store.path)).setup("fit")
    assert "none of the 9 training sequences" in one_line(refused.value)


def test_a_time_boxed_store_of_another_split_is_not_taken_as_this_build_done(tmp_path, monkeypatch, capsys):
    """Its share is no field of the build, so `make features --data.seed=2` over a boxed store of seed 1 said "already
    holds these features ... nothing to do", and training with seed 2 then refused it: its validation split (built
    first) is another. A richer store of that kind does not stand in for a plain one either."""
    from training.feature_store import build_identity, holds_features, target_text_config

    dm, other_seed = make_datamodule(tmp_path), make_datamodule(tmp_path, seed=2)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    store = FeatureStore(boxed_build(monkeypatch, dm, tmp_path / "store", 10.0, 25.0, **settings))
    order, num_val = other_seed.split_order(12)
    assert store.covered() is not None and not store.covered().issuperset(order[:num_val])  # the case at hand
    with pytest.raises(DDTreeError) as refused:
        make_datamodule(tmp_path, seed=2, feature_store=str(store.path)).setup("fit")  # what training says of it
    assert "validation split" in one_line(refused.value)

    capsys.readouterr()
    with pytest.raises(DDTreeError) as refused:
        build_feature_store(other_seed, store.path, **settings)
    message = one_line(refused.value)
    assert "data.seed" in message and "--force" in message and str(store.path) in message
    assert "nothing to do" not in capsys.readouterr().out
    assert FeatureStore(store.path).build_id == store.build_id  # untouched
    build_feature_store(dm, store.path, **settings)  # its own seed: the same build, done
    assert "nothing to do" in capsys.readouterr().out
    identity = build_identity(dm, target_text_config(dm.target), LAYER_IDS, None, torch.bfloat16)
    keys = dm.tokenization_keys()
    assert holds_features(store.path, identity, keys, dm) and not holds_features(store.path, identity, keys, other_seed)


def test_store_files_follow_the_umask(tmp_path):
    """safetensors creates its files 0600: the store sets what open() would have, as every other cache does."""
    old = os.umask(0o022)
    try:
        out = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS,
                                  max_shard_bytes=shard_bytes(3))
    finally:
        os.umask(old)
    paths = [out, *out.iterdir()]
    assert len(paths) > 3
    for path in paths:
        expected = 0o755 if path.is_dir() else 0o644
        assert stat.S_IMODE(path.stat().st_mode) == expected, f"{path}: {oct(stat.S_IMODE(path.stat().st_mode))}"


def test_an_interrupted_boxed_build_resumes_on_its_own_clock(tmp_path, monkeypatch):
    """The time spent before the interruption counts against the box: a restart does not buy a fresh one."""
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    straight = FeatureStore(boxed_build(monkeypatch, dm, tmp_path / "straight", 10.0, 25.0, **settings))
    assert len(straight.shards) == 2  # 10 s a shard in a 25 s box, uninterrupted

    out = tmp_path / "resumed"
    stop_after_first_shard(monkeypatch)
    with pytest.raises(Interrupt):
        boxed_build(monkeypatch, dm, out, 10.0, 25.0, **settings)  # (which undoes every patch as it ends)
    clock = json.loads((partial_path(out) / ".time_box.json").read_text())
    assert clock == {"seconds": 10.0, "computed_tokens": straight.shards[0]["num_tokens"], "computing_seconds": 10.0}
    resumed = FeatureStore(boxed_build(monkeypatch, dm, out, 10.0, 25.0, **settings))
    assert resumed.shards == straight.shards  # one more shard (20 s), not two more (a fresh 25 s box: 30 s)
    assert resumed.covered() == straight.covered() and not (out / ".time_box.json").exists()


def test_a_shard_interrupted_in_its_write_stays_out_of_the_store_a_box_ends_before_it(tmp_path, monkeypatch):
    """Ctrl-C or a kill while a shard is saved leaves its staging file (up to 256 MB) in <out>.partial/; where the
    resumed build's box ended before that shard (here a shorter box; a restart's own time counts against it too),
    the folder was renamed into the finished store with the file inside, for good."""
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    out = tmp_path / "store"
    real_save, saves = training.feature_store.save_file, []

    def save_then_interrupt(tensors, filename, **kwargs):
        saves.append(filename)
        real_save(tensors, filename, **kwargs)
        if len(saves) == 3:
            raise KeyboardInterrupt  # the third shard written, not yet renamed

    monkeypatch.setattr(training.feature_store, "save_file", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        boxed_build(monkeypatch, dm, out, 10.0, 35.0, **settings)  # (which undoes every patch as it ends)
    assert ".shard-00002.safetensors.tmp" in {p.name for p in partial_path(out).iterdir()}
    store = FeatureStore(boxed_build(monkeypatch, dm, out, 10.0, 25.0, **settings))  # 20 s spent: shard 2 left out
    assert [shard["file"] for shard in store.shards] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.safetensors", "shard-00001.safetensors", "store.json"]


def test_a_box_that_holds_everything_is_the_whole_data(tmp_path, monkeypatch):
    dm = make_datamodule(tmp_path)
    store = FeatureStore(boxed_build(monkeypatch, dm, tmp_path / "store", 1.0, 1000.0, layer_ids=LAYER_IDS,
                                     max_shard_bytes=shard_bytes(3)))
    assert store.covered() is None and len(store.shards) > 2
    with pytest.raises(DDTreeError, match="store_max_minutes=0"):
        make_datamodule(tmp_path, store_max_minutes=0)


def test_make_features_boxes_the_build_in_data_store_max_minutes(tmp_path, monkeypatch):
    """Every box test gave build_feature_store its seconds: store_seconds could have returned the minutes as seconds,
    and data.store_max_minutes=30 would have built a 30-second share of the store, saying so in one line (mutation
    review, gap 5 / F13). Here the CLI boxes a build whose clock moves 10 s a shard."""
    data = write_conversations(tmp_path / "conversations.jsonl")
    boxes = []

    def on_the_build_clock(datamodule, out, max_seconds=None, **settings):
        boxes.append(max_seconds)
        return boxed_build(monkeypatch, datamodule, out, 10.0, max_seconds, **settings,
                           max_shard_bytes=shard_bytes(3, settings["dtype"]))

    monkeypatch.setattr(training.features, "build_feature_store", on_the_build_clock)
    out = tmp_path / "store"
    assert main([*features_args(tmp_path, data, out), "--data.store_max_minutes=0.5"]) == 0
    store = FeatureStore(out)
    assert boxes == [30.0]
    # two shards, the third would end past 30 s; a 0.5-second box holds the first alone
    assert len(store.shards) == 2 and len(store.manifest["sequence_ids"]) == len(store) > len(store.covered())


def test_a_resumed_build_in_another_dtype_refuses_to_mix_them(tmp_path, monkeypatch, capsys):
    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    out = tmp_path / "store"
    interrupted_build(monkeypatch, dm, out, dtype=torch.bfloat16, **settings)
    with pytest.raises(DDTreeError) as refused:  # a machine whose auto precision is fp32 picks the build up
        build_feature_store(dm, out, dtype=torch.float32, **settings)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "bfloat16" in message and "float32" in message and "--force" in message
    assert (partial_path(out) / "shard-00000.safetensors").is_file()  # nothing was dropped
    capsys.readouterr()
    build_feature_store(dm, out, dtype=torch.float32, force=True, **settings)  # asked for: start over in fp32
    assert FeatureStore(out).dtype == torch.float32 and not partial_path(out).exists()
    size_line = next(line for line in capsys.readouterr().out.splitlines() if "estimated size" in line)
    assert "x 4 bytes, float32)" in size_line


def test_a_launch_told_of_an_unfinished_build_in_another_dtype_is_given_a_force_it_can_pass(tmp_path, monkeypatch,
                                                                                            capsys):
    """`make train` builds a missing store itself, and its refusal said "or pass --force (FORCE=1) to start over":
    training.train has no --force (unrecognized arguments). Starting over is make features' --force."""
    dm = make_datamodule(tmp_path)
    store = tmp_path / "store"
    interrupted_build(monkeypatch, dm, store, dtype=torch.bfloat16, layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    capsys.readouterr()
    assert train_main(["--recipe", "tiny", "--output-root", str(tmp_path / "out"), f"--data.data_path={dm.data_path}",
                       f"--data.cache_dir={tmp_path / 'cache'}", f"--data.feature_store={store}",
                       "--data.max_length=128", "--trainer.precision=32-true", "--trainer.max_steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bfloat16" in err and "float32" in err, err
    assert "make features with --force (FORCE=1)" in err, err
    assert (partial_path(store) / "shard-00000.safetensors").is_file()  # nothing was dropped


@pytest.mark.parametrize("other", [
    dict(layer_ids=[0, 2, 4]),  # as many layers, the last in neither: the same width
    dict(target_adapter="adapter"),  # the target with a LoRA adapter folded in
    # one more hidden size a token (H values in bf16, or 16 ids and log-probabilities): shards of 4 such sequences are
    # planned as shards of 3 plain ones
    dict(final_hidden=True, max_shard_bytes=shard_bytes(4)),
    dict(teacher_top_k=16, max_shard_bytes=shard_bytes(4)),
], ids=["layer_ids", "adapter", "final_hidden", "teacher_top_k"])
def test_an_interrupted_build_resumed_with_other_settings_starts_over(tmp_path, monkeypatch, capsys, other):
    """A resume keeps finished shards of the planned shape: only the manifest's fields tell another build's apart.
    Only another dtype was tested, so a resume that ignored the layer ids passed every test, and a build rerun under
    other model.target_layer_ids kept the old layers' features for its first shard's sequences, under a manifest
    naming the new ones (mutation review, gap 1 / F05)."""
    if "target_adapter" in other:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        base, _ = load_target("tiny-random")
        get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(
            tmp_path / "adapter")
        other = {**other, "target_adapter": str(tmp_path / "adapter")}
    # 6 conversations, not make_datamodule's 12: still a finished first shard and more after it (the assertion on
    # len(store.shards) below), at half the build and forward work of its four builds (~-0.7 s a case, 2-core AVX2 EPYC)
    write_conversations(tmp_path / "conversations.jsonl", count=6)
    dm = make_datamodule(tmp_path)
    before = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3), sequences_per_batch=1)
    settings = {**before, **other}
    out = tmp_path / "store"
    interrupted_build(monkeypatch, dm, out, **before)
    interrupted = read_manifest(partial_path(out) / "store.json")
    capsys.readouterr()
    store = FeatureStore(build_feature_store(dm, out, **settings))
    assert "holds an unfinished build of other settings; starting over" in capsys.readouterr().out
    assert store.shards == interrupted["shards"]  # the finished shard had the planned shape: no other check stops it
    assert len(store.shards) > 1, store.shards  # the build was cut after its first shard, with more to go
    target, _ = load_frozen_target("tiny-random", torch.bfloat16, settings.get("target_adapter"))
    data, _, _ = dm.load_tokenized()
    for i in range(len(data)):
        online = target_layer_features(target, data[i]["input_ids"][None], settings["layer_ids"])[0]  # (T_i, K*H)
        assert torch.equal(store[i], online), f"sequence {i}"
    straight = build_feature_store(dm, tmp_path / "straight", **settings)  # the final states or teacher alike
    for shard in store.shards:
        assert same_shard(out / shard["file"], straight / shard["file"]), shard["file"]


def test_an_interrupted_build_whose_manifest_is_unreadable_starts_over(tmp_path, monkeypatch, capsys):
    """<out>.partial/store.json cut short (a power cut as it was written): an unfinished build of unknown settings,
    whose shards cannot be trusted, so the build starts over and ends complete, not refused asking for --force."""
    dm = make_datamodule(tmp_path)
    out = tmp_path / "store"
    interrupted_build(monkeypatch, dm, out, layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    manifest = partial_path(out) / "store.json"
    manifest.write_text(manifest.read_text()[:40])
    capsys.readouterr()
    store = FeatureStore(build_feature_store(dm, out, layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3)))
    assert "holds an unfinished build of other settings; starting over" in capsys.readouterr().out
    assert len(store) == 12 and store.layer_ids == LAYER_IDS and not partial_path(out).exists()


def test_a_complete_store_in_another_dtype_is_refused_naming_both_and_what_training_does_with_it(tmp_path):
    """`make features` on a machine whose auto precision differs from the one that built the recipe's store said only
    "differs in dtype", where training reads that store as it is (cast, with a note): the user could not tell which
    dtype to ask for, nor that they need not rebuild at all (found in a review, 2026-12-04)."""
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS, dtype=torch.bfloat16)
    with pytest.raises(DDTreeError) as refused:
        build_feature_store(dm, out, layer_ids=LAYER_IDS, dtype=torch.float32)
    message = one_line(refused.value)
    assert "dtype (bfloat16 there, float32 here)" in message, message
    assert "training reads it as it is, cast to float32" in message and "--dtype bfloat16" in message, message
    assert "--force" in message and FeatureStore(out).dtype == torch.bfloat16
    with pytest.raises(DDTreeError) as refused:  # a field whose values are long is named alone
        build_feature_store(dm, out, layer_ids=[0, 2], dtype=torch.bfloat16)
    message = one_line(refused.value)
    assert "differs in target_layer_ids ([1, 3, 4] there, [0, 2] here)" in message and "cast" not in message, message


@pytest.mark.parametrize("teacher, differs", [(dict(teacher_top_k=5), "teacher_top_k (0 there, 5 here)"),
                                              (dict(final_hidden=True), "final_hidden (False there, True here)")])
def test_a_complete_store_without_what_distillation_reads_is_another_build(tmp_path, monkeypatch, teacher, differs):
    """`make features --out <a plain store>` for a distilling recipe: the same features, but no teacher or final hidden
    states, which training refuses to distil from. A build that took it as done ("nothing to do") passed every test
    (mutation review, gap 9 / F12)."""
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    monkeypatch.setattr(training.feature_store, "load_frozen_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(DDTreeError) as refused:
        build_feature_store(dm, out, layer_ids=LAYER_IDS, **teacher)
    message = one_line(refused.value)
    assert f"{out} holds a feature store of another build (differs in {differs})" in message and "--force" in message
    assert (FeatureStore(out).teacher_top_k, FeatureStore(out).final_hidden) == (0, False)


def test_a_recipes_store_keeps_the_teacher_its_distillation_reads_and_nothing_more():
    """store_teacher decides what `make features` and training's auto-build store. A top-k recipe's store that kept
    the final hidden states too passed every test, at 2H bytes a token more (+33% on an H=4096 target with 3 layers
    in bf16): the tests computed store_teacher rather than assert it (mutation review 19, gap 7 / S28)."""
    assert store_teacher(0.5, 64) == (False, 64)  # the top-k teacher alone
    assert store_teacher(0.5, 0) == (True, 0)  # the whole distribution: from the final hidden states
    assert store_teacher(0.0, 64) == (False, 0)  # no distillation: the features alone


def test_the_same_data_path_spelled_otherwise_is_the_same_build(tmp_path, monkeypatch, capsys):
    """Relative, ./ or absolute: the same file (the tokenization key names it) was refused as another build, and an
    unfinished build was started over, its finished shards deleted."""
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    absolute = make_datamodule(tmp_path)
    monkeypatch.chdir(tmp_path)
    relative, dotted = (make_datamodule(tmp_path, data_path=path) for path in ("conversations.jsonl",
                                                                                 "./conversations.jsonl"))
    assert relative.tokenization_key() == absolute.tokenization_key()
    out = build_feature_store(absolute, tmp_path / "store", **settings)
    for dm in (relative, dotted):
        build_feature_store(dm, out, **settings)
        assert "already holds these features" in capsys.readouterr().out

    resumed = tmp_path / "resumed"
    interrupted_build(monkeypatch, relative, resumed, **settings)
    first_shard = os.stat(partial_path(resumed) / "shard-00000.safetensors").st_ino
    build_feature_store(absolute, resumed, **settings)
    assert "starting over" not in capsys.readouterr().out
    assert os.stat(resumed / "shard-00000.safetensors").st_ino == first_shard  # kept, not computed again


def test_a_store_of_the_data_file_edited_in_place_is_another_build_though_its_lengths_are_the_same(tmp_path,
                                                                                                   monkeypatch):
    """`make features` after the data file was edited where it lies (a reply's words reordered: the same lengths)
    must refuse the old data's store. A rule that took any tokenization key as this data's said "already holds these
    features; nothing to do", and training then refused the store: no test edited the data but its length (mutation
    review 19, gap 4 / S03)."""
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    built = FeatureStore(out).tokenization_key
    data = tmp_path / "conversations.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    reply = rows[0]["messages"][1]
    reply["content"] = " ".join(reversed(reply["content"].split()))
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    edited = make_datamodule(tmp_path)
    assert edited.load_tokenized()[0].lengths() == FeatureStore(out).lengths  # only the key tells the two apart
    monkeypatch.setattr(training.feature_store, "load_frozen_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(DDTreeError) as refused:
        build_feature_store(edited, out, layer_ids=LAYER_IDS)
    message = one_line(refused.value)
    assert f"{out} holds a feature store of another build (differs in tokenization_key (" in message, message
    assert "--force" in message and FeatureStore(out).tokenization_key == built != edited.tokenization_key()


def test_a_complete_store_is_replaced_only_with_force_and_only_once_the_new_one_is_complete(tmp_path, monkeypatch, capsys):
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    written = os.stat(out / "shard-00000.safetensors").st_mtime_ns
    build_feature_store(dm, out, layer_ids=LAYER_IDS)  # the same build: nothing to do
    assert "already holds these features" in capsys.readouterr().out
    assert os.stat(out / "shard-00000.safetensors").st_mtime_ns == written

    with pytest.raises(DDTreeError) as error:
        build_feature_store(dm, out, layer_ids=[0, 2])
    assert "target_layer_ids" in one_line(error.value) and "--force" in str(error.value)
    assert FeatureStore(out).layer_ids == LAYER_IDS

    def fail(tensors, filename, **kwargs):
        raise Interrupt

    monkeypatch.setattr(training.feature_store, "save_file", fail)
    with pytest.raises(Interrupt):
        build_feature_store(dm, out, layer_ids=[0, 2], force=True)
    assert FeatureStore(out).layer_ids == LAYER_IDS  # the old store stays until the new one is complete
    monkeypatch.undo()
    build_feature_store(dm, out, layer_ids=[0, 2], force=True)
    assert FeatureStore(out).layer_ids == [0, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "conversations.jsonl", "store"]  # no leftovers
    # A complete store of the same build is built again too (the time box's line relies on it for the whole store),
    # as --help says: it said "replace an existing store of another build", which reads as nothing to do here.
    before = FeatureStore(out).build_id
    build_feature_store(dm, out, layer_ids=[0, 2], force=True)
    assert FeatureStore(out).build_id != before and "already holds" not in capsys.readouterr().out
    force_help = next(action.help for action in features_parser()._actions if "--force" in action.option_strings)
    assert "of this build or another" in force_help and "replaced once the new one is complete" in force_help


def test_a_replaced_store_whose_delete_fails_leaves_the_new_one_in_place_and_a_later_force_works(tmp_path, monkeypatch,
                                                                                                capsys):
    """A shard a reader holds open on NFS (a training run on the old store) cannot be deleted: the rebuild, whose new
    store was already in place, failed with a traceback, and the next --force failed after its whole build on the
    aside folder it could not clear, leaving the finished store in <out>.partial for good."""
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    builds = [FeatureStore(out).build_id]
    rmtree = shutil.rmtree

    def held_open(path, *args, **kwargs):
        if ".replaced" in Path(path).name:  # the folder stays whatever is asked; without ignore_errors, an error
            if kwargs.get("ignore_errors"):
                return None
            raise PermissionError(errno.EPERM, "Operation not permitted", str(Path(path) / "shard-00000.safetensors"))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held_open)
    for _ in range(2):  # the second --force finds the first's undeleted store aside
        assert build_feature_store(dm, out, layer_ids=LAYER_IDS, force=True) == out
        builds.append(FeatureStore(out).build_id)
        (line,) = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]  # (tqdm's bar too)
        displaced = Path(line.split(", moved to ")[1].split(", could not")[0])
        assert line.startswith(f"warning: {out} was written; the store it replaced, moved to {displaced}, could not be "
                               "deleted (") and line.endswith("): delete it by hand")
        assert read_manifest(displaced / "store.json")["build_id"] == builds[-2]  # the old store, named
    assert len(set(builds)) == 3 and not partial_path(out).exists()
    monkeypatch.undo()  # the readers have closed them: the next --force deletes what earlier ones could not
    build_feature_store(dm, out, layer_ids=LAYER_IDS, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "conversations.jsonl", "store"]


def test_a_store_replaced_while_a_run_reads_it_stops_that_run_in_one_line(tmp_path):
    """A run opens its store's shards lazily, by path: after a --force build replaced the store (here in bf16), it
    read the new build's shards through the old manifest's offsets, other sequences' features (of the right length
    for many: collate took them without a word) in another dtype than the manifest's."""
    import pickle
    from safetensors.torch import load_file, save_file

    dm = make_datamodule(tmp_path)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3, torch.float32))
    out = build_feature_store(dm, tmp_path / "store", dtype=torch.float32, **settings)
    reader = FeatureStore(out)
    first = reader[0]  # the run has read sequences of shard 0 so far
    worker = pickle.loads(pickle.dumps(reader))  # a DataLoader worker's copy, which opens its own shards
    build_feature_store(dm, out, dtype=torch.bfloat16, force=True, **settings)
    assert len(FeatureStore(out).shards) < len(reader.shards)  # bf16 fits more sequences in a shard
    # a shard the new build rewrote, one it has no more (it said "lacks ...: rebuild it with --force"), and a worker's
    for store, index in ((reader, reader.shards[1]["first_sequence"]), (reader, reader.shards[-1]["first_sequence"]),
                         (worker, 0)):
        with pytest.raises(DDTreeError) as error:
            store[index]
        assert "shard-0000" in one_line(error.value) and "the store was replaced since" in str(error.value)
        assert "start the run again" in str(error.value)
    assert reader[0].equal(first)  # a shard it had open stays the build it opened
    assert FeatureStore(out)[0].dtype == torch.bfloat16  # a run started now reads the new one

    # A store built before build ids (none in its manifest nor its shards) reads as before.
    manifest = json.loads((out / "store.json").read_text())
    del manifest["build_id"]
    (out / "store.json").write_text(json.dumps(manifest))
    for shard in manifest["shards"]:
        save_file(load_file(out / shard["file"]), out / shard["file"])
    older = FeatureStore(out)
    assert older.build_id is None and all(older[i].shape[0] == older.lengths[i] for i in range(len(older)))


def test_a_store_replaced_while_data_loader_workers_read_it_stops_the_run_in_one_line(tmp_path, capsys):
    """torch re-raises a worker's error with a heading for its message ("Caught DDTreeError in DataLoader worker process
    0.") and the worker's traceback after it: the command printed the heading alone, without the reason or what to do
    (found in a review). The GPU recipes read their stores with data.num_workers 4."""
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3, torch.float32))
    out = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", dtype=torch.float32, **settings)
    dm = make_datamodule(tmp_path, num_workers=1, feature_store=str(out))
    dm.setup("fit")

    def train(argv):
        loader = dm.train_dataloader()
        build_feature_store(make_datamodule(tmp_path), out, dtype=torch.bfloat16, force=True, **settings)  # another launch
        for _ in loader:
            pass

    capsys.readouterr()
    assert run_cli(train) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]  # not the build's
    assert line.startswith(f"error: feature store {out}: shard-0000") and line.endswith(
        "the store was replaced since (a --force build); start the run again to read the new store"), line


def test_a_folder_or_file_that_is_not_a_store_is_never_replaced(tmp_path):
    write_conversations(tmp_path / "conversations.jsonl", count=4)  # the store in the empty folder: any store will do
    dm = make_datamodule(tmp_path)
    notes = tmp_path / "mine" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("keep me")
    for out in (notes.parent, notes):
        for force in (False, True):
            with pytest.raises(DDTreeError) as error:
                build_feature_store(dm, out, layer_ids=LAYER_IDS, force=force)
            assert f"{out} exists and is not a feature store" in one_line(error.value)
    assert notes.read_text() == "keep me" and sorted(p.name for p in notes.parent.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert FeatureStore(build_feature_store(dm, empty, layer_ids=LAYER_IDS)).layer_ids == LAYER_IDS  # an empty folder is used


def test_a_mount_point_is_refused_as_the_store_folder_before_anything_is_built(tmp_path, monkeypatch):
    """`--out /mnt/disk` (an empty disk mounted there): the store was built beside it, on the parent's disk (the free
    space printed was that disk's), and the rename into its place at the end failed with EBUSY, a traceback."""
    out = tmp_path / "disk"
    out.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == out)
    with pytest.raises(DDTreeError) as refused:
        build_feature_store(make_datamodule(tmp_path), out, layer_ids=LAYER_IDS)
    assert "mount point" in one_line(refused.value) and str(out / "features") in str(refused.value)
    assert not partial_path(out).exists() and not lock_path(out).exists() and not any(out.iterdir())


def test_a_link_to_a_folder_elsewhere_is_refused_as_the_store_folder_naming_that_folder(tmp_path, capsys):
    """`--out store` where store is a link to a folder on a bigger disk: the store was built beside the link (the free
    space printed was the link's disk's) and renamed over it, and the link renamed aside could not be deleted (a
    warning); nothing went where the link points."""
    elsewhere = tmp_path / "big-disk" / "store"
    elsewhere.mkdir(parents=True)
    out = tmp_path / "store"
    out.symlink_to(elsewhere)
    with pytest.raises(DDTreeError) as refused:
        build_feature_store(make_datamodule(tmp_path), out, layer_ids=LAYER_IDS)
    assert "link" in one_line(refused.value) and str(elsewhere) in str(refused.value)
    assert out.is_symlink() and not partial_path(out).exists() and not any(elsewhere.iterdir())


def said_while_waiting(capsys, thread: threading.Thread) -> str:
    """What a build in `thread` printed until it said it waits for another's lock (or, unguarded, ended): 60 s at most."""
    said = ""
    for _ in range(600):
        said += capsys.readouterr().out
        if "waiting" in said or not thread.is_alive():
            break
        time.sleep(0.1)
    return said


def test_a_second_build_of_one_store_waits_for_the_first_and_takes_its_store(tmp_path, monkeypatch, capsys):
    """Two launches building one store (`make features` while a training run builds it) both wrote into one
    <out>.partial: the later one removed the other's folder, or found it renamed away, and failed saying to free
    space (with 62 GB free); with a pause before the end both failed and the finished store was left renamed aside.
    The first launch is this test, holding the lock (flock conflicts between two opens in one process too)."""
    dm = make_datamodule(tmp_path)
    built = build_feature_store(dm, tmp_path / "built", layer_ids=LAYER_IDS)
    out = tmp_path / "store"
    first = os.open(lock_path(out), os.O_RDONLY | os.O_CREAT)
    fcntl.flock(first, fcntl.LOCK_EX)
    monkeypatch.setattr(training.feature_store, "load_frozen_target", lambda *a, **k: pytest.fail("built it again"))
    outcome = []
    second = threading.Thread(target=lambda: outcome.append(build_feature_store(dm, out, layer_ids=LAYER_IDS)))
    second.start()
    said = said_while_waiting(capsys, second)
    assert f"another process is building {out} (it holds {lock_path(out)}); waiting for it to end" in said
    assert second.is_alive() and not partial_path(out).exists()
    shutil.copytree(built, out)  # the first launch's store, finished; it removes its lock file, then ends
    lock_path(out).unlink()
    os.close(first)
    second.join(timeout=60)
    assert outcome == [out] and "already holds these features" in capsys.readouterr().out
    assert FeatureStore(out)[0].equal(FeatureStore(built)[0])
    assert not lock_path(out).exists() and not partial_path(out).exists()


def test_a_build_holding_the_lock_keeps_a_second_build_waiting(tmp_path, capsys):
    """The test above holds the lock with its own exclusive flock: a build's lock taken shared (both builds get it and
    write into one <out>.partial) passed it (mutation review 45, s01). Here the first launch holds build_lock as a
    build does."""
    dm = make_datamodule(tmp_path)
    out = tmp_path / "store"
    outcome = []
    with build_lock(out):
        second = threading.Thread(target=lambda: outcome.append(build_feature_store(dm, out, layer_ids=LAYER_IDS)))
        second.start()
        said = said_while_waiting(capsys, second)
        assert "waiting for it to end" in said and second.is_alive() and not partial_path(out).exists()
    second.join(timeout=120)
    assert outcome == [out] and FeatureStore(out).layer_ids == LAYER_IDS and not lock_path(out).exists()


def test_a_build_that_waited_on_a_removed_lock_file_waits_for_the_one_there_now(tmp_path, capsys):
    """The holder removes <out>.lock before it lets go, and a third launch may lock a new one at once: a waiter that
    then took the removed file's lock built beside the third, both in one <out>.partial. No test raced the three
    (mutation review 45, s03)."""
    lock = lock_path(tmp_path / "store")
    holder = os.open(lock, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    taken = []
    waiter = threading.Thread(target=lambda: taken.append(training.feature_store.take_lock(lock, "a first build")))
    waiter.start()
    said = said_while_waiting(capsys, waiter)
    assert "waiting for it to end" in said
    lock.unlink()  # the holder's end (build_lock), a third launch's lock on the new file, then the holder lets go
    third = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_EXCL)
    fcntl.flock(third, fcntl.LOCK_EX)
    os.close(holder)
    waiter.join(timeout=2)
    assert waiter.is_alive() and not taken
    os.close(third)
    waiter.join(timeout=60)
    assert len(taken) == 1 and os.path.samestat(os.fstat(taken[0]), os.stat(lock))
    os.close(taken[0])


def test_a_filesystem_without_locks_builds_unlocked_and_leaves_no_lock_file(tmp_path, monkeypatch, capsys):
    """NFS without lockd or Lustre without -o flock: flock fails with ENOLCK after the lock file was made, and every
    build, a complete store's with nothing to do included, left <out>.lock beside the store (found in a review)."""
    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(training.feature_store.fcntl, "flock", no_locks)
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    assert f"cannot lock {lock_path(out)} ({os.strerror(errno.ENOLCK)})" in capsys.readouterr().err
    assert not lock_path(out).exists() and FeatureStore(out).layer_ids == LAYER_IDS
    build_feature_store(dm, out, layer_ids=LAYER_IDS)
    assert "already holds these features" in capsys.readouterr().out and not lock_path(out).exists()
    # a lock file this call did not make (another build's, on a host whose locks work) stays
    lock_path(out).touch()
    build_feature_store(dm, out, layer_ids=LAYER_IDS)
    assert lock_path(out).exists()


def test_a_complete_store_on_a_read_only_place_says_there_is_nothing_to_do(tmp_path, monkeypatch, capsys):
    """A store on a read-only mount (simulated: root may write anywhere): no <out>.lock can be made beside it, and a
    build of the same features, with nothing to do, says so rather than stopping on the lock's OSError."""
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    real_open = os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(training.feature_store.os, "open", read_only)
    capsys.readouterr()
    assert build_feature_store(dm, out, layer_ids=LAYER_IDS) == out
    assert "already holds these features" in capsys.readouterr().out and not lock_path(out).exists()


def test_a_build_killed_while_it_holds_the_lock_holds_up_no_later_build(tmp_path, capsys):
    out = tmp_path / "store"
    hold = ("import fcntl, os, sys, time; lock = os.open(sys.argv[1], os.O_RDONLY | os.O_CREAT); "
            "fcntl.flock(lock, fcntl.LOCK_EX); print('held', flush=True); time.sleep(600)")
    killed = subprocess.Popen([sys.executable, "-c", hold, str(lock_path(out))], stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline() == "held\n"
    killed.kill()
    killed.wait()
    assert lock_path(out).exists()  # left by the kill; the OS released its lock
    build_feature_store(make_datamodule(tmp_path), out, layer_ids=LAYER_IDS)
    assert "waiting" not in capsys.readouterr().out
    assert FeatureStore(out).layer_ids == LAYER_IDS and not lock_path(out).exists()


def test_a_partial_folder_removed_under_a_build_is_said_so_not_a_full_disk(tmp_path, monkeypatch):
    """What a build without the lock (an older version's, one on a filesystem without locks) can do to another: the
    error said to free space."""
    dm = make_datamodule(tmp_path)
    real_save = training.feature_store.save_file

    def save_after_removal(tensors, filename, **kwargs):
        shutil.rmtree(Path(filename).parent)  # the other build finished first and renamed the folder away
        real_save(tensors, filename, **kwargs)

    monkeypatch.setattr(training.feature_store, "save_file", save_after_removal)
    out = tmp_path / "store"
    with pytest.raises(DDTreeError) as error:
        build_feature_store(dm, out, layer_ids=LAYER_IDS)
    assert f"{partial_path(out)} was removed meanwhile (finished or removed by another process" in one_line(error.value)
    assert "free some space" not in str(error.value)


def test_size_estimate_is_printed_before_anything_is_written_and_a_full_disk_refuses(tmp_path, monkeypatch, capsys):
    dm = make_datamodule(tmp_path)
    data, _, _ = dm.load_tokenized()
    tokens = len(data.input_ids)
    expected = f"{tokens * 3 * HIDDEN * 2 / 1e6:.1f} MB ({tokens:,} tokens x 3 layers x {HIDDEN} x 2 bytes, bfloat16)"
    out = tmp_path / "store"
    printed_before_first_write = []
    real_write = training.feature_store.write_json_atomic

    def first_write(path, payload):
        printed_before_first_write.append(capsys.readouterr().out)
        real_write(path, payload)

    monkeypatch.setattr(training.feature_store, "write_json_atomic", first_write)
    monkeypatch.setattr(training.feature_store, "free_bytes", lambda path: 1000)
    with pytest.raises(DDTreeError) as error:
        build_feature_store(dm, out, layer_ids=LAYER_IDS)
    assert "free" in one_line(error.value) and str(partial_path(out).parent) in str(error.value)
    assert expected in capsys.readouterr().out
    assert not out.exists() and not partial_path(out).exists() and not printed_before_first_write

    monkeypatch.undo()
    monkeypatch.setattr(training.feature_store, "write_json_atomic", first_write)
    build_feature_store(dm, out, layer_ids=LAYER_IDS)
    assert len(printed_before_first_write) == 1 and expected in printed_before_first_write[0]


def test_a_resumed_build_needs_room_only_for_what_is_left(tmp_path, monkeypatch, capsys):
    """Its finished shards are on that disk already: counting them too refused a resume that had room for the rest,
    in a line that said it needed less than was free. Only fresh builds were tested (mutation review 19, gap 6 /
    S23)."""
    dm = make_datamodule(tmp_path)
    out = tmp_path / "store"
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    interrupted_build(monkeypatch, dm, out, **settings)
    manifest = read_manifest(partial_path(out) / "store.json")
    token_bytes = len(LAYER_IDS) * HIDDEN * torch.bfloat16.itemsize
    whole = manifest["total_tokens"] * token_bytes
    left = (manifest["total_tokens"] - manifest["shards"][0]["num_tokens"]) * token_bytes
    monkeypatch.setattr(training.feature_store, "free_bytes", lambda path: (left + whole) // 2)  # room for the rest
    capsys.readouterr()
    assert len(FeatureStore(build_feature_store(dm, out, **settings))) == 12
    assert "already written" in capsys.readouterr().out


@pytest.mark.parametrize("dtype, kept", [(torch.bfloat16, {}), (torch.float32, {}), (torch.bfloat16, {"final_hidden": True}),
                                         (torch.float32, {"teacher_top_k": 5})], ids=["bf16", "fp32", "final", "top5"])
def test_the_disk_check_asks_for_exactly_the_stores_bytes(tmp_path, monkeypatch, dtype, kept):
    """Per token: K layers (and with final_hidden one more hidden state) in the store's dtype, 8 bytes a teacher token
    (int32 id, float32 log-probability). The tests above refuse with 1000 bytes free: a check off by a factor (half the
    free space counted twice, a float32 store sized in bf16, the final hidden state left out) passed them and began
    hours of writes that end in a full disk (mutation review 45, s15-s17). One byte short refuses; exactly enough
    builds."""
    dm = make_datamodule(tmp_path)
    tokens = len(dm.load_tokenized()[0].input_ids)
    values = (len(LAYER_IDS) + kept.get("final_hidden", 0)) * HIDDEN
    needed = tokens * (values * dtype.itemsize + 8 * kept.get("teacher_top_k", 0))
    out = tmp_path / "store"
    monkeypatch.setattr(training.feature_store, "free_bytes", lambda path: needed - 1)
    with pytest.raises(DDTreeError) as error:
        build_feature_store(dm, out, layer_ids=LAYER_IDS, dtype=dtype, **kept)
    assert "the feature store needs" in one_line(error.value) and not partial_path(out).exists()
    monkeypatch.setattr(training.feature_store, "free_bytes", lambda path: needed)
    build_feature_store(dm, out, layer_ids=LAYER_IDS, dtype=dtype, **kept)
    assert sum(shard.stat().st_size for shard in out.glob("shard-*.safetensors")) >= needed


# ----------------------------------------------------------------------------- the CLIs


def features_args(tmp_path: Path, data: Path, out: Path) -> list[str]:
    """`python -m training.features` for the tiny recipe over `data` into `out`, at max_length 128, the tokenization
    cached under tmp_path."""
    return ["--recipe", "tiny", "--out", str(out), f"--data.data_path={data}", "--data.max_length=128",
            f"--data.cache_dir={tmp_path / 'cache'}"]


def test_cli_bad_input_exits_2_with_one_line(capsys):
    assert main(["--recipe", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope" in err and "tiny" in err
    assert main(["--recipe", "tiny", "--data.no_such_field=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no_such_field" in err
    assert main(["--recipe", "tiny", "--dtype", "float8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dtype='float8'" in err and "bfloat16" in err
    assert main(["--recipe", "tiny", "--data.max_length=many"]) == 2  # a field of the wrong type
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "max_length" in err
    assert main(["--recipe", "tiny", "--data.val_fraction=2"]) == 2  # a value the DataModule refuses
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "val_fraction" in err


def test_a_bad_dtype_names_auto_among_the_choices(capsys):
    """The line listed float32, bfloat16 and float16, not auto: the default, the recipe's own training dtype."""
    assert main(["--recipe", "tiny", "--dtype", "fp32"]) == 2
    assert capsys.readouterr().err.strip() == "error: --dtype='fp32': choose auto or one of float32, bfloat16, float16"


# model.target_dtype float32 under bf16-mixed: training runs the target in fp32, and a bf16 store would be read cast,
# its features rounded to bf16 where decoding feeds fp32 ones; `make features` ignoring it passed (mutation review,
# gap 6 / R03); and under 32-true (what auto picks on a CPU slow in bf16) the store is fp32: one built for bf16-mixed
# whatever the precision passed every test, and fp32 training read features rounded to bf16 (mutation review 16, m28)
@pytest.mark.parametrize("precision, target_dtype, dtype", [("bf16-mixed", "auto", torch.bfloat16),
                                                            ("bf16-mixed", "float32", torch.float32),
                                                            ("32-true", "auto", torch.float32)])
def test_cli_builds_the_recipe_store(tmp_path, precision, target_dtype, dtype):
    data = write_conversations(tmp_path / "conversations.jsonl")
    out = tmp_path / "store"
    assert main([*features_args(tmp_path, data, out), f"--trainer.precision={precision}",
                 f"--model.target_dtype={target_dtype}"]) == 0
    store = FeatureStore(out)  # the recipe's layers and target, in the dtype training runs that target in
    assert dtype == dtype_for_precision(precision, target_dtype)
    assert store.layer_ids == [1, 3, 4] and store.dtype == dtype and store.target == "tiny-random"
    recipe_data = DistillDataModule(target="tiny-random", data_path=str(data), max_length=128,
                                    cache_dir=str(tmp_path / "cache"), feature_store=str(out))
    recipe_data.setup("fit")  # matches the data it was built from (recipe defaults for the rest)


def test_cli_force_replaces_a_store_of_another_build_and_without_it_refuses_in_one_line(tmp_path, capsys):
    """`make features` over a complete store of other settings stops with one line saying to pass --force, and with
    --force builds the new store in its place. --force was tested on build_feature_store and through the CLI only where
    no store stood in the way: a CLI that never handed it on passed every test, and `--force` said the same "pass
    --force" line again (mutation review 44, L22)."""
    data = write_conversations(tmp_path / "conversations.jsonl")
    out = tmp_path / "store"
    assert main(features_args(tmp_path, data, out)) == 0
    other = [*features_args(tmp_path, data, out), "--model.target_layer_ids=[0, 2]"]
    capsys.readouterr()
    assert main(other) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--force" in err and str(out) in err
    assert FeatureStore(out).layer_ids == [1, 3, 4]  # untouched
    assert main([*other, "--force"]) == 0
    assert FeatureStore(out).layer_ids == [0, 2]


def test_cli_builds_a_warm_starts_store_of_the_layers_its_drafter_reads(tmp_path):
    """model.init_from without model.target_layer_ids: training reads the layers the drafter folder names, and so must
    the store. Only init_from's validation was tested: a build that checked the folder, then took the default layers,
    passed every test, and training refused its store, hours of build on a large target (mutation review, gap 8 /
    F14b)."""
    from training.export import export_drafter

    warm = export_drafter(tiny_module(target_layer_ids=[0, 2], block_size=8), tmp_path / "warm")
    data = write_conversations(tmp_path / "conversations.jsonl")
    out = tmp_path / "store"
    assert main([*features_args(tmp_path, data, out), "--model.target_layer_ids=null",
                 f"--model.init_from={warm}"]) == 0
    store = FeatureStore(out)
    assert store.layer_ids == [0, 2]
    tiny_module(init_from=str(warm), target_layer_ids=None, num_layers=None, block_size=None).check_feature_store(store)


def test_cli_builds_the_default_layers_store_where_the_recipe_names_neither_layers_nor_a_warm_start(tmp_path):
    """model.target_layer_ids unset and no model.init_from: the store holds the layers a new drafter of the target
    reads by default (build_drafter_config), which training then takes."""
    data = write_conversations(tmp_path / "conversations.jsonl")
    out = tmp_path / "store"
    assert main([*features_args(tmp_path, data, out), "--model.target_layer_ids=null"]) == 0
    store = FeatureStore(out)
    assert store.layer_ids == [0, 1, 2, 3, 4] == tiny_module(target_layer_ids=None).target_layer_ids
    tiny_module(target_layer_ids=None).check_feature_store(store)


def test_cli_dtype_given_builds_the_store_in_it_whatever_the_recipes_precision(tmp_path):
    """--dtype names the store's dtype (to finish a build begun on a machine whose auto precision was the other one,
    as the refusal of a resume in another dtype says): the recipe's trainer.precision does not override it."""
    data = write_conversations(tmp_path / "conversations.jsonl")
    out = tmp_path / "store"
    assert main([*features_args(tmp_path, data, out), "--trainer.precision=32-true", "--dtype", "bfloat16"]) == 0
    assert FeatureStore(out).dtype == torch.bfloat16


def test_cli_out_refuses_an_empty_folder_and_takes_a_tilde_for_the_home_folder(capsys):
    """`--out "$STORE"` with STORE unset would read as no --out (main's `args.out or ...`): the store built in the
    recipe's default folder, not where it was asked for; `--out=~/store` (no shell expansion) built a folder named ~."""
    with pytest.raises(SystemExit) as exited:
        features_parser().parse_args(["--recipe", "tiny", "--out", ""])
    assert exited.value.code == 2 and "--out: expected a path, got an empty string" in capsys.readouterr().err
    assert features_parser().parse_args(["--out=~/store"]).out == str(Path.home() / "store")


def test_cli_out_help_names_the_folder_the_default_recipe_builds():
    """--help said the default folder is <recipe>-<tokenization key>; the default recipe distils from a top-32 teacher,
    and its store is <recipe>-<tokenization key>-top32 (default_store_path)."""
    from training.arguments import DEFAULT_RECIPE, recipe_path
    from training.recipe import read_recipe

    model = read_recipe(recipe_path(DEFAULT_RECIPE), []).model
    assert store_teacher(model.distill_weight, model.distill_top_k) == (False, 32)
    out_help = next(action.help for action in features_parser()._actions if "--out" in action.option_strings)
    assert "-top<k>" in out_help and "-final" in out_help


def test_cli_out_is_where_the_store_is_built_though_the_recipe_names_auto(tmp_path, monkeypatch, capsys):
    """`make features RECIPE=smollm2-135m OUT=<dir>`: that recipe's data.feature_store is auto, and OUT names the store
    all the same. A build that took every OUT other than the recipe's own folder for a richer store standing in passed
    every test (they gave --out without auto, or auto without --out): it printed "already holds these features ...
    nothing to do", built nothing, and a run from that folder found no store (mutation review 16, m29)."""
    monkeypatch.setattr(training.feature_store, "cache_dir", lambda: tmp_path / "ddtree-cache")
    data = write_conversations(tmp_path / "conversations.jsonl")
    out = tmp_path / "store"
    assert main([*features_args(tmp_path, data, out), "--data.feature_store=auto"]) == 0
    assert "nothing to do" not in capsys.readouterr().out
    assert FeatureStore(out).layer_ids == [1, 3, 4] and not (tmp_path / "ddtree-cache" / "features").exists()


def test_cli_builds_a_top_k_recipes_store_with_its_teacher_alone(tmp_path):
    """A recipe with model.distill_top_k: `make features` keeps the target's top k next tokens its training distils
    from. store_teacher was tested alone and the CLI only with distill_weight: a build that dropped distill_top_k kept
    the final hidden states instead (2H bytes a token where 8k do), and the run refused that store for want of its
    teacher (mutation review 16, m27)."""
    data = write_conversations(tmp_path / "conversations.jsonl")
    out = tmp_path / "store"
    assert main([*features_args(tmp_path, data, out), "--model.distill_weight=0.5", "--model.distill_top_k=4"]) == 0
    store = FeatureStore(out)
    assert (store.teacher_top_k, store.final_hidden) == (4, False)
    tiny_module(distill_weight=0.5, distill_top_k=4).check_feature_store(store)  # what that run reads


def test_cli_builds_the_store_of_a_recipes_target_adapter(tmp_path):
    """model.target_adapter: the store holds the features of the target with the adapter merged, as training computes
    them. Through the CLI only its hand-over to the data was tested: a build that dropped it wrote the base target's
    features, and the run refused that store, which `make features` then took as built (mutation review 16, m26)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base, _ = load_target("tiny-random")
    adapter = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(adapter)
    data = write_conversations(tmp_path / "conversations.jsonl")
    out = tmp_path / "store"
    assert main([*features_args(tmp_path, data, out), f"--model.target_adapter={adapter}",
                 "--trainer.precision=32-true"]) == 0
    store = FeatureStore(out)
    assert store.target_adapter == str(adapter) and store.target_adapter_sha256 is not None
    target, _ = load_frozen_target("tiny-random", torch.float32, str(adapter))
    tokenized, _, _ = DistillDataModule(target="tiny-random", data_path=str(data), max_length=128,
                                        cache_dir=str(tmp_path / "cache")).load_tokenized()
    for i in range(len(tokenized)):  # (the CLI's length-sorted batches pad: the float rounding differs a little)
        online = target_layer_features(target, tokenized[i]["input_ids"][None], LAYER_IDS)[0]
        torch.testing.assert_close(store[i], online, rtol=0, atol=1e-6)
    tiny_module(target_adapter=str(adapter)).check_feature_store(store)  # what that run reads


def test_a_store_or_cache_under_tilde_is_in_the_home_folder(tmp_path, monkeypatch, capsys):
    """`--data.feature_store=~/x` reaches no shell, nor does a recipe's `feature_store: ~/x`: the build wrote a folder
    named `~` in the working one, where a run from elsewhere did not find it."""
    from ddtree.files import cache_dir

    monkeypatch.setenv("DDTREE_CACHE", str(cache_dir()))  # the converted targets stay where they are
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    data = write_conversations(tmp_path / "conversations.jsonl")
    assert main(["--recipe", "tiny", f"--data.data_path={data}", "--data.max_length=128", "--data.cache_dir=~/cache",
                 "--data.feature_store=~/store"]) == 0
    assert f"wrote {home / 'store'}:" in capsys.readouterr().out
    assert FeatureStore(home / "store").layer_ids == LAYER_IDS and (home / "cache").is_dir()
    assert list(work.iterdir()) == []
    # Training reads the field where `make features` does (DistillDataModule): the same store.
    dm = DistillDataModule(target="tiny-random", data_path=str(data), max_length=128, cache_dir="~/cache",
                           feature_store="~/store")
    dm.setup("fit")
    assert dm.store.path == home / "store" and list(work.iterdir()) == []
    # and the data itself (a regenerating recipe wrote its replies into a folder named `~` in the working one)
    (home / "conversations.jsonl").write_bytes(data.read_bytes())
    dm = DistillDataModule(target="tiny-random", data_path="~/conversations.jsonl", max_length=128, cache_dir="~/cache")
    assert dm.data_path == str(home / "conversations.jsonl")
    dm.setup("fit")
    assert len(dm.train_set) + len(dm.val_set) > 0 and list(work.iterdir()) == []


def test_train_builds_a_missing_store_in_a_single_process_and_refuses_in_many(tmp_path, monkeypatch, capsys):
    data = write_conversations(tmp_path / "conversations.jsonl", count=16)
    store = tmp_path / "store"
    common = [
        "--recipe", "tiny", "--output-root", str(tmp_path / "out"), f"--data.data_path={data}",
        f"--data.cache_dir={tmp_path / 'cache'}", f"--data.feature_store={store}", "--data.batch_size=2",
        "--trainer.val_check_interval=null", "--eval.every_n_train_steps=2", "--eval.limit=1",
        *toy_data.SMALL_EVAL, "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
    ]
    assert train_main([*common, "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.precision=32-true",
                       "--run", "two"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "make features RECIPE=tiny" in err and str(store) in err
    # the store's dtype is the launch's precision: the command builds it so (mutation review m16, T25)
    make_features = err.split('ARGS="', 1)[1].split('"', 1)[0].split()
    assert "--trainer.precision=32-true" in make_features and f"--data.feature_store={store}" in make_features
    assert not [item for item in make_features if item.startswith(("--trainer.devices", "--trainer.max_steps", "--run"))]
    assert not store.exists() and not partial_path(store).exists()

    def target_must_not_run(*args, **kwargs):
        raise AssertionError("training ran the target although a feature store was given")

    monkeypatch.setattr(training.module, "target_layer_features", target_must_not_run)
    assert train_main([*common, "--run", "one"]) == 0
    assert FeatureStore(store).layer_ids == [1, 3, 4]
    assert (tmp_path / "out" / "tiny" / "one" / "drafter" / "config.json").exists()


def test_a_store_that_does_not_fit_tells_a_training_launch_what_it_can_change(tmp_path, monkeypatch, capsys):
    """`make train` builds a missing store itself, and training.train has no --out: "free some space or give another
    --out" named a flag it refuses ("unrecognized arguments"). The launch's own way is data.feature_store."""
    data = write_conversations(tmp_path / "conversations.jsonl")
    store = tmp_path / "store"
    monkeypatch.setattr(training.feature_store, "free_bytes", lambda path: 1000)
    assert train_main(["--recipe", "tiny", "--output-root", str(tmp_path / "out"), f"--data.data_path={data}",
                       f"--data.cache_dir={tmp_path / 'cache'}", f"--data.feature_store={store}",
                       "--data.max_length=128", "--trainer.max_steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "free some space" in err and "data.feature_store" in err, err
    assert not partial_path(store).exists()


def test_a_launch_that_waited_for_another_launchs_build_takes_its_store_as_it_takes_a_finished_one(tmp_path,
                                                                                                   monkeypatch, capsys):
    """Two launches of one recipe at once, the first building the store in bf16 and the second training in fp32: the
    second waited for the first's lock, then stopped on "a feature store of another build ... pass --force (FORCE=1)
    ... or give another --out", flags training.train does not take, though started a minute later it reads that store
    (cast, as it says). A store another launch finished meanwhile is taken, and checked as training checks any."""
    dm = make_datamodule(tmp_path, seed=0, val_fraction=0.02, min_supervised_tokens=16)  # the tiny recipe's
    store = tmp_path / "store"
    build_feature_store(dm, store, layer_ids=LAYER_IDS, dtype=torch.bfloat16)  # the first launch's, done while waiting
    seen = []

    def not_yet_at_launch(path):  # the second launch looked before the first had finished
        seen.append(path)
        return len(seen) > 1 and is_complete(path)

    monkeypatch.setattr(training.train, "is_complete", not_yet_at_launch)
    capsys.readouterr()
    assert train_main(["--recipe", "tiny", "--output-root", str(tmp_path / "out"), f"--data.data_path={dm.data_path}",
                       f"--data.cache_dir={tmp_path / 'cache'}", f"--data.feature_store={store}",
                       "--data.max_length=128", "--trainer.precision=32-true", "--trainer.max_steps=1",
                       "--trainer.val_check_interval=null", "--eval.every_n_train_steps=2", "--eval.limit=1",
                       *toy_data.SMALL_EVAL, "--trainer.enable_progress_bar=false"]) == 0, capsys.readouterr().err
    assert "cast" in capsys.readouterr().out  # check_feature_store's word on a store in another dtype


def test_the_command_a_multi_process_launch_gives_builds_the_store_it_reads(tmp_path, capsys):
    """The line said `make features RECIPE=tiny OUT=<store>` without the launch's overrides: run as printed, it built
    the recipe's layers [1, 3, 4], which the same launch then refused (it reads [0, 2]). The command is run here as
    make would run it (`make -n`, then in this process), a value with spaces in it."""
    data = write_conversations(tmp_path / "conversations.jsonl")
    store = tmp_path / "store"
    launch = ["--recipe", "tiny", "--output-root", str(tmp_path / "out"), f"--data.data_path={data}",
              f"--data.cache_dir={tmp_path / 'cache'}", f"--data.feature_store={store}", "--data.max_length", "128",
              "--model.target_layer_ids=[0, 2]", "--trainer.max_steps=1", "--trainer.devices=2", "--trainer.strategy=ddp"]
    assert train_main(launch) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--trainer.max_steps" not in err, err
    command = shlex.split(err.split("`")[1])
    assert command[:2] == ["make", "features"], command
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    planned = subprocess.run(["make", "-n", "--no-print-directory", *command[1:]], cwd=Path(__file__).parents[2],
                             env=make_env, capture_output=True, text=True)
    assert planned.returncode == 0, planned.stderr
    argv = shlex.split(planned.stdout.strip().splitlines()[-1])
    assert argv[1:3] == ["-m", "training.features"], argv
    assert main(argv[3:]) == 0
    built = FeatureStore(store)
    assert built.layer_ids == [0, 2]
    tiny_module(target_layer_ids=[0, 2], mask_token_id=16).check_feature_store(built)  # what the launch reads
    DistillDataModule(target="tiny-random", data_path=str(data), max_length=128, cache_dir=str(tmp_path / "cache"),
                      feature_store=str(store)).setup("fit")  # its data, at max_length 128 (the recipe's otherwise)


def test_auto_store_is_the_recipes_cache_folder_built_on_first_use(tmp_path, monkeypatch):
    monkeypatch.setattr(training.feature_store, "cache_dir", lambda: tmp_path / "ddtree-cache")  # targets stay cached
    data = write_conversations(tmp_path / "conversations.jsonl", count=16)
    args = [
        "--recipe", "tiny", "--output-root", str(tmp_path / "out"), f"--data.data_path={data}",
        f"--data.cache_dir={tmp_path / 'cache'}", "--data.feature_store=auto", "--data.batch_size=2",
        "--trainer.val_check_interval=null", "--eval.every_n_train_steps=2", "--eval.limit=1",
        *toy_data.SMALL_EVAL, "--trainer.max_steps=2", "--trainer.enable_progress_bar=false",
    ]
    assert train_main([*args, "--run", "one"]) == 0
    datamodule = DistillDataModule(target="tiny-random", data_path=str(data), max_length=256, cache_dir=str(tmp_path / "cache"))
    expected = tmp_path / "ddtree-cache" / "features" / f"tiny-{datamodule.tokenization_key()}"
    assert FeatureStore(expected).layer_ids == [1, 3, 4] and not FeatureStore(expected).final_hidden
    assert "feature_store: auto" in (tmp_path / "out" / "tiny" / "one" / "config.yaml").read_text()  # a resume resolves it again
    # A distilling run needs the final hidden states: its own store, beside the first.
    assert train_main([*args, "--run", "two", "--model.distill_weight=0.5"]) == 0
    assert FeatureStore(expected.with_name(expected.name + "-final")).final_hidden
    # Without the smaller store, a run that does not distil takes the one with final hidden states: no second build.
    shutil.rmtree(expected)
    assert train_main([*args, "--run", "three"]) == 0
    assert not expected.exists()
    # `make features` for that run has nothing to do; with --force it builds the smaller store on its own, and the
    # store with final hidden states stays (--force replaced it with the smaller one before).
    features = ["--recipe", "tiny", f"--data.data_path={data}", f"--data.cache_dir={tmp_path / 'cache'}",
                "--data.feature_store=auto"]
    assert main(features) == 0 and not expected.exists()
    assert main([*features, "--force"]) == 0
    assert not FeatureStore(expected).final_hidden
    assert FeatureStore(expected.with_name(expected.name + "-final")).final_hidden
    with pytest.raises(DDTreeError, match="auto"):  # outside training.train there is no recipe to resolve it with
        DistillDataModule(target="tiny-random", data_path=str(data), feature_store="auto",
                          cache_dir=str(tmp_path / "cache")).setup()  # it tokenizes first: not into the real cache


@pytest.mark.parametrize("flags, named, trained", [
    (["--model.distill_weight=0.5", "--model.distill_top_k=-1"], "model.distill_top_k=-1 must be at least 0",
     dict(distill_weight=0.5, distill_top_k=-1)),
    # values training refuses: a store was built for them (the recipe's default layers for [], a top-4 teacher)
    (["--model.target_layer_ids=[]"], "model.target_layer_ids=[] must be at least one layer, or unset",
     dict(target_layer_ids=[])),
    (["--model.distill_weight=2", "--model.distill_top_k=4"], "model.distill_weight=2.0 must be in [0, 1]",
     dict(distill_weight=2.0, distill_top_k=4)),
    (["--model.target_layer_ids=null", "--model.init_from={tmp}/none"], "model.init_from: drafter '{tmp}/none' is not",
     None),
    (["--out", "{tmp}/afile/store"], "cannot write the feature store {tmp}/afile/store: {tmp}/afile is a file", None),
])
def test_bad_store_settings_are_one_line_before_the_target_loads(tmp_path, capsys, monkeypatch, flags, named, trained):
    """Each was a traceback (a RuntimeError leaving a .partial folder, an OSError, a NotADirectoryError once the
    target had loaded and the first shard was computed), or a store built for model values training refuses in the
    same words (DistillModule's checks of the fields that shape a store)."""
    monkeypatch.setattr(training.feature_store, "load_frozen_target", lambda *a, **k: pytest.fail("loaded the target"))
    (tmp_path / "afile").write_text("mine")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    out = [] if "--out" in flags else ["--out", str(tmp_path / "store")]
    assert main(["--recipe", "tiny", f"--data.cache_dir={tmp_path / 'cache'}", *out, *flags]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and named.format(tmp=tmp_path) in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["afile"]
    if trained is not None:  # training refuses them in the same words
        with pytest.raises(DDTreeError) as refused:
            DistillModule(**trained)
        assert err[0] == f"error: {refused.value}"


def test_a_store_built_with_an_adapter_retrained_since_at_the_same_path_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    def save_adapter(seed):
        torch.manual_seed(seed)
        base, _ = load_target("tiny-random")
        config = LoraConfig(r=2, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
        get_peft_model(base, config).save_pretrained(tmp_path / "adapter")

    adapter = str(tmp_path / "adapter")
    save_adapter(0)
    datamodule = make_datamodule(tmp_path)
    store = build_feature_store(datamodule, tmp_path / "store", layer_ids=LAYER_IDS, target_adapter=adapter,
                                dtype=torch.float32)
    assert FeatureStore(store).target_adapter_sha256 is not None
    fit(tiny_module(target_adapter=adapter), make_datamodule(tmp_path, feature_store=str(store)))  # the same adapter

    save_adapter(1)  # retrained where it was: the store's features are another target's
    with pytest.raises(DDTreeError) as error:
        fit(tiny_module(target_adapter=adapter), make_datamodule(tmp_path, feature_store=str(store)))
    assert f"built with adapter {adapter}" in one_line(error.value) and "--force" in str(error.value)
    with pytest.raises(DDTreeError, match="target_adapter_sha256"):  # and the same build is not taken as done
        build_feature_store(datamodule, tmp_path / "store", layer_ids=LAYER_IDS, target_adapter=adapter,
                            dtype=torch.float32)


def test_a_store_built_before_its_local_target_was_saved_over_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from ddtree.targets import tiny_target_folder

    target = tmp_path / "target"
    shutil.copytree(tiny_target_folder(), target)
    datamodule = make_datamodule(tmp_path, target=str(target))
    path = build_feature_store(datamodule, tmp_path / "store", layer_ids=LAYER_IDS, dtype=torch.float32)
    module = tiny_module(target=str(target), mask_token_id=16)  # (tiny-random's, which a folder does not name)
    assert FeatureStore(path).target_weights is not None
    module.check_feature_store(FeatureStore(path))  # accepted: the same weights

    weights = load_file(str(target / "model.safetensors"))  # fine-tuned and saved over, at the same path
    save_file({name: value + 0.01 for name, value in weights.items()}, str(target / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(DDTreeError) as error:
        module.check_feature_store(FeatureStore(path))
    assert f"target {target}'s weights" in one_line(error.value) and "--force" in str(error.value)
    with pytest.raises(DDTreeError, match="differs in target_weights"):  # and the same build is not taken as done
        build_feature_store(datamodule, path, layer_ids=LAYER_IDS, dtype=torch.float32)

    manifest = json.loads((path / "store.json").read_text())
    del manifest["target_weights"]  # a store built before the weights were recorded: taken as it was
    (path / "store.json").write_text(json.dumps(manifest))
    module.check_feature_store(FeatureStore(path))
    assert build_feature_store(datamodule, path, layer_ids=LAYER_IDS, dtype=torch.float32) == path


def test_a_store_of_another_hub_target_is_another_build(tmp_path, monkeypatch):
    """A target named by a Hub id has no weights fingerprint: a store of another one with the same tokenizer and
    hidden size (a base and an instruct checkpoint) was taken as this target's ("nothing to do") under a rule that
    compared the two missing fingerprints as equal. Every other test uses local targets (mutation review 19, gap 5 /
    S01)."""
    dm = make_datamodule(tmp_path)
    out = build_feature_store(dm, tmp_path / "store", layer_ids=LAYER_IDS)
    manifest = json.loads((out / "store.json").read_text())
    manifest.update(target="org/other-model", target_weights=None)  # as a Hub-id target's store records it
    (out / "store.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(training.feature_store, "target_fingerprint", lambda target: None)  # this one a Hub id too
    monkeypatch.setattr(training.feature_store, "load_frozen_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(DDTreeError) as refused:
        build_feature_store(dm, out, layer_ids=LAYER_IDS)
    message = one_line(refused.value)
    assert "differs in target (org/other-model there, tiny-random here)" in message and "--force" in message, message


def test_training_refuses_a_store_of_another_hub_target(tmp_path, monkeypatch):
    """The fit's check, as the build's above: with neither target's weights here to fingerprint, comparing the two
    missing fingerprints as equal took another Hub model's store (a base for its instruct checkpoint, the same
    tokenizer and hidden size) for this run's features; dropping `weights is not None` passed every test."""
    out = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS)
    monkeypatch.setattr(training.module, "target_fingerprint", lambda target: None)  # this run's target a Hub id
    module = tiny_module()

    def built_from(target):
        manifest = json.loads((out / "store.json").read_text())
        manifest.update(target=target, target_weights=None)  # as a Hub-id target's store records it
        (out / "store.json").write_text(json.dumps(manifest))
        return FeatureStore(out)

    module.check_feature_store(built_from("tiny-random"))  # its own target's
    with pytest.raises(DDTreeError) as refused:
        module.check_feature_store(built_from("org/other-model"))
    # Both targets named, each as its own: a message naming the store's twice left the user nothing to compare
    assert one_line(refused.value) == (f"feature store {out} holds features of target org/other-model (adapter None), "
                                       "this run's is tiny-random (adapter None): rebuild it with `make features "
                                       "RECIPE=<recipe>` and --force (FORCE=1)")


def test_a_top_k_store_of_another_k_is_refused_more_tokens_as_fewer(tmp_path):
    """distill_top_k is the loss's teacher: a store of the target's top 16 next tokens trained a top-8 run against 16,
    another loss than its recipe's and than online training's (`!=` as `<` passed every test)."""
    out = build_feature_store(make_datamodule(tmp_path), tmp_path / "store", layer_ids=LAYER_IDS, dtype=torch.float32,
                              teacher_top_k=16)
    tiny_module(distill_weight=0.5, distill_top_k=16).check_feature_store(FeatureStore(out))
    for top_k in (8, 32):
        with pytest.raises(DDTreeError) as refused:
            tiny_module(distill_weight=0.5, distill_top_k=top_k).check_feature_store(FeatureStore(out))
        assert one_line(refused.value).startswith(f"model.distill_top_k={top_k} needs the target's top {top_k} next "
                                                  f"tokens, and feature store {out} holds its top 16"), top_k


def test_a_store_whose_adapter_has_no_recorded_sha256_is_not_a_build_without_adapter():
    """differing_fields, which the finished store's check, the resume and the richer store's choice ask: a store built
    with an adapter before adapters' sha256s were recorded matched a build without adapter under a rule that compared
    the two missing sha256s as equal (mutation review 19, gap 8 / S02)."""
    existing = {"target": "tiny-random", "target_adapter": "/adapters/lora-1"}  # no target_adapter_sha256
    planned = {"target": "tiny-random", "target_adapter": None, "target_adapter_sha256": None}
    assert differing_fields(existing, planned, (), ["target", "target_adapter"]) == ["target_adapter"]


def test_a_store_of_edited_data_at_the_same_path_spelled_otherwise_differs_in_its_tokenization_alone(tmp_path,
                                                                                                     monkeypatch):
    """The refusal names what differs: data edited in place and named relative where the store recorded it absolute
    is another tokenization of the same path, not data from another path too."""
    monkeypatch.chdir(tmp_path)
    existing = {"data_path": str(tmp_path / "conversations.jsonl"), "tokenization_key": "before-the-edit"}
    planned = {"data_path": "conversations.jsonl", "tokenization_key": "after-the-edit"}
    assert differing_fields(existing, planned, ("after-the-edit",), ["data_path", "tokenization_key"]) == [
        "tokenization_key"]


def test_a_store_that_differs_in_several_fields_names_every_one():
    """A refusal naming one of them sends the user to fix it and be refused again for the next."""
    existing = {"dtype": "bfloat16", "target_layer_ids": [1, 2], "hidden_size": 64}
    planned = {"dtype": "float32", "target_layer_ids": [1, 3], "hidden_size": 64}
    assert differing_fields(existing, planned, (), ["dtype", "hidden_size", "target_layer_ids"]) == [
        "dtype", "target_layer_ids"]


def test_a_run_without_distillation_takes_a_built_store_that_holds_more(tmp_path, monkeypatch):
    """The plain store missing, `auto` takes the recipe's store with final hidden states, else the smallest top-k
    teacher's: the same features, nothing built twice. A distilling run keeps its own folder."""
    from training.feature_store import MANIFEST, build_identity, resolve_store_path, target_text_config

    monkeypatch.setattr(training.feature_store, "cache_dir", lambda: tmp_path)
    datamodule = make_datamodule(tmp_path)
    key, folder = datamodule.tokenization_key(), tmp_path / "features"
    identity = build_identity(datamodule, target_text_config("tiny-random"), LAYER_IDS, None, torch.bfloat16)

    def built(name):
        (folder / name).mkdir(parents=True)
        (folder / name / MANIFEST).write_text(json.dumps({**identity, "shards": [], "lengths": []}))

    def resolved(**teacher):
        return resolve_store_path("auto", "tiny", datamodule, **teacher, layer_ids=LAYER_IDS).name

    assert resolved() == f"tiny-{key}"  # nothing built: the plain store is what gets built
    (folder / f"tiny-{key}-top16").mkdir(parents=True)  # unfinished (no manifest): not taken
    built(f"tiny-{key}-top64")
    built(f"tiny-{key}-top32")
    assert resolved() == f"tiny-{key}-top32"
    assert resolved(teacher_top_k=64) == f"tiny-{key}-top64" and resolved(teacher_top_k=8) == f"tiny-{key}-top8"
    built(f"tiny-{key}-final")
    assert resolved() == f"tiny-{key}-final" and resolved(final_hidden=True) == f"tiny-{key}-final"
    # nor does a top-k run take the one with final hidden states: it holds no teacher (mutation review 45, s22)
    assert resolved(teacher_top_k=8) == f"tiny-{key}-top8"
    built(f"tiny-{key}")
    assert resolved() == f"tiny-{key}"
    assert resolve_store_path(None, "tiny", datamodule) is None


def test_a_richer_store_whose_manifest_is_cut_short_does_not_stand_in_for_the_runs_own(tmp_path, monkeypatch):
    """Its manifest unreadable (a copy that stopped), a -final store holds no features this run can read: taken, the
    run stopped on it, told to rebuild a store it never asked for, where its own plain store is built instead."""
    from training.feature_store import MANIFEST, resolve_store_path

    monkeypatch.setattr(training.feature_store, "cache_dir", lambda: tmp_path)
    datamodule = make_datamodule(tmp_path)
    plain = tmp_path / "features" / f"tiny-{datamodule.tokenization_key()}"
    final = plain.with_name(plain.name + "-final")
    final.mkdir(parents=True)
    (final / MANIFEST).write_text('{"layer_ids": [1, 3')
    assert resolve_store_path("auto", "tiny", datamodule, layer_ids=LAYER_IDS) == plain


def test_a_manifest_that_is_json_but_no_object_is_one_line_saying_to_rebuild(tmp_path):
    manifest = tmp_path / "store.json"
    manifest.write_text("[1, 3]")  # a hand edit, or another tool's file
    with pytest.raises(DDTreeError) as error:
        read_manifest(manifest)
    assert str(error.value) == (f"feature store manifest {manifest} is not a JSON object: rebuild the store with "
                                "`make features RECIPE=<recipe>` and --force (FORCE=1)")


def test_a_target_named_by_a_hub_id_has_no_fingerprint_and_a_local_one_has(tmp_path):
    """A store records the weights' fingerprint of a target here (built-in or a folder); a Hub id's files are not
    here to read, so its store records none, rather than failing on a path that does not exist."""
    assert target_fingerprint("some-org/some-model") is None
    assert target_fingerprint(str(tmp_path / "missing")) is None
    assert isinstance(target_fingerprint("tiny-random"), str)


def test_a_richer_store_of_other_features_does_not_stand_in_for_the_runs_own(tmp_path, monkeypatch, capsys):
    """`make features` with `auto` said a built -final store of other layers "already holds these features" and built
    nothing; training then read it and stopped at the fit on its layers. A richer store stands in for the plain one
    only where it holds the features this run's build would write: its layers, target, adapter, dtype and data."""
    from training.feature_store import resolve_store_path

    monkeypatch.setattr(training.feature_store, "cache_dir", lambda: tmp_path / "ddtree-cache")
    data = write_conversations(tmp_path / "conversations.jsonl")
    features = ["--recipe", "tiny", f"--data.data_path={data}", f"--data.cache_dir={tmp_path / 'cache'}",
                "--data.feature_store=auto", "--data.max_length=128"]
    assert main([*features, "--model.distill_weight=0.5"]) == 0  # the recipe's -final store, of layers [1, 3, 4]
    capsys.readouterr()
    assert main([*features, "--model.target_layer_ids=[0,2]"]) == 0
    assert "nothing to do" not in capsys.readouterr().out
    datamodule = DistillDataModule(target="tiny-random", data_path=str(data), max_length=128,
                                   cache_dir=str(tmp_path / "cache"))
    plain = tmp_path / "ddtree-cache" / "features" / f"tiny-{datamodule.tokenization_key()}"
    final = FeatureStore(plain.with_name(plain.name + "-final"))
    assert FeatureStore(plain).layer_ids == [0, 2] and final.layer_ids == [1, 3, 4]

    shutil.rmtree(plain)
    other_dtype = torch.float32 if final.dtype == torch.bfloat16 else torch.bfloat16
    assert resolve_store_path("auto", "tiny", datamodule, layer_ids=[1, 3, 4], dtype=final.dtype) == final.path
    assert resolve_store_path("auto", "tiny", datamodule, layer_ids=[0, 2], dtype=final.dtype) == plain
    assert resolve_store_path("auto", "tiny", datamodule, layer_ids=[1, 3, 4], dtype=other_dtype) == plain


@pytest.mark.parametrize("family", ["gpt2", "gptj", "codegen"])
def test_a_target_whose_layers_are_decoder_h_gives_its_hidden_states_as_features(family):
    """GPT-2, GPT-J and CodeGen keep their layers in transformer.h: decoding read their hidden states, but training's
    feature hooks looked for decoder.layers only and refused them."""
    import transformers

    config = {"gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=2),
              "gptj": lambda: transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=3, n_head=2, rotary_dim=8),
              "codegen": lambda: transformers.CodeGenConfig(vocab_size=64, n_embd=64, n_layer=3, n_head=4,
                                                            rotary_dim=8)}[family]()
    torch.manual_seed(0)
    target = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    input_ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
    assert torch.allclose(target_layer_features(target, input_ids, [0, 1]), torch.cat(hidden[1:3], dim=-1), atol=1e-6)
    features, final = target_layer_features(target, input_ids, [0, 2], final_hidden=True)
    assert torch.allclose(features, torch.cat([hidden[1], hidden[3]], dim=-1), atol=1e-6)  # the last: normed output
    assert torch.allclose(final, hidden[3], atol=1e-6)
    # in the order the config lists them, as decoding's fuse_target_features reads them, not sorted
    assert torch.allclose(target_layer_features(target, input_ids, [1, 0]), fuse_target_features(hidden, [1, 0]),
                          atol=1e-6)


def test_a_target_whose_layers_are_neither_decoder_layers_nor_h_is_one_line():
    """MPT keeps them in transformer.blocks: the features' hooks failed with an AttributeError."""
    import transformers

    target = transformers.AutoModelForCausalLM.from_config(transformers.MptConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=2)).eval()
    with pytest.raises(DDTreeError, match=r"\(mpt\) keeps its decoder layers elsewhere than decoder.layers or decoder.h"):
        target_layer_features(target, torch.tensor([[1, 2, 3]]), [0, 1])


def test_a_store_serves_its_data_and_target_copied_to_another_place(tmp_path):
    """Data and target copied to a node's local disk (new paths, new mtimes) are the same data and target: the
    store built from the originals serves them; it was refused as built from other data. Edited data and other
    weights are still refused."""
    from safetensors.torch import load_file, save_file

    from ddtree.targets import tiny_target_folder

    target = tmp_path / "target"
    shutil.copytree(tiny_target_folder(), target)
    store = build_feature_store(make_datamodule(tmp_path, target=str(target)), tmp_path / "store", layer_ids=LAYER_IDS,
                                dtype=torch.float32)
    node = tmp_path / "node"
    node.mkdir()
    data = Path(shutil.copy(tmp_path / "conversations.jsonl", node / "conversations.jsonl"))
    os.utime(data, ns=(1, 1))
    shutil.copytree(target, node / "target")
    moved = make_datamodule(tmp_path, data_path=str(data), target=str(node / "target"), feature_store=str(store))
    moved.setup("fit")
    assert moved.store is not None and moved.store.path == store
    module = tiny_module(target=str(node / "target"), mask_token_id=16)
    module.check_feature_store(FeatureStore(store))

    weights = load_file(str(node / "target" / "model.safetensors"))  # another target at the copy's place
    save_file({name: value + 0.01 for name, value in weights.items()}, str(node / "target" / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(DDTreeError) as error:
        module.check_feature_store(FeatureStore(store))
    assert "holds features of target" in one_line(error.value)
    write_conversations(data, seed=5)  # other data at the copy's place
    with pytest.raises(DDTreeError) as error:
        make_datamodule(tmp_path, data_path=str(data), target=str(node / "target"), feature_store=str(store)).setup("fit")
    assert "built from other data" in one_line(error.value)


def test_a_build_from_data_target_and_adapter_copied_elsewhere_is_the_same_build(tmp_path, monkeypatch, capsys):
    """A build rescheduled on a node with its own copies of the data, the target and the adapter (other paths, the
    same files) resumes after the finished shards, and takes a finished store as done, as training takes it. The build
    compared the paths: it said "starting over" and deleted the finished shards, and refused the finished store as
    another build (whose --force rebuilt it)."""
    from peft import LoraConfig, get_peft_model

    from ddtree.targets import tiny_target_folder

    target, adapter, node = tmp_path / "target", tmp_path / "adapter", tmp_path / "node"
    shutil.copytree(tiny_target_folder(), target)
    torch.manual_seed(0)
    base, _ = load_target(str(target))
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)).save_pretrained(adapter)
    settings = dict(layer_ids=LAYER_IDS, max_shard_bytes=shard_bytes(3))
    original = make_datamodule(tmp_path, target=str(target))
    store = build_feature_store(original, tmp_path / "store", target_adapter=str(adapter), **settings)
    node.mkdir()
    shutil.copy(tmp_path / "conversations.jsonl", node / "conversations.jsonl")
    shutil.copytree(target, node / "target")
    shutil.copytree(adapter, node / "adapter")
    copied = make_datamodule(tmp_path, data_path=str(node / "conversations.jsonl"), target=str(node / "target"))
    capsys.readouterr()
    assert build_feature_store(copied, store, target_adapter=str(node / "adapter"), **settings) == store
    assert "already holds these features" in capsys.readouterr().out

    resumed = tmp_path / "resumed"
    interrupted_build(monkeypatch, original, resumed, target_adapter=str(adapter), **settings)
    first_shard = os.stat(partial_path(resumed) / "shard-00000.safetensors").st_ino
    build_feature_store(copied, resumed, target_adapter=str(node / "adapter"), **settings)
    assert "starting over" not in capsys.readouterr().out
    assert os.stat(resumed / "shard-00000.safetensors").st_ino == first_shard  # kept, not computed again
    for shard in FeatureStore(resumed).shards:
        assert same_shard(resumed / shard["file"], store / shard["file"]), shard["file"]


def test_a_store_keyed_by_an_earlier_tokenization_version_serves_where_its_ids_are_the_same(tmp_path, monkeypatch):
    """TOKENIZATION_VERSION 4 retired caches whose loss masks four fixes changed. A feature store keyed by version 3
    took hours to build on a large target, and its features depend on the input ids alone: it still serves where
    version 3's cached tokenization holds the same ids, masks or not. A top-k teacher, computed only where the mask
    supervises, needs the same masks too; other ids, or no version-3 cache left to show them, and it is refused."""
    import training.data
    from training.feature_store import resolve_store_path

    monkeypatch.setattr(training.feature_store, "cache_dir", lambda: tmp_path)
    with monkeypatch.context() as version_3:
        version_3.setattr(training.data, "TOKENIZATION_VERSION", 3)
        old_data = make_datamodule(tmp_path)
        old_key = old_data.tokenization_key()
        old_cache = old_data.cache_path(old_data.load_tokenizer())
        old_store = build_feature_store(old_data, tmp_path / "features" / f"tiny-{old_key}", layer_ids=LAYER_IDS,
                                        dtype=torch.float32)
    assert json.loads((old_store / "store.json").read_text())["tokenization_key"] == old_key

    datamodule = make_datamodule(tmp_path)
    current = datamodule.tokenization_key()
    assert current != old_key and datamodule.tokenization_keys() == (current, old_key)
    assert resolve_store_path("auto", "tiny", datamodule) == old_store  # found by `auto`, not built again
    assert build_feature_store(datamodule, old_store, layer_ids=LAYER_IDS, dtype=torch.float32) == old_store  # kept
    make_datamodule(tmp_path, feature_store=str(old_store)).setup("fit")  # accepted

    cached = torch.load(old_cache, weights_only=True)
    torch.save({**cached, "loss_mask": torch.ones_like(cached["loss_mask"])}, old_cache)  # version 3 masked otherwise
    datamodule = make_datamodule(tmp_path)
    assert datamodule.tokenization_keys() == (current, old_key)  # the features are the same
    assert datamodule.tokenization_keys(teacher=True) == (current,)  # a teacher's rows are not
    make_datamodule(tmp_path, feature_store=str(old_store)).setup("fit")
    # ...through setup too: a top-k store that version 3 built has teachers only where its masks supervised, and where
    # today's supervise more the loss took the label as the teacher, silently (mutation review, gap 3 / F17)
    with monkeypatch.context() as version_3:
        version_3.setattr(training.data, "TOKENIZATION_VERSION", 3)
        old_teacher = build_feature_store(make_datamodule(tmp_path), tmp_path / "features" / f"tiny-{old_key}-top4",
                                          layer_ids=LAYER_IDS, dtype=torch.float32, teacher_top_k=4)
    assert FeatureStore(old_teacher).tokenization_key == old_key
    with pytest.raises(DDTreeError) as refused:
        make_datamodule(tmp_path, feature_store=str(old_teacher)).setup("fit")
    assert "an earlier version's tokenization of it" in one_line(refused.value)
    # ...nor found by `auto`: a top-k recipe builds its own at today's key. Found by the ids alone, `make features`
    # refused it as another build and training stopped on it, and no test said so (mutation review 16, m22)
    assert resolve_store_path("auto", "tiny", datamodule, teacher_top_k=4).name == f"tiny-{current}-top4"

    other_ids = cached["input_ids"].clone()
    other_ids[0] += 1
    torch.save({**cached, "input_ids": other_ids}, old_cache)  # version 3 tokenized otherwise

    def refused():
        datamodule = make_datamodule(tmp_path)
        assert datamodule.tokenization_keys() == (current,)
        assert resolve_store_path("auto", "tiny", datamodule).name == f"tiny-{current}"
        with pytest.raises(DDTreeError, match="an earlier version's tokenization of it"):
            make_datamodule(tmp_path, feature_store=str(old_store)).setup("fit")

    refused()
    old_cache.unlink()  # nothing left to show the ids are the same
    refused()


def test_a_store_keyed_as_before_content_keys_still_serves(tmp_path, monkeypatch):
    """A store built when the key named the data by path and mtimes (before 2026-12-03, TOKENIZATION_VERSION 3), under
    that key's folder, is found by `auto` and accepted where the data has not moved and version 3's tokenization of
    it, cached then under that key, holds the same ids: it took hours to build on a large target. So is an unfinished
    build of one, which resumes."""
    from training.feature_store import resolve_store_path

    monkeypatch.setattr(training.feature_store, "cache_dir", lambda: tmp_path)
    datamodule = make_datamodule(tmp_path)
    datamodule.prepare_data()
    tokenizer = datamodule.load_tokenizer()
    legacy_cache = datamodule.cache_path(tokenizer, legacy=True, version=3)
    shutil.copyfile(datamodule.cache_path(tokenizer), legacy_cache)  # what version 3 wrote then: the same tokenization
    datamodule = make_datamodule(tmp_path)
    current, legacy = datamodule.tokenization_keys()
    assert current != legacy == legacy_cache.stem
    assert resolve_store_path("auto", "tiny", datamodule).name == f"tiny-{current}"  # none built: the current name
    old = tmp_path / "features" / f"tiny-{legacy}"
    build_feature_store(datamodule, old, layer_ids=LAYER_IDS, dtype=torch.float32)
    manifest = json.loads((old / "store.json").read_text())
    manifest["tokenization_key"] = legacy  # what a build then recorded
    (old / "store.json").write_text(json.dumps(manifest))
    assert resolve_store_path("auto", "tiny", datamodule) == old
    make_datamodule(tmp_path, feature_store=str(old)).setup("fit")  # accepted
    assert build_feature_store(datamodule, old, layer_ids=LAYER_IDS, dtype=torch.float32) == old  # the same build: kept

    # An unfinished build of then resumes with its finished shards, not from zero beside them
    old.rename(partial_path(old))
    shards = {path.name: path.stat().st_mtime_ns for path in partial_path(old).glob("shard-*")}
    assert resolve_store_path("auto", "tiny", datamodule) == old
    build_feature_store(datamodule, old, layer_ids=LAYER_IDS, dtype=torch.float32)
    assert {path.name: path.stat().st_mtime_ns for path in old.glob("shard-*")} == shards
    make_datamodule(tmp_path, feature_store=str(old)).setup("fit")


def test_a_time_boxed_stores_coverage_counts_its_sequences_not_their_tokens():
    """The line a build ends with says how much of the data a boxed store holds: counted in tokens it would read
    "60 of 5 sequences", and a whole store whose tokens differ from its sequence count would read as time-boxed."""
    shards = [{"num_sequences": 2, "num_tokens": 30}, {"num_sequences": 1, "num_tokens": 30}]
    assert coverage({"shards": shards, "lengths": [10] * 5}) == "3 of 5 sequences (time-boxed)"
    assert coverage({"shards": shards, "lengths": [20] * 3}) == "3 sequences"
