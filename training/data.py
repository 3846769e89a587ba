"""Training batches: tokenized conversations -> a cached flat tensor -> right-padded, resumable batches.

    from training.data import DistillDataModule
    dm = DistillDataModule(target="smollm2-135m", data_path="data/smollm2-135m", max_length=2048, batch_size=4)
    trainer.fit(module, datamodule=dm)   # Trainer(use_distributed_sampler=False): see ResumableDataLoader

This module owns the torch side of the data; reading files and the chat-template loss mask are
training/conversations.py. Pieces, top to bottom:
  - TokenizedConversations: every sequence in one flat tensor plus offsets (the cache's layout);
    collate / Collator: right-padded batches {input_ids (B,T) long, loss_mask (B,T) bool,
    attention_mask (B,T) bool}, plus features (B,T,K*H) read from an offline feature store when
    one is given (training/feature_store.py).
  - EpochShuffleSampler / ResumableDataLoader: the train loader that resumes exactly mid-epoch.
    They stay here rather than in a module of their own: they serve only this DataModule's train
    loader, and their contract (Lightning saves the loader's state) reads best next to it.
  - DistillDataModule: tokenizes once into a cache file named by the data, tokenizer and settings
    (prepare_data), loads it on every rank (setup), splits train/val with the seed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import signal
import weakref
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from ddtree.errors import DDTreeError, error_line
from ddtree.files import WriteFailed, atomic_file, why_unwritable, write_text_atomic
from training.conversations import TOKENIZATION_VERSION, end_of_turn_text, load_conversations, tokenize_conversations
from training.feature_store import AUTO_STORE, FeatureStore
from training.recipe_data import AUTO_DATA, check_regenerate_settings

log = logging.getLogger(__name__)
DIGEST_MEMO = "digests.json"  # <tokenized cache>/digests.json: data files' SHA-256 by path, size and mtime
DATA_RECORD = "data.json"  # <run>/data.json: the sequences a run drew from (DistillDataModule.record; make ablate reads it)


# ----------------------------------------------------------------------------- batches

class TokenizedConversations(Dataset):
    """Tokenized conversations kept as one flat tensor plus offsets (cheap to save, load and slice).

    With `features` set (an offline store built from exactly these sequences, in this order) each
    item also carries its sequence's target features.
    """

    def __init__(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor):
        self.input_ids, self.loss_mask, self.offsets = input_ids, loss_mask, offsets  # (N_tokens,), (N_tokens,), (N+1,)
        self.features: FeatureStore | None = None

    @classmethod
    def from_examples(cls, examples: list[dict]) -> "TokenizedConversations":
        lengths = torch.tensor([len(e["input_ids"]) for e in examples])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        input_ids = torch.tensor([t for e in examples for t in e["input_ids"]], dtype=torch.int32)
        loss_mask = torch.tensor([m for e in examples for m in e["loss_mask"]], dtype=torch.bool)
        return cls(input_ids, loss_mask, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def digest(self) -> str:
        """These sequences' tokens and reply masks, hashed: the same data wherever its file lies (or was touched)."""
        digest = hashlib.sha256()
        for tensor in (self.offsets, self.input_ids, self.loss_mask):
            digest.update(tensor.contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, end = self.offsets[index].item(), self.offsets[index + 1].item()
        item = {"input_ids": self.input_ids[start:end].long(), "loss_mask": self.loss_mask[start:end]}
        if self.features is not None:
            item["features"] = self.features[index]  # (T_i, K*H)
            if self.features.final_hidden:
                item["final_hidden"] = self.features.final(index)  # (T_i, H)
            if self.features.teacher_top_k:
                item["teacher_ids"], item["teacher_log_probs"] = self.features.teacher(index)  # (T_i, k) each
        return item


def replies(split: Subset) -> list[list[int]]:
    """The supervised (reply) token runs of `split`, a Subset of TokenizedConversations, one list per assistant turn:
    what the corpus lookup indexes (model.corpus; ddtree/corpus.py)."""
    data, runs = split.dataset, []
    for i in split.indices:
        ids = data.input_ids[data.offsets[i]:data.offsets[i + 1]].tolist()
        mask = data.loss_mask[data.offsets[i]:data.offsets[i + 1]].tolist()
        for position, supervised in enumerate(mask):
            if supervised and (position == 0 or not mask[position - 1]):
                runs.append([])
            if supervised:
                runs[-1].append(ids[position])
    return runs


def reply_vocabulary(split: Subset, size: int, vocab_size: int) -> list[int]:
    """`size` token ids, ascending: the supervised (reply) tokens of `split` by frequency (a tie goes to the
    lower id), then, if fewer were seen, the lowest ids not yet in.

    split: a Subset of TokenizedConversations (a DistillDataModule's train_split). The drafter's draft
    vocabulary (model.draft_vocab_size): every label it learns from is a reply token. Held-out replies
    use tokens the training replies never did (on the default data's 40 evaluation prompts, 7.5% of
    the reply tokens), and a BPE tokenizer numbers its tokens in merge order, so low ids are the
    pieces frequent in its own corpus: they fill the rest (there, 16384 tokens cover 96.7%).
    """
    data = split.dataset
    tokens = torch.cat([
        data.input_ids[data.offsets[i]:data.offsets[i + 1]][data.loss_mask[data.offsets[i]:data.offsets[i + 1]]]
        for i in split.indices
    ])
    counts = torch.bincount(tokens.long(), minlength=vocab_size)  # (V,)
    by_count = torch.sort(-counts, stable=True).indices  # most frequent first, lower id first among equals
    seen = by_count[counts[by_count] > 0][:size]
    unseen = (counts == 0).nonzero().flatten()[: size - seen.shape[0]]  # ascending ids
    return sorted(torch.cat([seen, unseen]).tolist())


def collate(examples: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence: input_ids (B,T) long, loss_mask/attention_mask (B,T) bool.

    Items with features (an offline store) give features (B,T,K*H) in the store's dtype, zero-padded,
    and final_hidden (B,T,H), teacher_ids and teacher_log_probs (B,T,k) alike when the store holds them.
    """
    width = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), width), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((len(examples), width), dtype=torch.bool),
        "attention_mask": torch.zeros((len(examples), width), dtype=torch.bool),
    }
    stored = [name for name in ("features", "final_hidden", "teacher_ids", "teacher_log_probs") if name in examples[0]]
    for name in stored:
        first = examples[0][name]
        batch[name] = torch.zeros((len(examples), width, first.shape[-1]), dtype=first.dtype)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        batch["input_ids"][row, :n] = example["input_ids"]
        batch["loss_mask"][row, :n] = example["loss_mask"]
        batch["attention_mask"][row, :n] = True
        for name in stored:
            batch[name][row, :n] = example[name]
    return batch


def ignore_sigterm(worker_id: int) -> None:
    """worker_init_fn of both loaders: a worker ignores SIGTERM, whose stop is the main process's (where a step ends,
    saved: training.callbacks.SigtermAtStepBoundary). torch's worker ended at a SIGTERM sent to the whole process group
    (`timeout`, SLURM, scancel), and the main process then crashed with "DataLoader worker (pid N) is killed by signal"
    before it could save the step (found in a review, 2026-12-04). A worker still ends: the main process shuts it down
    as the loader is done, and torch's watchdog ends it if the main process dies. (Runs after torch's own handler is
    installed, which it replaces.)"""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class Collator:
    """Picklable collate_fn (worker processes need to pickle it)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, examples):
        return collate(examples, self.pad_id)


def rank_share(num_items: int, rank: int, world_size: int) -> list[int]:
    """The items rank `rank` of `world_size` validates: r, r + world, ... of the first whole multiple of world_size
    items, so every rank runs the same number of batches and none is counted twice (up to world_size - 1 are
    left out). With fewer items than ranks, every rank takes them all: each then counts them once, in the same
    proportions. One process takes everything in order."""
    per_rank = num_items // world_size
    if per_rank == 0:
        return list(range(num_items))
    return list(range(rank, per_rank * world_size, world_size))


class EpochShuffleSampler(Sampler[int]):
    """A fresh seeded permutation each epoch, split across ranks, able to start part-way.

    Rank r takes positions r, r + world, ... of the epoch's permutation (padded by wrapping so
    every rank has the same count). `start` skips that many of this rank's items on the next
    pass only: that is how a resumed run continues mid-epoch without loading the skipped data.
    """

    def __init__(self, num_items: int, seed: int, rank: int = 0, world_size: int = 1):
        self.num_items, self.seed, self.rank, self.world_size = num_items, seed, rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start = 0  # a position saved for another epoch means nothing in this one
        self.epoch = epoch

    def __len__(self) -> int:
        return math.ceil(self.num_items / self.world_size)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(self.num_items, generator=generator).tolist()
        total = len(self) * self.world_size  # an equal share per rank, wrapping as often as it takes (more ranks
        order = (order * math.ceil(total / self.num_items))[:total]  # than twice the items need more than one wrap)
        mine = order[self.rank::self.world_size]
        start, self.start = self.start, 0
        yield from mine[start:]


class ResumableDataLoader(DataLoader):
    """A DataLoader with state_dict/load_state_dict, so Lightning restores its position on resume.

    Lightning saves the state of a train loader that has these two methods in every checkpoint
    and loads it before iterating again. The state is (epoch, batches already yielded this
    epoch, their batch size); resuming rebuilds the same epoch permutation and skips the yielded
    batches' indices, so a resume under another batch size is refused.
    This is exact because Lightning does not prefetch from a loader with a length, so "yielded"
    equals "trained on" when a checkpoint is written. Use Trainer(use_distributed_sampler=False):
    the sampler already splits the data across ranks.
    """

    def __init__(self, dataset: Dataset, sampler: EpochShuffleSampler, store_share: tuple[str, int] | None = None,
                 **kwargs):
        super().__init__(dataset, sampler=sampler, **kwargs)
        self.batches_yielded = 0
        # (feature store, the training split's size) where the dataset is what a store holds of the split: one built
        # again (whole, or under another time box) holds another share of the same split, which a refused resume names
        self.store_share = store_share

    def __iter__(self):
        # A generator: nothing runs until the first batch is asked for, i.e. after Lightning's
        # set_epoch and load_state_dict, whatever order it calls them in.
        self.batches_yielded = self.sampler.start // self.batch_size
        for batch in super().__iter__():
            self.batches_yielded += 1
            yield batch

    def state_dict(self) -> dict:
        split_items = self.store_share[1] if self.store_share is not None else self.sampler.num_items
        return {"epoch": self.sampler.epoch, "batches_yielded": self.batches_yielded, "batch_size": self.batch_size,
                "num_items": self.sampler.num_items, "split_items": split_items, "world_size": self.sampler.world_size}

    def load_state_dict(self, state: dict) -> None:
        if (self.store_share is not None and state["num_items"] != self.sampler.num_items
                and state["world_size"] == self.sampler.world_size
                and state.get("split_items", self.store_share[1]) == self.store_share[1]):
            store, split = self.store_share  # the same split, another share of it: not the data nor the devices
            raise DDTreeError(
                f"--resume: the run trained on {state['num_items']} training sequences and feature store {store} holds "
                f"{self.sampler.num_items} of the {split} (another share of the training split than the run's: a "
                "store built again, whole or under another time box, data.store_max_minutes, whose share follows the "
                "machine's speed): put back the store the run trained from, or warm-start a new run from the "
                "checkpoint's drafter (python -m training.export <checkpoint> <folder>, then "
                "--model.init_from=<folder>)"
            )
        if state["num_items"] != self.sampler.num_items or state["world_size"] != self.sampler.world_size:
            raise DDTreeError(
                f"the checkpoint's train loader had {state['num_items']} sequences on {state['world_size']} ranks, "
                f"this run has {self.sampler.num_items} on {self.sampler.world_size}: resume with the same data and devices"
            )
        # The position is counted in batches: under another batch size it would skip data never trained on.
        # (States saved before the batch size was recorded lack the key and are trusted, as they always were.)
        if state.get("batch_size", self.batch_size) != self.batch_size:
            raise DDTreeError(
                f"the checkpoint's train loader had data.batch_size={state['batch_size']}, this run has "
                f"{self.batch_size}: resume with data.batch_size={state['batch_size']}"
            )
        self.sampler.epoch = state["epoch"]
        self.sampler.start = state["batches_yielded"] * self.batch_size
        self.batches_yielded = state["batches_yielded"]


# ----------------------------------------------------------------------------- the DataModule


def file_digest(path: Path, memo: dict) -> str:
    """SHA-256 of a file's bytes; `memo` (resolved path -> [size, mtime_ns, digest]) spares reading an unchanged one."""
    stat, name = path.stat(), str(path.resolve())
    known = memo.get(name)
    if isinstance(known, list) and known[:2] == [stat.st_size, stat.st_mtime_ns]:
        return known[2]
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    memo[name] = [stat.st_size, stat.st_mtime_ns, digest.hexdigest()]
    return memo[name][2]


def source_fingerprint(source: str, memo_path: Path | None = None) -> str:
    """Identify a data source by its content: each file's name (inside a folder) and SHA-256; a Hub name as is.

    A copy on a node's local disk, a moved folder or a fresh clone is the same source, so the tokenized cache and the
    feature store built from it serve it (a store takes hours to build for a large target); an edited file is
    another. Digests are remembered in `memo_path` by path, size and mtime, so an unchanged file is read once."""
    path = Path(source)
    if not path.exists():
        return str(source)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    memo = read_digest_memo(memo_path)
    before = dict(memo)
    if sum(p.stat().st_size for p in files) > 1 << 30 and any(str(p.resolve()) not in memo for p in files):
        log.info("reading %s once to identify it by content", source)
    fingerprint = json.dumps([(str(p.relative_to(path)) if path.is_dir() else "", file_digest(p, memo)) for p in files])
    if memo_path is not None and memo != before:
        try:
            write_text_atomic(memo_path, json.dumps(memo))
        except (OSError, DDTreeError):  # only a memo: the digests are read again next time
            pass
    return fingerprint


def read_digest_memo(memo_path: Path | None) -> dict:
    """The remembered file digests; a missing, damaged or foreign file is an empty memo (it only spares reads)."""
    try:
        memo = json.loads(memo_path.read_text()) if memo_path is not None else {}
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def legacy_source_fingerprint(source: str) -> str:
    """The data's identity before 2026-12-03: path, sizes and mtimes. Feature stores built then recorded it (through
    the tokenization key); DistillDataModule.tokenization_keys keeps them usable where the data has not moved and
    their tokenization is cached still."""
    path = Path(source)
    if not path.exists():
        return str(source)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return json.dumps([str(path.resolve())] + [(str(p.relative_to(path) if path.is_dir() else p.name),
                                                 p.stat().st_size, p.stat().st_mtime_ns) for p in files])


_TOKENIZER_DIGESTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer) -> str:
    """A tokenizer's identity by content (its whole serialized vocabulary, merges and added tokens), so a target folder
    copied elsewhere tokenizes to the same cache and one retrained at the same path does not; its name where it has
    no serialized form (a slow tokenizer). 0.25 s for SmolLM2's on a 2-core Xeon (2026-12-03): once per tokenizer object."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer.name_or_path
    if tokenizer not in _TOKENIZER_DIGESTS:
        _TOKENIZER_DIGESTS[tokenizer] = hashlib.sha256(backend.to_str().encode()).hexdigest()
    return _TOKENIZER_DIGESTS[tokenizer]


def read_conversations(data_path: str) -> list[dict]:
    """load_conversations, with a local file it cannot read (a .arrow or .parquet cut off mid-copy) as one line naming it."""
    try:
        return load_conversations(data_path)
    except DDTreeError:
        raise
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError, its IO errors OSErrors
        if not Path(data_path).exists():
            raise
        what, redo = (("a file of the saved `datasets` folder", "save the dataset again (save_to_disk)")
                      if Path(data_path).is_dir() else ("the file", "write or copy it again"))
        raise DDTreeError(f"data_path {data_path}: {what} could not be read ({type(error).__name__}: {error_line(error)}); "
                          f"truncated or damaged? {redo}") from None


def warn_unless_end_of_turn_stops(target: str, tokenizer) -> None:
    """Warn when the chat template's end-of-turn token, which training supervises at the end of every reply, is none
    of the ids decoding stops at (the target's generation config, config and tokenizer eos: stop_token_ids). The
    drafter then learns to end replies with a token the target never ends them with (a base model's ChatML template
    beside eos <|endoftext|>), and never the one it does."""
    from ddtree.targets import config_stop_token_ids, resolve_target

    eot = end_of_turn_text(tokenizer)
    eot_id = tokenizer.convert_tokens_to_ids(eot)
    stops = config_stop_token_ids(resolve_target(target), tokenizer)
    if eot_id not in stops:
        named = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in stops) or "none"
        log.warning("the chat template of target %s ends a reply with %r (id %d), which training supervises, but "
                    "decoding stops at %s: the drafter learns an end of reply the target does not write; give the "
                    "target a generation_config.json whose eos_token_id holds %d, or a template ending turns with a "
                    "stop token", target, eot, eot_id, named, eot_id)


class DistillDataModule(L.LightningDataModule):
    """Conversations regenerated by the target -> right-padded batches for drafter training.

    Batches: {"input_ids": (B,T) long, "loss_mask": (B,T) bool, "attention_mask": (B,T) bool}, and
    "features": (B,T,K*H) with a feature store (the target's layer features computed offline, so
    training skips the target forward; `store` is the opened FeatureStore, checked against the data).
    The train loader resumes exactly mid-epoch (ResumableDataLoader); run the Trainer with
    use_distributed_sampler=False since the sampler already shards across ranks.
    """

    def __init__(
        self,
        target: str = "smollm2-135m",  # whose tokenizer and chat template render the conversations
        data_path: str = "data/smollm2-135m",  # JSONL/Parquet file, saved datasets folder or Hub name
        max_length: int = 2048,  # longer conversations are truncated (and counted)
        batch_size: int = 4,
        num_workers: int = 0,
        val_fraction: float = 0.02,  # held out from the data, by a seeded permutation
        seed: int = 0,  # split and per-epoch shuffle
        min_supervised_tokens: int = 16,  # fewer assistant tokens than this after truncation: dropped
        cache_dir: str | None = None,  # tokenized cache; default <ddtree cache>/tokenized
        feature_store: str | None = None,  # offline target features (make features): a folder, or "auto" =
        # the recipe's folder under the ddtree cache (resolved by training.train / training.features); None: online
        regenerate: dict | None = None,  # data/regenerate.py's options: the target writes data_path on first use
        # (training/recipe_data.py); data_path "auto" then means <ddtree cache>/data/<recipe>
        store_max_minutes: float | None = None,  # a time box for building the feature store (training.train, make
        # features): where the whole store would take longer, it holds a seeded share of the training split, and
        # training draws from that share (training/feature_store.py); None: the whole data, however long it takes
    ):
        super().__init__()
        if not 0 <= val_fraction < 1:
            raise DDTreeError(f"data.val_fraction={val_fraction}: give the share of the data held out for validation, "
                              "at least 0 and below 1")
        if max_length < 2:
            raise DDTreeError(f"data.max_length={max_length}: give at least 2 tokens a sequence")
        if batch_size < 1:
            raise DDTreeError(f"data.batch_size={batch_size}: give at least 1 sequence a batch (on each process)")
        if store_max_minutes is not None and store_max_minutes <= 0:
            raise DDTreeError(f"data.store_max_minutes={store_max_minutes}: give a positive number of minutes, or null "
                              "for the whole store")
        self.save_hyperparameters()
        # `~` is the home folder (see cache_dir below): a recipe's regenerated data went into a folder named `~` here
        self.target, self.data_path, self.max_length = target, os.path.expanduser(str(data_path)), max_length
        self.batch_size, self.num_workers, self.val_fraction, self.seed = batch_size, num_workers, val_fraction, seed
        self.min_supervised_tokens = min_supervised_tokens
        if cache_dir is None:
            from ddtree.targets import cache_dir as ddtree_cache_dir

            cache_dir = str(ddtree_cache_dir() / "tokenized")
        # `~` is the home folder here, where both training and `make features` read these: a recipe's value and
        # --data.feature_store=~/x reach no shell, and wrote into a folder named `~` in the working one.
        self.cache_dir = Path(cache_dir).expanduser()
        self.feature_store = os.path.expanduser(feature_store) if feature_store else feature_store
        check_regenerate_settings(regenerate)
        self.regenerate = dict(regenerate or {})
        self.store_max_minutes = store_max_minutes
        self.store: FeatureStore | None = None  # opened in setup
        self.train_set: TokenizedConversations | None = None  # what training draws from
        self.train_split: TokenizedConversations | None = None  # the whole training split: train_set, unless a
        # time-boxed store holds a share of it (the replies for model.corpus and the draft vocabulary come from it)
        self.val_set: TokenizedConversations | None = None
        self.pad_id = 0
        self.data_digest: str | None = None  # the tokenized data's (set in setup; a resume must find the same)
        self.tokenized_counts: dict | None = None  # what the tokenization kept, dropped and cut, by reason (setup)
        self._alike: dict[Path, tuple[bool, bool]] = {}  # tokenized_alike's answers: (same ids, same ids and masks)

    def load_tokenizer(self):
        from ddtree.targets import load_tokenizer

        return load_tokenizer(self.target)  # shared: read, never changed

    def cache_path(self, tokenizer, legacy: bool = False, version: int | None = None) -> Path:
        """<cache_dir>/<key>.pt, the key naming the data and tokenizer by content and the settings that change the
        tokenization; `legacy`: the name a version before 2026-12-03 gave it (path and mtimes), `version`: the name
        under an earlier TOKENIZATION_VERSION (see tokenization_keys), else the current one."""
        if self.data_path == AUTO_DATA:
            raise DDTreeError('data.data_path "auto" names the recipe\'s generated data: train through '
                              "training.train, or give the data's folder")
        version = TOKENIZATION_VERSION if version is None else version
        if legacy:
            identity = [version, legacy_source_fingerprint(self.data_path), tokenizer.name_or_path]
        else:
            identity = [version, "content", source_fingerprint(self.data_path, self.cache_dir / DIGEST_MEMO),
                        tokenizer_fingerprint(tokenizer)]
        key = json.dumps(identity + [tokenizer.chat_template, len(tokenizer), self.max_length, self.min_supervised_tokens])
        return self.cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"

    def prepare_data(self) -> None:
        """Tokenize once (rank 0) into the cache; assigns no state, as Lightning requires."""
        tokenizer = self.load_tokenizer()
        warn_unless_end_of_turn_stops(self.target, tokenizer)  # every launch, cached tokenization or not
        path = self.cache_path(tokenizer)
        if path.exists():
            return
        why = why_unwritable(self.cache_dir)  # (a read-only mount): said before the tokenization, not after it
        if why is not None:
            raise DDTreeError(f"cannot write the tokenized cache {self.cache_dir} ({why}): "
                              f"{self.move_cache('a writable folder')}")
        records = read_conversations(self.data_path)
        # (what it dropped or cut, and why, is tokenize_conversations' one warning; record() keeps the counts)
        examples, counts = tokenize_conversations(tokenizer, records, self.max_length, self.min_supervised_tokens, self.data_path)
        data = TokenizedConversations.from_examples(examples)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        try:
            with atomic_file(path, "wb") as handle:  # other ranks/processes never see a half-written cache
                torch.save({"input_ids": data.input_ids, "loss_mask": data.loss_mask, "offsets": data.offsets,
                            "pad_id": pad_id, "counts": counts, "source": self.data_path}, handle)
        except WriteFailed as failure:  # (a full disk, a quota: named with the setting that moves the cache)
            raise DDTreeError(f"cannot write the tokenized cache {path} ({failure.why}): {failure.remedy}, or "
                              f"{self.move_cache('a folder on a disk with room')}") from None

    def move_cache(self, to: str) -> str:
        """The setting that moves the tokenized cache `to` somewhere else, for an error: data.cache_dir where it was
        given, else DDTREE_CACHE (whose tokenized/ it is) or data.cache_dir."""
        if self.hparams.cache_dir is not None:
            return f"set data.cache_dir to {to}"
        from ddtree.targets import cache_dir as ddtree_cache_dir

        return (f"set DDTREE_CACHE to {to} (it is {ddtree_cache_dir()}; the tokenized cache is its tokenized/), or "
                "data.cache_dir")

    def tokenization_key(self) -> str:
        """Names this data + tokenizer + max_length (the tokenized cache's file name); feature stores record it."""
        return self.cache_path(self.load_tokenizer()).stem

    def tokenization_keys(self, teacher: bool = False) -> tuple[str, ...]:
        """tokenization_key, then the keys earlier versions gave the same data (an earlier TOKENIZATION_VERSION, and
        before 2026-12-03 its path and mtimes) whose cached tokenization is still there and holds the same input ids:
        a feature store built then, and named by one, still serves (it took hours to build on a large target, and
        features depend on the ids alone). teacher: for a store with a top-k teacher, computed only where the loss
        mask supervises (build_feature_store), the masks must be the same too. Without the earlier cache nothing shows
        the ids are the same: its stores are not taken."""
        tokenizer = self.load_tokenizer()
        current = self.cache_path(tokenizer).stem
        earlier = [self.cache_path(tokenizer, legacy, version)
                   for version in range(TOKENIZATION_VERSION - 1, 0, -1) for legacy in (False, True)]
        return current, *(path.stem for path in earlier if self.tokenized_alike(path, teacher))

    def tokenized_alike(self, earlier: Path, masks: bool) -> bool:
        """Whether the cached tokenization `earlier` (another version's) holds this one's input ids (and, with `masks`,
        its loss masks); a missing or unreadable one does not."""
        if not earlier.is_file():
            return False
        if earlier not in self._alike:
            try:
                cached = torch.load(earlier, weights_only=True)
            except (RuntimeError, EOFError, OSError, pickle.UnpicklingError):
                return False
            data, _, _ = self.load_tokenized()
            same_ids = torch.equal(cached["offsets"], data.offsets) and torch.equal(cached["input_ids"], data.input_ids)
            self._alike[earlier] = (same_ids, same_ids and torch.equal(cached["loss_mask"], data.loss_mask))
        return self._alike[earlier][masks]

    def load_tokenized(self) -> tuple[TokenizedConversations, int, str]:
        """The whole tokenized data in cache order (train and val), its pad id and its tokenization key."""
        path = self.cache_path(self.load_tokenizer())
        if not path.exists():  # used without a Trainer, or on a node where prepare_data did not run
            self.prepare_data()
        try:
            cached = torch.load(path, weights_only=True)
        except (RuntimeError, EOFError, OSError, pickle.UnpicklingError) as error:  # cut short or damaged: only a cache
            log.warning("the tokenized cache %s is unreadable (%s); tokenizing the data again", path, error_line(error))
            path.unlink(missing_ok=True)
            self.prepare_data()
            cached = torch.load(path, weights_only=True)
        # tokenize_conversations' counts, for data.json: its warning was said once, when the cache was written
        self.tokenized_counts = cached.get("counts")
        return TokenizedConversations(cached["input_ids"], cached["loss_mask"], cached["offsets"]), cached["pad_id"], path.stem

    def setup(self, stage: str | None = None) -> None:
        """Load the cached tokenization (on every rank), open the feature store if any, split train/val with the seed."""
        if self.train_set is not None:
            return
        data, self.pad_id, _ = self.load_tokenized()
        if self.feature_store == AUTO_STORE:
            raise DDTreeError('data.feature_store "auto" names the recipe\'s store: train through training.train, '
                              "or give the store's folder")
        if self.feature_store:
            self.store = FeatureStore(self.feature_store)
            self.store.check_matches(self.tokenization_keys(teacher=bool(self.store.teacher_top_k)), data.lengths())
            data.features = self.store
        self.data_digest = data.digest()
        order, num_val = self.split_order(len(data))
        self.val_set = Subset(data, order[:num_val])
        self.train_split = Subset(data, order[num_val:])
        covered = self.store.covered() if self.store is not None else None
        if covered is None:
            self.train_set = self.train_split
        else:  # a time-boxed store: the validation split is always in it (built first)
            if not covered.issuperset(order[:num_val]):
                raise DDTreeError(f"feature store {self.feature_store} does not hold this data's validation split (another "
                                  f"data.seed or data.val_fraction than it was built with?): rebuild it with `make "
                                  "features` FORCE=1, or train with the seed and fraction it was built with")
            self.train_set = Subset(data, [i for i in order[num_val:] if i in covered])
            if not self.train_set:  # (a build now always holds some: a store built before that may hold none)
                raise DDTreeError(f"feature store {self.feature_store} holds only the validation split, none of the "
                                  f"{len(self.train_split)} training sequences (its time box, data.store_max_minutes, "
                                  "ended the build): rebuild it with `make features` FORCE=1 and a longer box")
            log.warning("feature store %s holds %d of the %d training sequences (built under a time box, "
                        "data.store_max_minutes): training draws from those", self.feature_store, len(self.train_set),
                        len(self.train_split))
        log.info("data %s: %d train / %d val sequences", self.data_path, len(self.train_set), len(self.val_set))

    def record(self) -> dict:
        """What this run trained and validated on, for <run>/data.json: a time-boxed feature store holds part of the
        training split, so two runs of one recipe may draw from different shares; and how many of the data's
        conversations the tokenization kept, dropped (no assistant turn, too few supervised tokens within max_length,
        a render the loss mask cannot follow) and cut (tokenize_conversations), which a cached launch does not say."""
        return {"train_sequences": len(self.train_set), "train_split_sequences": len(self.train_split),
                "val_sequences": len(self.val_set), "feature_store": self.feature_store,
                "tokenization": self.tokenized_counts}

    def state_dict(self) -> dict:
        return {"data_digest": self.data_digest} if self.data_digest else {}

    def load_state_dict(self, state: dict) -> None:
        # A resume's loader position is counted in the run's split of the run's data: other conversations of the
        # same count passed the loader's check and trained on (checkpoints saved before the digest was kept pass).
        saved = state.get("data_digest")
        if saved and self.data_digest and saved != self.data_digest:
            raise DDTreeError(f"--resume: data.data_path={self.data_path} holds other conversations than the run trained "
                              f"on (tokenized, they hash to {self.data_digest}, the run's to {saved}; or data.max_length "
                              "changed, or this version of the code masks them otherwise): resume with the run's data, "
                              "or start a new run")

    def split_order(self, num_sequences: int) -> tuple[list[int], int]:
        """(the seeded permutation of the data's sequences, how many lead it as the validation split)."""
        order = torch.randperm(num_sequences, generator=torch.Generator().manual_seed(self.seed)).tolist()
        num_val = min(num_sequences - 1, max(1, round(num_sequences * self.val_fraction))) if self.val_fraction > 0 else 0
        return order, num_val

    def train_dataloader(self) -> ResumableDataLoader:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        sampler = EpochShuffleSampler(len(self.train_set), self.seed, rank, world)
        store_share = (self.feature_store, len(self.train_split)) if self.store is not None else None
        return ResumableDataLoader(self.train_set, sampler, store_share, batch_size=self.batch_size,
                                   num_workers=self.num_workers, collate_fn=Collator(self.pad_id),
                                   persistent_workers=self.num_workers > 0, worker_init_fn=ignore_sigterm)

    def val_dataloader(self, whole: bool = False) -> DataLoader:
        """This rank's share of the validation split (rank_share); the module sums the statistics over ranks.
        whole: the whole split on every rank, for work every rank must do alike (model.calibrate replays
        decoding, whose forwards under ZeRO-3 gather the drafter's shards from all ranks)."""
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        share = self.val_set if whole else Subset(self.val_set, rank_share(len(self.val_set), rank, world))
        return DataLoader(share, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=Collator(self.pad_id), worker_init_fn=ignore_sigterm)
