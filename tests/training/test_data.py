"""Tests of training/data.py: the tokenized cache, right-padded batches, the sampler, exact resume.

    .venv/bin/pytest -q tests/training/test_data.py
"""

import json
import os
import signal
import stat
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from ddtree.errors import DDTreeError
from training.data import (DistillDataModule, EpochShuffleSampler, ResumableDataLoader, TokenizedConversations,
                           collate, legacy_source_fingerprint, rank_share, source_fingerprint, tokenizer_fingerprint)
from training.module import DistillModule


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ----------------------------------------------------------------------------- DataModule

def conversation_file(path, count):
    lines = []
    for i in range(count):
        answer = f"Answer number {i}: " + "the quick brown fox jumps over the lazy dog. " * (1 + i % 3)
        lines.append(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                                             {"role": "assistant", "content": answer}]}))
    return write_lines(path, lines)


def make_datamodule(tmp_path, count=24, **overrides):
    path = tmp_path / "conv.jsonl"
    if not path.exists():  # rewriting it would change its fingerprint and so the cache entry
        conversation_file(path, count)
    kwargs = dict(target="smollm2-135m", data_path=str(path),
                  max_length=64, batch_size=4, val_fraction=0.25, seed=1, min_supervised_tokens=8,
                  cache_dir=str(tmp_path / "cache"))
    kwargs.update(overrides)
    return DistillDataModule(**kwargs)


def test_datamodule_batches_are_right_padded_and_typed(tmp_path):
    dm = make_datamodule(tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (18, 6)
    loader = dm.train_dataloader()
    batch = next(iter(loader))
    assert set(batch) == {"input_ids", "loss_mask", "attention_mask"}
    assert batch["input_ids"].dtype == torch.long and batch["loss_mask"].dtype == torch.bool
    assert batch["attention_mask"].dtype == torch.bool and batch["input_ids"].shape == batch["loss_mask"].shape
    # Each row's length from its example, not from the mask under test (an all-True mask would attend the padding)
    examples = [dm.train_set[i] for i in list(loader.sampler)[:4]]
    lengths = [len(example["input_ids"]) for example in examples]
    assert len(set(lengths)) > 1  # some row is padded
    for row, n in enumerate(lengths):
        assert torch.equal(batch["input_ids"][row, :n], examples[row]["input_ids"])
        assert batch["attention_mask"][row, :n].all() and not batch["attention_mask"][row, n:].any()  # right padding
        assert (batch["input_ids"][row, n:] == dm.pad_id).all()
    assert not (batch["loss_mask"] & ~batch["attention_mask"]).any()
    assert batch["loss_mask"].sum(-1).min() >= 8 and batch["input_ids"].shape[1] <= 64
    # The split is disjoint and covers everything.
    assert not set(dm.train_set.indices) & set(dm.val_set.indices)


def test_what_tokenization_dropped_is_warned_once_and_recorded_for_data_json(tmp_path, caplog):
    """A run said only how many conversations were truncated (which reads as kept), and its data.json gave the kept
    count alone: half of a user's data could be dropped with nothing in the run saying so or why."""
    path = conversation_file(tmp_path / "conv.jsonl", 6)
    with path.open("a") as file:  # a prompt without a reply, and a reply under min_supervised_tokens
        file.write(json.dumps({"messages": [{"role": "user", "content": "Hello?"}]}) + "\n")
        file.write(json.dumps({"messages": [{"role": "user", "content": "Hi?"},
                                            {"role": "assistant", "content": "Hi."}]}) + "\n")
    with caplog.at_level("WARNING"):
        dm = make_datamodule(tmp_path)
        dm.setup("fit")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == (f"{path}: kept 6 of 8 conversations; dropped 1 with no assistant turn, 1 with fewer than 8 "
                       "supervised tokens within max_length 64; 2 kept were cut to max_length 64; raise "
                       "data.max_length or lower data.min_supervised_tokens to keep more")
    counts = {"conversations": 8, "no_assistant": 1, "unaligned": 0, "too_few_supervised": 1, "reply_truncated": 0,
              "truncated": 2, "kept": 6}
    # the 6 kept, split 4 train / 2 val (val_fraction 0.25): a record naming another split's count misreads the run
    assert dm.record() == {"train_sequences": 4, "train_split_sequences": 4, "val_sequences": 2, "feature_store": None,
                           "tokenization": counts}
    caplog.clear()
    with caplog.at_level("WARNING"):  # a launch from the cache: said once already, recorded all the same
        cached = make_datamodule(tmp_path)
        cached.setup("fit")
    assert not caplog.records and cached.record()["tokenization"] == counts


def test_tokenized_conversations_keep_each_sequences_tokens_mask_and_length():
    """The flat layout's offsets are what every item, and the lengths a feature store is planned and checked by, read."""
    data = TokenizedConversations.from_examples([{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
                                                 {"input_ids": [4, 5], "loss_mask": [1, 0]}])
    assert len(data) == 2 and data.lengths() == [3, 2]
    assert data[1]["input_ids"].tolist() == [4, 5] and data[1]["loss_mask"].tolist() == [True, False]


@pytest.mark.parametrize("field, value, said", [
    ("batch_size", 0, "data.batch_size=0: give at least 1 sequence a batch (on each process)"),
    ("max_length", 1, "data.max_length=1: give at least 2 tokens a sequence"),
    ("val_fraction", 1.0, "data.val_fraction=1.0: give the share of the data held out for validation, at least 0 and "
                          "below 1"),
])
def test_a_bad_size_names_its_field(field, value, said):
    """--data.batch_size=0 said "max_length (256) must be >= 2 and batch_size (0) >= 1", naming no field to change."""
    with pytest.raises(DDTreeError) as refused:
        DistillDataModule(target="tiny-random", data_path="unused.jsonl", **{field: value})
    assert str(refused.value) == said


def test_a_small_val_fraction_still_holds_out_one_sequence(tmp_path):
    """val_fraction=0.01 of 24 sequences rounds to none: a positive fraction asks for validation, and a run without a
    validation split has no val/loss to show or select a checkpoint by."""
    dm = make_datamodule(tmp_path, val_fraction=0.01)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (23, 1)


def test_a_zero_val_fraction_holds_out_nothing(tmp_path):
    """data.val_fraction=0 asks for no validation split: every sequence is one to train on, none held out for a
    val/loss that no evaluation then reads."""
    dm = make_datamodule(tmp_path, val_fraction=0)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (24, 0)


def test_datamodule_caches_tokenization(tmp_path, monkeypatch):
    make_datamodule(tmp_path).prepare_data()
    import training.data as data_module

    def must_not_run(source):
        raise AssertionError("tokenized again despite the cache")

    monkeypatch.setattr(data_module, "load_conversations", must_not_run)
    dm = make_datamodule(tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 18
    with pytest.raises(AssertionError, match="tokenized again"):  # a different max_length is another cache entry
        make_datamodule(tmp_path, max_length=65).prepare_data()
    stricter = make_datamodule(tmp_path, min_supervised_tokens=20)  # so is another min_supervised_tokens: reusing
    with pytest.raises(AssertionError, match="tokenized again"):  # the cache would train on what it drops
        stricter.prepare_data()
    monkeypatch.undo()
    data, _, key = stricter.load_tokenized()
    assert key != dm.load_tokenized()[2]
    supervised = [int(data[i]["loss_mask"].sum()) for i in range(len(data))]
    assert len(supervised) == 16 and min(supervised) >= 20  # of 24: the 8 of 17 or 18 supervised tokens dropped



@pytest.mark.parametrize("given", [False, True])
def test_a_read_only_tokenized_cache_is_one_line_naming_its_setting_before_the_tokenization(tmp_path, empty_cache,
                                                                                          monkeypatch, given):
    """A read-only mount as DDTREE_CACHE: the error came from the write, after the whole tokenization, and named no
    setting to change."""
    import training.data as data_module

    cache = tmp_path / "mine" if given else empty_cache / "tokenized"
    dm = make_datamodule(tmp_path, cache_dir=str(cache) if given else None)
    real_access = os.access  # root writes through a chmod: say the folder is read-only (as a read-only mount is)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != cache and real_access(path, mode, **kw))
    monkeypatch.setattr(data_module, "tokenize_conversations", lambda *a, **k: pytest.fail("tokenized first"))
    with pytest.raises(DDTreeError) as error:
        dm.prepare_data()
    setting = ("set data.cache_dir to a writable folder" if given else
               f"set DDTREE_CACHE to a writable folder (it is {empty_cache}; the tokenized cache is its tokenized/), "
               "or data.cache_dir")
    assert str(error.value) == f"cannot write the tokenized cache {cache} (the folder is not writable): {setting}"

def test_a_template_whose_end_of_turn_token_decoding_does_not_stop_at_is_warned_of_every_launch(tmp_path, caplog):
    """A base model's ChatML template beside eos <|endoftext|>: training supervised <|im_end|> at every reply's end,
    a token decoding never stops at, and nothing said so."""
    import shutil

    from ddtree.targets import builtin_target_folder

    target = tmp_path / "base"
    shutil.copytree(builtin_target_folder("smollm2-135m"), target, ignore=shutil.ignore_patterns("*.safetensors"))
    for name in ("config.json", "generation_config.json"):
        config = json.loads((target / name).read_text())
        (target / name).write_text(json.dumps({**config, "eos_token_id": 0}))
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "<|endoftext|>"}))
    for launch in range(2):  # the second reads the cached tokenization, and is warned too
        caplog.clear()
        with caplog.at_level("WARNING", logger="training.data"):
            make_datamodule(tmp_path, target=str(target)).prepare_data()
        warned = [r.getMessage() for r in caplog.records if "decoding stops at" in r.getMessage()]
        assert len(warned) == 1 and "ends a reply with '<|im_end|>' (id 2)" in warned[0], launch
        assert "decoding stops at 0 '<|endoftext|>'" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="training.data"):  # the shipped target: <|im_end|> is its eos
        make_datamodule(tmp_path).prepare_data()
    assert not [r for r in caplog.records if "decoding stops at" in r.getMessage()]


def tokenizer_copy(folder: Path) -> Path:
    """The built-in target's folder copied to `folder` without its weights: its configs and tokenizer, to edit."""
    import shutil

    from ddtree.targets import builtin_target_folder

    shutil.copytree(builtin_target_folder("smollm2-135m"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    return folder


def test_a_target_whose_decoding_stops_at_no_token_is_warned_of_its_end_of_turn(tmp_path, caplog):
    """No eos anywhere (config, generation config, tokenizer): decoding stops at no token, so the end of turn that
    training supervises is none of them either, and is warned of as where decoding stops elsewhere."""
    target = tokenizer_copy(tmp_path / "no-eos")
    for name in ("config.json", "generation_config.json"):
        config = json.loads((target / name).read_text())
        (target / name).write_text(json.dumps({**config, "eos_token_id": None}))
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": None}))
    with caplog.at_level("WARNING", logger="training.data"):
        make_datamodule(tmp_path, target=str(target)).prepare_data()
    warned = [r.getMessage() for r in caplog.records if "decoding stops at" in r.getMessage()]
    assert len(warned) == 1 and "ends a reply with '<|im_end|>' (id 2)" in warned[0]
    assert "decoding stops at none:" in warned[0]


def test_a_target_without_a_chat_template_is_one_line_naming_it(tmp_path):
    """A base model's folder: `python -m training.train` ended in transformers' ValueError traceback."""
    import shutil

    from ddtree.targets import builtin_target_folder
    from training.conversations import CHAT_TARGET

    target = tmp_path / "base"
    shutil.copytree(builtin_target_folder("smollm2-135m"), target,
                    ignore=shutil.ignore_patterns("*.safetensors", "chat_template.jinja"))
    tokenizer_config = json.loads((target / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with pytest.raises(DDTreeError) as refused:
        make_datamodule(tmp_path, target=str(target)).prepare_data()
    assert str(refused.value) == f"{target}: the target's tokenizer has no chat template to apply; {CHAT_TARGET}"


def test_a_saved_dataset_with_a_truncated_arrow_file_is_one_line_naming_the_folder(tmp_path):
    import datasets

    folder = tmp_path / "saved"
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                         {"role": "assistant", "content": "An answer. " * 20}]} for i in range(20)]
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    [arrow] = folder.glob("*.arrow")
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])  # a copy cut off mid-way
    with pytest.raises(DDTreeError) as error:
        make_datamodule(tmp_path, data_path=str(folder)).prepare_data()
    message = str(error.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"data_path {folder}: a file of the saved `datasets` folder could not be read (")
    assert message.endswith("truncated or damaged? save the dataset again (save_to_disk)")


@pytest.mark.parametrize("damage", [lambda data: data[:len(data) // 2], lambda data: b"", lambda data: b"not a cache"])
def test_a_damaged_tokenized_cache_is_tokenized_again(tmp_path, caplog, damage):
    """It is only a cache: torch.load's traceback (a file cut short, a full disk) stopped every launch."""
    make_datamodule(tmp_path).prepare_data()
    [cache] = (tmp_path / "cache").glob("*.pt")
    intact = torch.load(cache, weights_only=True)
    cache.write_bytes(damage(cache.read_bytes()))
    dm = make_datamodule(tmp_path)
    dm.setup("fit")
    [said] = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert said.startswith(f"the tokenized cache {cache} is unreadable (") and len(said.splitlines()) == 1
    assert said.endswith("; tokenizing the data again")
    assert torch.equal(torch.load(cache, weights_only=True)["input_ids"], intact["input_ids"])
    assert (len(dm.train_set), len(dm.val_set)) == (18, 6)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_tokenized_cache_follows_the_umask_and_leaves_no_temp_file(tmp_path, umask, mode):
    # A cache on shared storage must be readable by the others the umask allows (a temp file is 0600).
    previous = os.umask(umask)
    try:
        dm = make_datamodule(tmp_path)
        dm.prepare_data()
    finally:
        os.umask(previous)
    cached = sorted((tmp_path / "cache").iterdir())
    assert [path.name for path in cached] == [f"{dm.tokenization_key()}.pt", "digests.json"]
    assert all(stat.S_IMODE(path.stat().st_mode) == mode for path in cached)


def test_a_target_whose_chat_template_changed_is_tokenized_again(tmp_path, monkeypatch):
    """The tokenizer's fingerprint is its vocabulary, merges and added tokens, which hold no chat template: a target
    whose template was updated (its tokenizer_config.json) renders, and so masks, its conversations otherwise, and
    must not reuse the cache tokenized under the old one."""
    dm = make_datamodule(tmp_path)
    key = dm.tokenization_key()
    tokenizer = dm.load_tokenizer()
    monkeypatch.setattr(tokenizer, "chat_template", tokenizer.chat_template + "{# updated #}")
    assert make_datamodule(tmp_path).tokenization_key() != key
    monkeypatch.undo()
    assert make_datamodule(tmp_path).tokenization_key() == key


def test_a_tokenizer_retrained_in_the_same_folder_is_tokenized_again(tmp_path):
    """The tokenizer is named by its serialized vocabulary, not its folder: one retrained in place, of the same size
    and chat template, gives the same text other ids, and must not reuse the cache tokenized with the old one."""
    target = tokenizer_copy(tmp_path / "target")
    key = make_datamodule(tmp_path, target=str(target)).tokenization_key()
    serialized = json.loads((target / "tokenizer.json").read_text())
    vocab = serialized["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # retrained: the same tokens, numbered otherwise
    (target / "tokenizer.json").write_text(json.dumps(serialized))
    assert make_datamodule(tmp_path, target=str(target)).tokenization_key() != key


def test_the_legacy_identity_of_data_names_its_resolved_path(tmp_path, monkeypatch):
    """Stores built before 2026-12-03 recorded the data's resolved path (through the tokenization key), so
    tokenization_keys finds them only if the path is resolved alike: the default data_path is a relative one."""
    conversation_file(tmp_path / "conv.jsonl", 2)
    monkeypatch.chdir(tmp_path)
    assert legacy_source_fingerprint("conv.jsonl") == legacy_source_fingerprint(str(tmp_path / "conv.jsonl"))


def test_an_earlier_tokenization_masked_otherwise_is_alike_in_ids_only(tmp_path):
    """A teacher's top-k rows were computed only where the loss mask supervises: an earlier version's cache with the
    same ids but other masks still serves plain features, but a teacher store built from it must not be taken."""
    dm = make_datamodule(tmp_path)
    data, _, _ = dm.load_tokenized()
    earlier = tmp_path / "cache" / "earlier.pt"
    torch.save({"input_ids": data.input_ids, "loss_mask": torch.ones_like(data.loss_mask), "offsets": data.offsets},
               earlier)
    assert dm.tokenized_alike(earlier, masks=False) and not dm.tokenized_alike(earlier, masks=True)


@pytest.mark.parametrize("damage", [b"", b"not a torch file"])
def test_an_earlier_tokenization_that_cannot_be_read_is_alike_in_nothing(tmp_path, damage):
    """An earlier version's cache cut off or damaged is no key of a feature store, not a crash of every launch."""
    dm = make_datamodule(tmp_path)
    earlier = tmp_path / "cache" / "earlier.pt"
    earlier.parent.mkdir(parents=True, exist_ok=True)
    earlier.write_bytes(damage)
    assert not dm.tokenized_alike(earlier, masks=False) and not dm.tokenized_alike(earlier, masks=True)


def test_data_path_auto_outside_training_is_one_line_naming_what_to_do(tmp_path):
    """"auto" is resolved by training.train from the recipe's name: a datamodule built from it elsewhere (a script,
    a notebook) cannot know the folder, and says so rather than read a file called auto."""
    dm = make_datamodule(tmp_path, data_path="auto")
    with pytest.raises(DDTreeError) as refused:
        dm.load_tokenized()
    assert str(refused.value) == ('data.data_path "auto" names the recipe\'s generated data: train through '
                                  "training.train, or give the data's folder")


def test_every_earlier_tokenization_version_down_to_the_first_is_a_key_of_the_same_ids(tmp_path, monkeypatch):
    """tokenization_keys looks back to TOKENIZATION_VERSION 1: a feature store keyed by the first version's cache of
    the same ids serves as one of any later version does, rather than being built again for hours."""
    import training.data

    with monkeypatch.context() as version_1:
        version_1.setattr(training.data, "TOKENIZATION_VERSION", 1)
        first = make_datamodule(tmp_path)
        first.load_tokenized()  # its cache, which shows the ids are the same
        first_key = first.tokenization_key()
    datamodule = make_datamodule(tmp_path)
    assert datamodule.tokenization_keys() == (datamodule.tokenization_key(), first_key)


def test_the_tokenized_cache_is_named_by_the_data_content_not_its_place(tmp_path):
    """A copy on a node's disk, a moved folder or a fresh clone (new path, new mtime) was another cache entry, and a
    feature store built from the data refused it; an edit is another entry still. A file's digest is remembered by
    path, size and mtime: an unchanged file is not read again."""
    import shutil

    key = make_datamodule(tmp_path).tokenization_key()
    (tmp_path / "node").mkdir()
    copy = shutil.copy(tmp_path / "conv.jsonl", tmp_path / "node" / "conv.jsonl")
    os.utime(copy, ns=(1, 1))
    assert make_datamodule(tmp_path, data_path=copy).tokenization_key() == key

    folder = tmp_path / "saved"
    folder.mkdir()
    shutil.copy(copy, folder / "part.jsonl")
    in_folder = make_datamodule(tmp_path, data_path=str(folder)).tokenization_key()
    folder.rename(tmp_path / "moved")
    assert make_datamodule(tmp_path, data_path=str(tmp_path / "moved")).tokenization_key() == in_folder != key

    memo_path = tmp_path / "cache" / "digests.json"
    memo = json.loads(memo_path.read_text())
    memo[str(Path(copy).resolve())][2] = "0" * 64  # what a read would not give: the memo, not the file, answered
    memo_path.write_text(json.dumps(memo))
    assert make_datamodule(tmp_path, data_path=copy).tokenization_key() != key
    os.utime(copy, ns=(2, 2))  # its mtime changed: read again
    assert make_datamodule(tmp_path, data_path=copy).tokenization_key() == key
    memo_path.write_text("{cut short")  # a damaged memo only costs a read
    assert make_datamodule(tmp_path, data_path=copy).tokenization_key() == key

    with open(copy, "a") as handle:  # edited: another tokenization
        handle.write(json.dumps({"messages": [{"role": "user", "content": "one more?"},
                                              {"role": "assistant", "content": "yes, one more reply here."}]}) + "\n")
    assert make_datamodule(tmp_path, data_path=copy).tokenization_key() != key


def test_a_saved_dataset_dict_is_identified_by_the_files_in_its_split_folders(tmp_path):
    """save_to_disk of a DatasetDict keeps each split's rows in a subfolder (train/data-00000-of-00001.arrow): a
    fingerprint of the top-level files alone would give an edited split the key of the old one, and the tokenized
    cache and the feature store built from the old rows would serve the new."""
    saved = tmp_path / "saved"
    (saved / "train").mkdir(parents=True)
    (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
    rows = saved / "train" / "data-00000-of-00001.arrow"
    rows.write_bytes(b"rows before the edit")
    before = source_fingerprint(str(saved))
    rows.write_bytes(b"rows after the edit")
    assert source_fingerprint(str(saved)) != before
    edited = source_fingerprint(str(saved))
    (saved / "train").rename(saved / "test")  # the same rows under another split: another source
    assert source_fingerprint(str(saved)) != edited


@pytest.mark.parametrize("foreign", ["[]", '"digests"', "3"])
def test_a_digest_memo_holding_json_but_no_mapping_is_an_empty_one(tmp_path, foreign):
    """digests.json only spares reads: another tool's file or another format there must not stop every launch (read
    as a mapping, such a file stops it on an AttributeError)."""
    data = tmp_path / "conv.jsonl"
    conversation_file(data, 2)
    memo_path = tmp_path / "digests.json"
    memo_path.write_text(foreign)
    assert source_fingerprint(str(data), memo_path) == source_fingerprint(str(data))
    assert str(data.resolve()) in json.loads(memo_path.read_text())  # written again as this version's memo


def test_a_digest_memo_that_cannot_be_written_still_identifies_the_data(tmp_path):
    """digests.json only spares reads: a memo place that cannot be written (a read-only cache folder) must not stop
    the launch; the data is identified as it is without a memo, and read again next time."""
    data = tmp_path / "conv.jsonl"
    conversation_file(data, 2)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert source_fingerprint(str(data), blocked / "digests.json") == source_fingerprint(str(data))
    assert blocked.read_text() == "not a folder"


def test_a_hub_name_and_a_tokenizer_without_a_serialized_form_are_identified_by_their_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder of that name here
    assert source_fingerprint("someone/chats") == legacy_source_fingerprint("someone/chats") == "someone/chats"
    slow = SimpleNamespace(name_or_path="someone/slow-tokenizer")  # a slow tokenizer: no backend_tokenizer
    assert tokenizer_fingerprint(slow) == "someone/slow-tokenizer"


def test_a_cache_tokenized_before_the_last_mask_fixes_is_not_reused(tmp_path, monkeypatch):
    """Four loss-mask fixes (an opening assistant turn, a Llama-3 trimmed reply, Qwen3's think block, an unfinished
    Llama-2 reply) left TOKENIZATION_VERSION at 3: data tokenized before them kept its wrong mask in a cache every
    later launch reused, and so did the draft vocabulary and model.corpus built from it. A cache version 3 wrote
    (here one whose mask supervises everything) is not what today's launch trains on."""
    import training.data

    with monkeypatch.context() as old_code:
        old_code.setattr(training.data, "TOKENIZATION_VERSION", 3)
        dm = make_datamodule(tmp_path)
        dm.prepare_data()
        old = dm.cache_path(dm.load_tokenizer())
    cached = torch.load(old, weights_only=True)
    torch.save({**cached, "loss_mask": torch.ones_like(cached["loss_mask"])}, old)

    data, _, key = make_datamodule(tmp_path).load_tokenized()
    assert key != old.stem
    assert torch.equal(data.input_ids, cached["input_ids"])  # the same ids, tokenized again
    assert torch.equal(data.loss_mask, cached["loss_mask"]) and not data.loss_mask.all()


def test_a_resume_over_the_same_tokens_masked_otherwise_is_refused(tmp_path, monkeypatch):
    """The same conversations supervised otherwise (another version's masks) are other training data: without the
    masks in the data digest the resume trained on, under a position counted in the run's data."""
    run = make_datamodule(tmp_path)
    run.setup("fit")
    relaunch = make_datamodule(tmp_path)
    tokenized = relaunch.load_tokenized

    def masked_otherwise():
        data, pad_id, key = tokenized()
        data.loss_mask = data.loss_mask.clone()
        data.loss_mask[int(data.loss_mask.nonzero()[0])] = False  # one reply token no longer supervised
        return data, pad_id, key

    monkeypatch.setattr(relaunch, "load_tokenized", masked_otherwise)
    relaunch.setup("fit")
    with pytest.raises(DDTreeError, match="holds other conversations than the run trained on"):
        relaunch.load_state_dict(run.state_dict())


def test_sampler_shuffles_per_epoch_and_splits_ranks():
    sampler = EpochShuffleSampler(10, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(10)) and list(sampler) == first  # deterministic
    sampler.set_epoch(1)
    assert list(sampler) != first
    ranks = [list(EpochShuffleSampler(10, seed=3, rank=r, world_size=3)) for r in range(3)]
    assert [len(r) for r in ranks] == [4, 4, 4] and set(sum(ranks, [])) == set(range(10))
    for items, world in ((3, 8), (1, 4)):  # more ranks than twice the items: every rank still gets its share
        ranks = [list(EpochShuffleSampler(items, seed=3, rank=r, world_size=world)) for r in range(world)]
        assert [len(r) for r in ranks] == [len(EpochShuffleSampler(items, 3, 0, world))] * world == [1] * world
        assert set(sum(ranks, [])) == set(range(items))


def test_validation_shares_are_disjoint_and_equal_across_ranks(tmp_path):
    assert rank_share(7, 0, 1) == list(range(7))  # one process: everything, in order
    shares = [rank_share(7, r, 3) for r in range(3)]
    assert shares == [[0, 3], [1, 4], [2, 5]]  # same count on every rank, none twice; item 6 is left out
    assert [rank_share(2, r, 3) for r in range(3)] == [[0, 1]] * 3  # fewer items than ranks: all, on every rank
    dm = make_datamodule(tmp_path)
    dm.setup("fit")
    dm.trainer = SimpleNamespace(global_rank=1, world_size=2)
    assert len(dm.val_dataloader().dataset) == 3  # rank 1's half of the 6
    assert len(dm.val_dataloader(whole=True).dataset) == 6  # model.calibrate: the same replays on every rank


def loader_sequences(loader) -> list[tuple[int, ...]]:
    """Each sequence a loader yields, unpadded, in the order it yields them."""
    return [tuple(row[mask].tolist()) for batch in loader
            for row, mask in zip(batch["input_ids"], batch["attention_mask"])]


def test_validation_reads_its_split_in_the_same_order_on_every_pass(tmp_path):
    """Shuffled, each evaluation of one checkpoint drew other batches, so a limit_val_batches share measured other
    sequences each time and two evaluations of the same weights disagreed."""
    dm = make_datamodule(tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    in_order = [tuple(dm.val_set[i]["input_ids"].tolist()) for i in range(len(dm.val_set))]
    assert loader_sequences(dm.val_dataloader()) == in_order
    assert loader_sequences(dm.val_dataloader()) == in_order  # a second pass alike


def test_validation_draws_no_sequence_of_the_training_split(tmp_path):
    """A validation loss over sequences the drafter trained on says nothing of what it does on new ones."""
    dm = make_datamodule(tmp_path)
    dm.prepare_data()
    dm.setup("fit")
    trained = {tuple(dm.train_split[i]["input_ids"].tolist()) for i in range(len(dm.train_split))}
    validated = loader_sequences(dm.val_dataloader())
    assert len(validated) == 6 and not trained & set(validated)


def test_two_ranks_train_on_disjoint_halves_of_the_training_split(tmp_path):
    """Each rank's train loader draws its own share: built as rank 0 everywhere, two GPUs trained every step on the
    same batches and never saw the other half of the data, with nothing said."""
    dm = make_datamodule(tmp_path)
    dm.setup("fit")
    shares = []
    for rank in range(2):
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        shares.append(list(dm.train_dataloader().sampler))
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(len(dm.train_set)))


def test_the_training_order_follows_data_seed(tmp_path):
    """data.seed seeds the training loader's per-epoch shuffle as well as the split: two seeds draw the training split
    in two orders, one seed in the same order on every launch."""
    orders = {}
    for seed in (1, 2, 1):
        dm = make_datamodule(tmp_path, seed=seed)
        dm.setup("fit")
        order = list(dm.train_dataloader().sampler)  # positions in the training split
        assert orders.setdefault(seed, order) == order
    assert orders[1] != orders[2]


class RecordingValidation(DistillModule):
    """Writes each validation sequence's tokens to <prefix>-rank<r>.txt, one line each."""

    def __init__(self, prefix, **settings):
        super().__init__(**settings)
        self.prefix = str(prefix)

    def validation_step(self, batch, batch_idx):
        with open(f"{self.prefix}-rank{self.global_rank}.txt", "a") as f:
            f.write(" ".join(map(str, batch["input_ids"][batch["attention_mask"]].tolist())) + "\n")
        return super().validation_step(batch, batch_idx)


class NothingToCountOnRank0(RecordingValidation):
    """Rank 0's batches hold no block (as a rank whose every batch drew no anchor)."""

    def shared_step(self, batch, batch_idx, stage):
        return None if stage == "val" and self.global_rank == 0 else super().shared_step(batch, batch_idx, stage)


def _validate(tmp_path, devices: int, limit_val_batches: int, module_class=None) -> float:
    """val/loss of a random tiny drafter over the test data's validation split; each rank writes what it validated."""
    dm = make_datamodule(tmp_path, batch_size=1)  # one sequence a batch: no padding differs between the runs
    torch.manual_seed(0)  # the same drafter weights in both runs (every forked rank starts from this module)
    module = (module_class or RecordingValidation)(tmp_path / f"validated-{devices}", target="tiny-random", num_layers=1, block_size=4,
                                 target_layer_ids=[1, 3, 4], num_anchors=64, gamma=4.0,
                                 target_dtype="float32")  # 64 anchors: every reply token anchors a block
    # Forked ranks inherit the imported modules: ddp_spawn's ranks imported torch, Lightning and this file again,
    # 35 s against 11 s for this test on the 2-core EPYC.
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp_fork" if devices > 1 else "auto",
                        limit_val_batches=limit_val_batches, use_distributed_sampler=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    (metrics,) = trainer.validate(module, datamodule=dm, verbose=False)
    return metrics["val/loss"]


def test_two_ranks_validate_the_two_halves_of_what_one_process_validates(tmp_path, monkeypatch):
    """Each of 2 ranks validates 3 of the 6 validation sequences; their sums equal one process over all 6."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)  # ddp_fork sets some in this process: gone again after the test
    two_ranks = _validate(tmp_path, devices=2, limit_val_batches=3)
    assert two_ranks == pytest.approx(_validate(tmp_path, devices=1, limit_val_batches=6), rel=1e-5)
    read = lambda name: (tmp_path / name).read_text().splitlines()  # noqa: E731
    rank0, rank1, alone = read("validated-2-rank0.txt"), read("validated-2-rank1.txt"), read("validated-1-rank0.txt")
    assert len(rank0) == len(rank1) == 3 and len(alone) == 6 == len(set(alone))
    assert sorted(rank0 + rank1) == sorted(alone)  # disjoint halves of the whole split
    # A rank with nothing to count still joins the sums, and adds nothing to them: the loss is rank 1's, near
    # log(vocabulary) for random weights (the reduce once carried one sum into the next: a loss of 1.0).
    (tmp_path / "empty").mkdir()
    one_rank = _validate(tmp_path / "empty", devices=2, limit_val_batches=3, module_class=NothingToCountOnRank0)
    assert one_rank == pytest.approx(two_ranks, rel=1e-3) and one_rank != two_ranks


class RecordingModule(L.LightningModule):
    """Learns nothing useful; records which sequences each training step saw."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append([tuple(row[mask].tolist()) for row, mask in zip(batch["input_ids"], batch["attention_mask"])])
        return (self.weight * batch["loss_mask"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dm, tmp_path, ckpt_path=None, callbacks=()):
    module = RecordingModule()
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=bool(callbacks), callbacks=list(callbacks),
                        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    return module.seen


def test_train_loader_resumes_exactly_mid_epoch_at_its_end_and_twice(tmp_path):
    # 18 train sequences, batch 4 -> 5 batches per epoch; checkpoints after every step.
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1,
                                  filename="{step}")
    full = fit(make_datamodule(tmp_path), tmp_path, callbacks=[checkpoints])
    assert len(full) == 10 and full[:5] != full[5:]  # two epochs, reshuffled
    # Step 5 is epoch 0's last batch (a SIGTERM stop or an evaluation can land there): its saved position must not
    # carry into epoch 1, which would then train nothing.
    for step in (2, 5, 7):  # mid-epoch 0, the end of epoch 0, mid-epoch 1
        resumed = fit(make_datamodule(tmp_path), tmp_path, ckpt_path=str(tmp_path / "ckpt" / f"step={step}.ckpt"))
        assert resumed == full[step:], f"resume after step {step} did not continue where training stopped"
    # Interrupted twice (SLURM requeues, SIGTERM stops): the resumed run's own checkpoints count the batches it
    # skipped, so resuming its step 4 trains batch 4 next, not one it already trained.
    again = ModelCheckpoint(dirpath=tmp_path / "resumed", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit(make_datamodule(tmp_path), tmp_path, ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"), callbacks=[again])
    resumed = fit(make_datamodule(tmp_path), tmp_path, ckpt_path=str(tmp_path / "resumed" / "step=4.ckpt"))
    assert resumed == full[4:], "a second resume, from the resumed run's step 4, did not continue where it stopped"


def test_a_resume_under_another_batch_size_or_number_of_ranks_is_refused_and_older_states_still_load():
    data = list(range(20))
    loader = ResumableDataLoader(data, EpochShuffleSampler(20, seed=0), batch_size=2)
    seen = [item for _, batch in zip(range(3), loader) for item in batch.tolist()]
    state = loader.state_dict()
    # Counted in batches of 2, the position read with batches of 4 would skip 6 items never trained on.
    with pytest.raises(DDTreeError, match=r"data.batch_size=2, this run has 4: resume with data.batch_size=2"):
        ResumableDataLoader(data, EpochShuffleSampler(20, seed=0), batch_size=4).load_state_dict(state)
    # Counted per rank, the position read on 2 ranks would skip 4 of the 20 items, never trained on.
    with pytest.raises(DDTreeError, match=r"20 sequences on 1 ranks, this run has 20 on 2: resume with the same data"):
        ResumableDataLoader(data, EpochShuffleSampler(20, 0, rank=0, world_size=2), batch_size=2).load_state_dict(state)
    older = {key: value for key, value in state.items() if key != "batch_size"}  # saved before the key existed
    for saved in (state, older):
        resumed = ResumableDataLoader(data, EpochShuffleSampler(20, seed=0), batch_size=2)
        resumed.load_state_dict(saved)
        assert sorted(seen + [item for batch in resumed for item in batch.tolist()]) == data


def test_a_resume_from_another_store_share_on_another_number_of_ranks_names_the_devices():
    """A loader of a time-boxed store's share resumed on other ranks with another share: the rank count alone already
    moves every position, so the line names the data and devices, not a store to put back that would not suffice."""
    saved = ResumableDataLoader(list(range(20)), EpochShuffleSampler(20, seed=0), ("store", 30), batch_size=2)
    resumed = ResumableDataLoader(list(range(16)), EpochShuffleSampler(16, 0, rank=0, world_size=2), ("store", 30),
                                  batch_size=2)
    with pytest.raises(DDTreeError, match=r"20 sequences on 1 ranks, this run has 16 on 2: resume with the same data"):
        resumed.load_state_dict(saved.state_dict())


class SigtermMidItem(torch.utils.data.Dataset):
    """Four one-token sequences whose loader worker is sent SIGTERM as it reads each, as `timeout`, SLURM or scancel
    send it to the whole process group while a batch is being read."""

    def __init__(self):
        self.main = os.getpid()

    def __len__(self):
        return 4

    def __getitem__(self, index):
        if os.getpid() != self.main:  # (never the test's own process)
            os.kill(os.getpid(), signal.SIGTERM)
        return {"input_ids": torch.tensor([index]), "loss_mask": torch.tensor([True])}


def test_a_loader_worker_sent_sigterm_mid_batch_finishes_it(tmp_path):
    """A worker that ended at the group's SIGTERM crashed the main process ("DataLoader worker (pid N) is killed by
    signal") before it could save the step; the stop is the main process's, at a step boundary."""
    dm = make_datamodule(tmp_path, num_workers=1)
    dm.train_set = dm.val_set = SigtermMidItem()
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        read = [token for batch in loader for token in batch["input_ids"].flatten().tolist()]
        assert sorted(read) == [0, 1, 2, 3]


def test_a_loader_state_saved_before_its_first_batch_resumes_at_the_first():
    """A checkpoint written before the loader yielded anything holds no position: resumed, it trains the whole epoch,
    skipping none of it."""
    data = list(range(20))
    state = ResumableDataLoader(data, EpochShuffleSampler(20, seed=0), batch_size=2).state_dict()
    resumed = ResumableDataLoader(data, EpochShuffleSampler(20, seed=0), batch_size=2)
    resumed.load_state_dict(state)
    assert sorted(item for batch in resumed for item in batch.tolist()) == data


def test_a_resumed_loader_saved_again_before_its_first_batch_keeps_the_position():
    """The loader's state can be saved after a resume and before it draws a batch (a checkpoint written at the
    resumed step): it must still hold the position it resumed from, not the epoch's start, or the next resume would
    train the epoch's first batches again."""
    data = list(range(20))
    loader = ResumableDataLoader(data, EpochShuffleSampler(20, seed=0), batch_size=2)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    resumed = ResumableDataLoader(data, EpochShuffleSampler(20, seed=0), batch_size=2)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["batches_yielded"] == 3


def test_ranks_take_every_world_th_position_of_the_one_process_order_wrapped_to_equal_shares():
    """Rank r of w takes positions r, r + w, ... of the epoch's permutation, the permutation wrapped round so every
    rank has as many: 10 items on 3 ranks are positions 0..11, positions 10 and 11 the permutation's first two."""
    order = list(EpochShuffleSampler(10, seed=3))  # one process: the whole permutation
    wrapped = order + order[:2]
    ranks = [list(EpochShuffleSampler(10, seed=3, rank=r, world_size=3)) for r in range(3)]
    assert ranks == [[wrapped[0], wrapped[3], wrapped[6], wrapped[9]], [wrapped[1], wrapped[4], wrapped[7], order[0]],
                     [wrapped[2], wrapped[5], wrapped[8], order[1]]]


def test_a_samplers_start_skips_its_items_on_the_next_pass_only():
    """A resume's position is for the pass it resumes: a second pass over the same epoch draws everything again."""
    sampler = EpochShuffleSampler(10, seed=3)
    whole = list(sampler)
    sampler.start = 4
    assert list(sampler) == whole[4:]
    assert list(sampler) == whole


def test_seed_and_epoch_do_not_trade_places_in_the_shuffle():
    """Seed 1's first epoch is not seed 0's second (nor seed 0's first seed 1's second): two runs of neighbouring
    seeds would otherwise draw the same batches one epoch apart."""
    def order(seed, epoch):
        sampler = EpochShuffleSampler(10, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(1, 0) != order(0, 1) and order(0, 0) != order(1, 1)


def test_validation_shares_of_fewer_than_two_items_a_rank_are_one_item_each():
    """With at least as many items as ranks every rank validates its own: 4 items on 3 ranks are one each (item 3
    left out), not all 4 on every rank, which counts each item three times."""
    assert [rank_share(4, r, 3) for r in range(3)] == [[0], [1], [2]]
    assert [rank_share(3, r, 3) for r in range(3)] == [[0], [1], [2]]


def test_a_single_data_file_is_identified_by_its_content_not_its_name(tmp_path):
    """A file renamed (or copied under another name) holds the same conversations: its tokenized cache and feature
    store serve it still; inside a folder, a file's name is part of the folder's content."""
    first = conversation_file(tmp_path / "conv.jsonl", 2)
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_bytes(first.read_bytes())
    assert source_fingerprint(str(renamed)) == source_fingerprint(str(first))
    for name, folder in (("conv.jsonl", "a"), ("renamed.jsonl", "b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / name).write_bytes(first.read_bytes())
    assert source_fingerprint(str(tmp_path / "a")) != source_fingerprint(str(tmp_path / "b"))


def test_collate_keeps_each_rows_tokens_mask_and_features_in_place_and_pads_after_them():
    """Row by row, position by position: a mask one place off would train every reply token as the one before it."""
    features = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)  # (T, K*H) in the store's dtype
    examples = [{"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([False, True, True]),
                 "features": features},
                {"input_ids": torch.tensor([8]), "loss_mask": torch.tensor([True]), "features": features[:1]}]
    batch = collate(examples, pad_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]
    assert batch["attention_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert batch["features"].dtype == torch.bfloat16
    assert batch["features"].tolist() == [[[0, 1], [2, 3], [4, 5]], [[0, 1], [0, 0], [0, 0]]]
