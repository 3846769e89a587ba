"""The offline feature store: the frozen target's layer features of a recipe's data, written once, read lazily.

    store = build_feature_store(datamodule, out, layer_ids=[1, 9, 17])   # training/features.py is its CLI
    FeatureStore(out)[i]                                                  # sequence i's features, (T_i, K*H)
    FeatureStore(out).final(i)                                            # with final_hidden=True: (T_i, H)
    FeatureStore(out).teacher(i)                                          # with teacher_top_k=k: (T_i, k) x 2

Online training runs the target up to its deepest chosen layer at every step. A store holds those
features, computed by the very same function (training.target.target_layer_features), for every
sequence of the recipe's tokenized data (train and val, in the tokenized cache's order, each at its
own length): training from it skips the target forward. It costs disk, about
tokens x K layers x hidden size x 2 bytes in bf16, which is printed (with the free space) before
anything is written; a build that would not fit stops there.

With final_hidden=True (what a recipe with model.distill_weight > 0 builds) the store also holds the
target's final, normed hidden state of every token: one more hidden size per token, from which the
target's LM head gives its whole next-token distribution, the soft targets of distillation
(training/loss.py). The whole decoder then runs during the build, not only up to the deepest layer.
With teacher_top_k=k instead (a recipe with model.distill_top_k k) it holds, per token, the target's k likeliest
next tokens and their log-probabilities (training.loss.next_token_top_k), 8k bytes where a final hidden state in
bf16 takes 2H: the LM head then runs once here, not at every training step, and only at the tokens whose next
token is supervised (a reply's; the rows before a prompt token hold IGNORE_INDEX, log-probability -inf, and no loss
reads them). They are those of the target's own logits: where its family transforms the LM head's output (Gemma-2's
softcap, Granite's scale: training.target.logit_transform) the manifest's `teacher_logits` says how, and a store without
it for such a target (built before, from the head's raw output) is refused until rebuilt with --force.

Layout of a store folder:
    store.json                   the manifest: format version, target (and adapter, with the sha256 of its
                                 files: one retrained at the same path is another build), layer ids, hidden size,
                                 dtype, the tokenization key of the data, every sequence's length, the shards
    shard-00000.safetensors ...  consecutive sequences, up to ~256 MB each: `features` (tokens, K*H) and
                                 `offsets` (n + 1,), sequence j of the shard = features[offsets[j]:offsets[j + 1]];
                                 the build's id in its metadata, as in the manifest (BUILD_ID);
                                 with final_hidden also `final` (tokens, H), with teacher_top_k `teacher_ids`
                                 (tokens, k) int32 and `teacher_log_probs` (tokens, k) float32, indexed alike

The build is atomic and resumable: it writes into <out>.partial/ (each shard under a temporary name,
renamed when complete), a rerun of the same build keeps the finished shards, and the folder is renamed
to <out> at the end. An existing complete store is only replaced with --force, and only once the new
one is complete. A build holds <out>.lock throughout (build_lock): a second launch building the same store waits for
the first, then takes its store.

A time-boxed build (data.store_max_minutes) stores the sequences in the data's seeded split order, the
validation split first, and ends before the shard that would overrun the box (but never before its first
shard of training sequences), measured by this build's own speed: on a machine too slow for the whole store it covers a seeded random share of the training split (the
manifest's `sequence_ids` name the data sequence at each store position; its `shards` only the finished ones),
and training draws from that share (DistillDataModule.setup). A complete store of the same build is used
whatever its coverage. An interrupted boxed build resumes on its own clock: the time spent up to its last finished
shard counts against the box (<out>.partial/.time_box.json), so a restart does not buy a fresh box.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import glob
import json
import os
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig

from ddtree.calibration import weights_fingerprint
from ddtree.configuration_dflash import DFlashDrafterConfig
from ddtree.drafters import read_drafter_config
from ddtree.errors import DDTreeError
from ddtree.files import (WriteFailed, file_in_the_way, follow_umask, format_bytes, free_bytes, replace_folder,
                          unwritable_as_error, write_failure, write_json_atomic)
from ddtree.precision import LIGHTNING_PRECISION
from ddtree.targets import BUILTIN_TARGETS, TINY_TARGET, cache_dir, default_layer_ids, parse_dtype, resolve_target

from .loss import next_token_top_k
from .masks import IGNORE_INDEX
from .peft_utils import adapter_fingerprint
from .target import load_frozen_target, logit_transform, target_layer_features

if TYPE_CHECKING:
    from .data import DistillDataModule, TokenizedConversations

FORMAT_VERSION = 1  # bump when the layout changes: older stores are then refused, not misread
# Added to format 1 later, absent (= False) in the manifests of stores built before: those stay valid.
OPTIONAL_MANIFEST_FIELDS = {"final_hidden": False, "teacher_top_k": 0, "sequence_ids": None, "target_weights": None,
                            "build_id": None, "teacher_logits": None}
# What may differ between a build's plan and the store it leaves when its time box ends it early, or a complete
# store in the data's own order that a time-boxed build finds (it covers more): the same build otherwise.
COVERAGE_FIELDS = ("sequence_ids", "shards", "lengths")
MANIFEST = "store.json"
# In the manifest and in each shard's safetensors metadata: which build wrote it (a random id, kept by a resume). A
# reader that opens a shard lazily finds a store replaced (--force) since it read the manifest, where the shard's
# offsets would have given it other sequences' features.
BUILD_ID = "build_id"
BOX_CLOCK = ".time_box.json"  # in <out>.partial/: the time a boxed build has spent, carried across a resume
MAX_SHARD_BYTES = 256 * 2**20
REBUILD = "make features RECIPE=<recipe>"  # how a user (re)builds a store, named in every error
AUTO_STORE = "auto"  # data.feature_store value: the recipe's default folder (default_store_path)


def partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".partial")


def lock_path(out: Path) -> Path:
    return out.with_name(out.name + ".lock")


@contextmanager
def build_lock(out: Path):
    """Hold <out>.lock for a whole build: a second launch building the same store (`make features` while a training
    run builds it, two runs of one recipe) waits for the first, then finds its store done, where both wrote into one
    <out>.partial and each removed or renamed it under the other. flock: the OS releases it when its process dies,
    so a killed build holds up nobody. The holder removes the file at the end (a waiter left holding the removed file
    locks the one now there)."""
    descriptor = take_lock(lock_path(out), f"another process is building {out}")
    try:
        yield
    finally:
        if descriptor is not None:
            with contextlib.suppress(OSError):
                lock_path(out).unlink()  # while held: a process waiting on this file finds it gone, locks the next
            os.close(descriptor)


def take_lock(lock: Path, holder: str) -> int | None:
    """An exclusive flock on `lock`, waited for (saying so once, naming `holder`): its open descriptor. None where
    no lock can be had: a place it cannot be made in (a read-only mount, where a build has nothing to do or says
    itself that it cannot write), or a filesystem without locks (said, and the file removed if this call made it)."""
    said = False
    flags = os.O_RDONLY | os.O_CREAT  # read-only: another user's lock file opens
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            try:
                descriptor, created = os.open(lock, flags | os.O_EXCL, 0o666), True
            except FileExistsError:  # another build's, or one a killed build left
                descriptor, created = os.open(lock, flags, 0o666), False
        except OSError:
            return None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not said:
                print(f"[features] {holder} (it holds {lock}); waiting for it to end", flush=True)
                said = True
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        except OSError as error:  # (Lustre mounted without flock, say)
            print(f"[features] cannot lock {lock} ({error.strerror}): a second build at the same time would not wait "
                  "for this one", file=sys.stderr, flush=True)
            if created:  # else every build, a complete store's included, would leave it beside the store
                with contextlib.suppress(OSError):
                    lock.unlink()
            os.close(descriptor)
            return None
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(descriptor), os.stat(lock)):
                return descriptor  # the file still there, not one its last holder removed while this process waited
        os.close(descriptor)


# What every format-1 manifest holds: FeatureStore reads them all (a store of another format is refused on its version).
REQUIRED_MANIFEST_FIELDS = ("target", "target_adapter", "target_layer_ids", "hidden_size", "dtype", "tokenization_key",
                            "shards", "lengths")


def read_manifest(path: Path) -> dict:
    """A manifest with the fields that later builds added filled in with what they meant before.

    One cut short (a copy that stopped), not JSON or missing a field is one line naming it, not a traceback."""
    rebuild = f"rebuild the store with `{REBUILD}` and --force (FORCE=1)"
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:  # JSONDecodeError, or bytes that are not text
        raise DDTreeError(f"feature store manifest {path} is unreadable ({error}): {rebuild}") from None
    if not isinstance(manifest, dict):
        raise DDTreeError(f"feature store manifest {path} is not a JSON object: {rebuild}")
    missing = [field for field in REQUIRED_MANIFEST_FIELDS if field not in manifest]
    if missing and manifest.get("format_version") == FORMAT_VERSION:
        raise DDTreeError(f"feature store manifest {path} lacks {', '.join(missing)}: {rebuild}")
    return {**OPTIONAL_MANIFEST_FIELDS, **manifest}


def same_data_path(recorded: str | None, data_path: str) -> bool:
    """Whether a manifest's data_path names this one: spelled relative, with ./ or absolute, it is the same build."""
    return recorded == data_path or (recorded is not None
                                     and Path(recorded).expanduser().resolve() == Path(data_path).expanduser().resolve())


def differing_fields(existing: dict, planned: dict, same_data: tuple[str, ...], fields) -> list[str]:
    """The `fields` in which a store's manifest (`existing`, finished or not) names another build than `planned`.

    Judged by content, as training judges a store (DistillDataModule.setup, DistillModule.check_feature_store): data
    copied to another path is the same data where its tokenization key is one of `same_data` (the key names the
    content, DistillDataModule.tokenization_keys), and a target or adapter copied elsewhere (a node's local disk) is
    the same one where their recorded fingerprints match. A store that recorded no target_weights (built before they
    were) is taken as the same target's, as it was then."""
    def same(key: str) -> bool:
        recorded, wanted = existing.get(key), planned.get(key)
        if recorded == wanted:
            return True
        if key == "tokenization_key":
            return recorded in same_data
        if key == "data_path":
            return existing.get("tokenization_key") in same_data or same_data_path(recorded, wanted)
        if key == "target_weights":
            return recorded is None
        if key == "target":
            weights = planned.get("target_weights")
            return weights is not None and existing.get("target_weights") == weights
        if key == "target_adapter":
            adapter = planned.get("target_adapter_sha256")
            return adapter is not None and existing.get("target_adapter_sha256") == adapter
        return False

    return sorted(key for key in fields if not same(key))


def is_complete(path: str | Path) -> bool:
    """A finished store: its manifest exists only once the whole folder has been renamed into place."""
    return (Path(path) / MANIFEST).is_file()


def drafter_layer_ids(target_layer_ids: list[int] | None, init_from: str | None) -> list[int] | None:
    """The target layers a recipe's drafter reads: model.target_layer_ids, else a warm start's, else None (the default)."""
    if target_layer_ids:
        return [int(i) for i in target_layer_ids]
    if init_from:
        return list(init_from_config(init_from).target_layer_ids)
    return None


def init_from_config(init_from: str) -> DFlashDrafterConfig:
    """model.init_from's drafter config, or one line naming the field (checked as a recipe is read, too)."""
    try:
        return read_drafter_config(Path(init_from))
    except DDTreeError as error:
        raise DDTreeError(f"model.init_from: {error}; give a drafter folder (a run's drafter/ or an export), "
                          "or null") from None


def plan_shards(lengths: list[int], bytes_per_token: int, max_shard_bytes: int) -> list[dict]:
    """Consecutive sequences per shard, up to max_shard_bytes (a longer sequence gets a shard of its own).

    The plan depends only on its arguments, so a rerun of the same build finds the same shards.
    """
    starts, tokens = [0], 0
    for index, length in enumerate(lengths):
        if index > starts[-1] and (tokens + length) * bytes_per_token > max_shard_bytes:
            starts.append(index)
            tokens = 0
        tokens += length
    bounds = list(zip(starts, starts[1:] + [len(lengths)]))
    return [{"file": f"shard-{k:05d}.safetensors", "first_sequence": start, "num_sequences": end - start,
             "num_tokens": sum(lengths[start:end])} for k, (start, end) in enumerate(bounds)]


def target_fingerprint(target: str) -> str | None:
    """weights_fingerprint of a local target's weight files (a built-in target's converted folder): a store built
    before a target was fine-tuned and saved over at the same path holds another target's features. None for a target
    named by a Hub id (its files are not here to read)."""
    if target in BUILTIN_TARGETS or target == TINY_TARGET or Path(target).expanduser().is_dir():
        return weights_fingerprint(Path(resolve_target(target)))
    return None


class FeatureStore:
    """A finished store, read lazily: store[i] is sequence i's features, (T_i, K*H) in the store's dtype.

    Shards are memory-mapped (safetensors.safe_open) and only sequence i's rows are read. Attributes
    come from the manifest: layer_ids, hidden_size, width (K*H), dtype, lengths, tokenization_key,
    target, target_adapter (and target_adapter_sha256, adapter_fingerprint's), target_weights (target_fingerprint's;
    None in stores built before it), final_hidden (whether
    store.final(i), the target's final hidden states (T_i, H), exists), teacher_top_k (k where store.teacher(i),
    the target's top k next tokens, exists; else 0), teacher_logits (logit_transform's "<field>=<value>" that teacher
    was computed with; None for a target whose forward transforms nothing, and in stores built before it was).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not is_complete(self.path):
            if partial_path(self.path).exists():
                raise DDTreeError(f"feature store {self.path} is incomplete (its build stopped; finished shards are in "
                                  f"{partial_path(self.path)}): rerun `{REBUILD}` to finish it")
            raise DDTreeError(f"feature store {self.path} does not exist (no {MANIFEST}): build it with `{REBUILD}`")
        manifest = read_manifest(self.path / MANIFEST)
        if manifest.get("format_version") != FORMAT_VERSION:
            raise DDTreeError(f"feature store {self.path} has format version {manifest.get('format_version')}, this "
                              f"code reads {FORMAT_VERSION}: rebuild it with `{REBUILD}` and --force (FORCE=1)")
        self.manifest = manifest
        self.target, self.target_adapter = manifest["target"], manifest["target_adapter"]
        self.target_adapter_sha256 = manifest.get("target_adapter_sha256")  # absent in stores built before it
        self.target_weights = manifest["target_weights"]
        self.layer_ids, self.hidden_size = manifest["target_layer_ids"], manifest["hidden_size"]
        self.width = len(self.layer_ids) * self.hidden_size
        self.dtype = parse_dtype(manifest["dtype"], f"{self.path / MANIFEST} dtype")
        self.lengths, self.tokenization_key = manifest["lengths"], manifest["tokenization_key"]
        self.final_hidden = bool(manifest["final_hidden"])
        self.teacher_top_k = int(manifest["teacher_top_k"])
        self.teacher_logits = manifest["teacher_logits"]  # the target's logit transform its top-k teacher took, or None
        self.last_layer_normed = manifest.get("last_layer") == "normed"
        self.shards = manifest["shards"]
        self.build_id = manifest[BUILD_ID]  # None in stores built before it: their shards hold none either
        self._first_sequences = [shard["first_sequence"] for shard in self.shards]
        self._open_shards: dict[int, tuple] = {}  # shard index -> (safe_open handle, offsets)
        # A time-boxed store: data sequence sequence_ids[p] at store position p, the finished shards' positions only.
        self.sequence_ids = manifest["sequence_ids"]
        self._positions = None if self.sequence_ids is None else {
            self.sequence_ids[p]: p for shard in self.shards
            for p in range(shard["first_sequence"], shard["first_sequence"] + shard["num_sequences"])}
        # Every listed shard there, whole and of its planned shape, checked now from the headers: else a lost shard
        # is found at the first read of its sequences, hours in when it holds only validation sequences.
        for shard in self.shards:
            with self._safe_open(shard["file"]) as handle:
                shape = handle.get_slice("features").get_shape()
            if shape != [shard["num_tokens"], self.width]:
                raise DDTreeError(f"feature store {self.path}: {shard['file']} holds features of shape {shape}, its "
                                  f"manifest plans {[shard['num_tokens'], self.width]}: rebuild it with `{REBUILD}` "
                                  "and --force (FORCE=1)")

    def __len__(self) -> int:
        return len(self.lengths)

    def covered(self) -> set[int] | None:
        """The data sequences this store holds; None where it holds all of them."""
        return None if self._positions is None or len(self._positions) == len(self.lengths) else set(self._positions)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._rows("features", index)  # (T_i, K*H)

    def final(self, index: int) -> torch.Tensor:
        """Sequence `index`'s final hidden states (T_i, H); only in a store built with final_hidden."""
        if not self.final_hidden:
            raise DDTreeError(f"feature store {self.path} holds no final hidden states: rebuild it with "
                              f"`{REBUILD}` for a recipe with model.distill_weight > 0, and --force (FORCE=1)")
        return self._rows("final", index)

    def teacher(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence `index`'s target top k after each token: ((T_i, k) ids, (T_i, k) log-probabilities); only in a
        store built with teacher_top_k."""
        if not self.teacher_top_k:
            raise DDTreeError(f"feature store {self.path} holds no top-k teacher: rebuild it with `{REBUILD}` for a "
                              "recipe with model.distill_top_k > 0, and --force (FORCE=1)")
        return self._rows("teacher_ids", index).long(), self._rows("teacher_log_probs", index)

    def _rows(self, name: str, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} is outside feature store {self.path} (0..{len(self) - 1})")
        position = index if self._positions is None else self._positions.get(index)
        if position is None:
            raise IndexError(f"sequence {index} is not in time-boxed feature store {self.path} (covered(): the ones it holds)")
        shard = bisect.bisect_right(self._first_sequences, position) - 1
        handle, offsets = self._open(shard)
        local = position - self._first_sequences[shard]
        return handle.get_slice(name)[offsets[local]:offsets[local + 1]]

    def _open(self, shard: int) -> tuple:
        if shard not in self._open_shards:
            handle = self._safe_open(self.shards[shard]["file"])
            self._open_shards[shard] = (handle, handle.get_tensor("offsets").tolist())
        return self._open_shards[shard]

    def _safe_open(self, name: str):
        """safe_open of one of the store's shards (it reads the header only), a missing one or one cut short (a copy
        that stopped, a full disk) as one line naming it, not a traceback."""
        file = self.path / name
        replaced = DDTreeError(f"feature store {self.path}: {name} is not of the build whose {MANIFEST} this process "
                               "read when it opened the store: the store was replaced since (a --force build); start "
                               "the run again to read the new store")
        if not file.is_file():
            if self.replaced():  # a new build with fewer shards (in a smaller dtype, say) has no such shard
                raise replaced
            raise DDTreeError(f"feature store {self.path} lacks {name}: rebuild it with `{REBUILD}` and --force (FORCE=1)")
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as error:
            raise DDTreeError(f"feature store {self.path}: {name} is unreadable ({error}): rebuild it with "
                              f"`{REBUILD}` and --force (FORCE=1)") from None
        if shard_build_id(handle) != self.build_id:  # its offsets are another manifest's: other sequences' rows
            raise replaced
        return handle

    def replaced(self) -> bool:
        """Whether the store at this path is now another build than the one this process opened."""
        try:
            return read_manifest(self.path / MANIFEST)[BUILD_ID] != self.build_id
        except (OSError, DDTreeError):  # no manifest (being replaced right now), or one cut short: not a build's
            return False

    def __getstate__(self) -> dict:
        # DataLoader workers get their own memory maps: open file handles do not pickle.
        return {**self.__dict__, "_open_shards": {}}

    def check_matches(self, tokenization_keys: tuple[str, ...], lengths: list[int]) -> None:
        """Raise unless the store was built from exactly this tokenized data (one of its keys, the current first, same
        sequence lengths)."""
        if self.tokenization_key not in tokenization_keys:
            raise DDTreeError(f"feature store {self.path} was built from other data, another tokenizer/max_length or "
                              "an earlier version's tokenization of it (tokenization key "
                              f"{self.tokenization_key}, this data's is {tokenization_keys[0]}): "
                              f"rebuild it with `{REBUILD}` and --force (FORCE=1)")
        if self.sequence_ids is not None:  # in store order: the same data's lengths, permuted
            lengths = [lengths[i] for i in self.sequence_ids] if len(self.sequence_ids) == len(lengths) else lengths
        if self.lengths != lengths:
            differs = next((i for i, (a, b) in enumerate(zip(self.lengths, lengths)) if a != b), min(len(self), len(lengths)))
            raise DDTreeError(f"feature store {self.path} does not match the data: {len(self)} sequences vs {len(lengths)}, "
                              f"first different length at sequence {differs}: rebuild it with `{REBUILD}` and --force (FORCE=1)")


# ----------------------------------------------------------------------------- building


def shard_tensors(target, data: TokenizedConversations, sequences: list[int], layer_ids: list[int], width: int,
                  pad_id: int, dtype: torch.dtype, sequences_per_batch: int, progress: tqdm,
                  final_hidden: bool = False, teacher_top_k: int = 0) -> dict[str, torch.Tensor]:
    """One shard's {"features": (tokens, K*H), "offsets": (n + 1,)[, "final": (tokens, H)][, "teacher_ids",
    "teacher_log_probs": (tokens, k)]}, of the data's `sequences` in that order, computed in length-sorted batches."""
    count = len(sequences)
    lengths = [int(data.offsets[i + 1] - data.offsets[i]) for i in sequences]
    offsets = torch.tensor([0] + lengths).cumsum(0)  # (n + 1,)
    features = torch.empty(int(offsets[-1]), width, dtype=dtype)
    hidden_size = target.config.get_text_config().hidden_size
    final = torch.empty(int(offsets[-1]), hidden_size, dtype=dtype) if final_hidden else None
    # The teacher's rows are computed only where the next token is supervised (a loss reads no other: a block label
    # counts only on loss_mask, masks.block_labels); the others hold IGNORE_INDEX with log-probability -inf, p = 0.
    teacher = (torch.full((int(offsets[-1]), teacher_top_k), IGNORE_INDEX, dtype=torch.int32),
               torch.full((int(offsets[-1]), teacher_top_k), float("-inf"))) if teacher_top_k else None
    device = target.get_input_embeddings().weight.device
    longest_first = sorted(range(count), key=lambda j: -lengths[j])  # neighbours in length: little padding
    for start in range(0, count, sequences_per_batch):
        rows = longest_first[start:start + sequences_per_batch]
        input_ids = torch.full((len(rows), lengths[rows[0]]), pad_id, dtype=torch.long)  # right-padded, as in training
        for row, j in enumerate(rows):
            input_ids[row, :lengths[j]] = data[sequences[j]]["input_ids"]
        batch = target_layer_features(target, input_ids.to(device), layer_ids, final_hidden=bool(final_hidden or teacher))
        batch, batch_final = batch if final_hidden or teacher else (batch, None)  # (b, T, K*H), (b, T, H)
        batch = batch.to("cpu", dtype)
        for row, j in enumerate(rows):
            features[offsets[j]:offsets[j + 1]] = batch[row, :lengths[j]]
            if final_hidden:
                final[offsets[j]:offsets[j + 1]] = batch_final[row, :lengths[j]].to("cpu", dtype)
        if teacher:  # the whole batch's needed rows through the LM head at once: (rows, V) chunks, not one per sequence
            needed = torch.zeros(input_ids.shape, dtype=torch.bool)  # (b, T) the next token is supervised
            for row, j in enumerate(rows):
                needed[row, :lengths[j] - 1] = data[sequences[j]]["loss_mask"][1:]
            ids, log_probs = next_token_top_k(  # (rows, k) each, in (row, position) order
                batch_final[needed.to(batch_final.device)], target.get_output_embeddings(), teacher_top_k,
                target_config=target.config)
            stored = (offsets[rows][:, None] + torch.arange(needed.shape[1]))[needed]  # each needed row's store index
            teacher[0][stored] = ids.to("cpu", torch.int32)
            teacher[1][stored] = log_probs.cpu()
        progress.update(sum(lengths[j] for j in rows))
    return {"features": features, "offsets": offsets, **({"final": final} if final_hidden else {}),
            **({"teacher_ids": teacher[0], "teacher_log_probs": teacher[1]} if teacher else {})}


def target_text_config(target: str):
    """The target's text config (its decoder's, for a multimodal target): layer count, hidden size, vocabulary."""
    return AutoConfig.from_pretrained(resolve_target(target)).get_text_config()


def build_identity(datamodule: DistillDataModule, text_config, layer_ids: list[int] | None, target_adapter: str | None,
                   dtype: torch.dtype) -> dict:
    """The manifest fields that say which features a build writes: the target (its weights, adapter), the layers,
    the dtype and the tokenized data; not what else it keeps for distillation, nor the share of the data it holds.
    A store whose manifest matches them (differing_fields) holds the features this build would write."""
    layer_ids = list(layer_ids or default_layer_ids(text_config.num_hidden_layers, datamodule.target))
    return {
        "format_version": FORMAT_VERSION, "target": datamodule.target, "target_adapter": target_adapter,
        **({"target_adapter_sha256": adapter_fingerprint(target_adapter)} if target_adapter else {}),
        "target_weights": target_fingerprint(datamodule.target),
        "target_layer_ids": layer_ids, "hidden_size": text_config.hidden_size,
        "dtype": str(dtype).removeprefix("torch."), "data_path": datamodule.data_path,
        "tokenization_key": datamodule.tokenization_key(),
        # The target's last layer is stored as decoding reads it, the decoder's normed output (training/target.py);
        # stores without this key that hold it were built raw and are refused (DistillModule.check_feature_store).
        **({"last_layer": "normed"} if text_config.num_hidden_layers - 1 in layer_ids else {}),
    }


def shard_build_id(handle) -> str | None:
    """The build id in an open shard's metadata; None in a shard built before ids were written."""
    return (handle.metadata() or {}).get(BUILD_ID)


def finished_shards(partial: Path, shards: list[dict], width: int, build_id: str | None) -> set[str]:
    """Shards a previous run of the same build completed (renamed into place, readable, with the planned shape and
    that build's id); an unreadable one (a build killed before its bytes reached the disk, written before shards were
    synced) is redone."""
    done = set()
    for shard in shards:
        file = partial / shard["file"]
        if file.is_file():
            try:
                with safe_open(str(file), framework="pt") as handle:
                    if (handle.get_slice("features").get_shape() == [shard["num_tokens"], width]
                            and shard_build_id(handle) == build_id):
                        done.add(shard["file"])
            except (SafetensorError, OSError):
                print(f"[features] {file} is unreadable; computing it again", flush=True)
    return done


@contextmanager
def write_failure_as_error(path: Path, staging: Path | None = None):
    """A write into a build's <out>.partial/ that fails (a disk filled by another job since the size check, a quota
    reached) as one line, its staging file removed; the finished shards stay, and a rerun resumes after them. Any OS
    error of a write is one line here (not only the disk's refusals, as at other writers): the rerun resumes."""
    try:
        yield
    except (OSError, SafetensorError, WriteFailed) as error:
        if staging is not None:
            staging.unlink(missing_ok=True)
        cause = error.cause if isinstance(error, WriteFailed) else write_failure(error)
        if cause is None:
            raise
        if cause.errno == errno.ENOENT and not path.parent.exists():  # not the disk: the folder went away
            raise DDTreeError(f"writing {path} failed: {path.parent} was removed meanwhile (finished or removed by "
                              "another process building the same store): run the build again; it takes a finished "
                              "store as it is") from None
        failure = WriteFailed(path, cause)
        raise DDTreeError(f"writing {path} failed ({failure.why}): {failure.remedy} or give another --out (or "
                          "data.feature_store), then run the build again: it resumes after the finished "
                          "shards") from None


def build_feature_store(
    datamodule: DistillDataModule,
    out: str | Path,
    layer_ids: list[int] | None = None,  # None: the default ids build_drafter_config picks (default_layer_ids)
    target_adapter: str | None = None,  # PEFT adapter merged into the target, as DistillModule does
    dtype: torch.dtype = torch.bfloat16,  # the target runs and the features are stored in this dtype
    force: bool = False,  # build even over a complete store, of this build or another (replaced once this one is)
    final_hidden: bool = False,  # also keep the target's final hidden states (distillation's soft targets)
    teacher_top_k: int = 0,  # > 0: also keep the target's top k next tokens (distillation's sparse soft targets)
    sequences_per_batch: int = 8,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    max_seconds: float | None = None,  # a time box: end before the shard that would overrun it (module docstring)
    take_finished: bool = False,  # a store found complete once the lock is held is returned unjudged (training's)
) -> Path:
    """Run the datamodule's target over all its tokenized sequences and write their layer features to `out`.

    Returns `out`. A complete store of the same build is left as it is; of another build, it is an
    error; with force, either is built again. See the module docstring for the layout, atomicity, resuming and the
    time box.
    """
    out = Path(out)
    if out.exists() and not is_complete(out) and (not out.is_dir() or any(out.iterdir())):
        # Not a store (a store is complete before it has its name): the user's own file or folder, never replaced.
        raise DDTreeError(f"{out} exists and is not a feature store: give another --out (or data.feature_store), or move "
                          "it away; nothing was written")
    if os.path.ismount(out) and (force or not is_complete(out)):
        # The store is built beside it (<out>.partial, on the parent's disk, whose free space is what the size check
        # reads) and renamed into its place at the end, which a mount point refuses (EBUSY): a traceback once built.
        raise DDTreeError(f"{out} is a mount point, which a finished store cannot replace: give a folder inside it "
                          f"({out / 'features'}); nothing was written")
    if out.is_symlink() and (force or not is_complete(out)):
        # Built beside the link and renamed over it, as over a mount point: nothing went where it points, and the link
        # renamed aside was named as a replaced store that could not be deleted.
        raise DDTreeError(f"{out} is a link to {out.resolve()}: give that folder as --out (or data.feature_store); "
                          "nothing was written")
    blocker = file_in_the_way(out)
    if blocker is not None:  # else found only once the target has loaded and the first shard is computed
        raise DDTreeError(f"cannot write the feature store {out}: {blocker} is a file, not a folder; give --out "
                          "(data.feature_store) in a writable folder")
    with build_lock(out):  # another launch building this store: waited for, then its store is taken
        if take_finished and is_complete(out) and not force:
            # Training, which builds a store it found missing: another launch finished it meanwhile, and it is checked
            # as a store found at launch is (DistillModule.check_feature_store), not refused as another build here.
            return out
        return build_under_lock(datamodule, out, layer_ids, target_adapter, dtype, force, final_hidden, teacher_top_k,
                                sequences_per_batch, max_shard_bytes, max_seconds)


def build_under_lock(datamodule: DistillDataModule, out: Path, layer_ids: list[int] | None, target_adapter: str | None,
                     dtype: torch.dtype, force: bool, final_hidden: bool, teacher_top_k: int, sequences_per_batch: int,
                     max_shard_bytes: int, max_seconds: float | None) -> Path:
    """build_feature_store's build, holding its lock (build_lock)."""
    started = time.monotonic()
    data, pad_id, _ = datamodule.load_tokenized()
    # Time-boxed: in the data's split order, validation first (those `keep` are built whatever the box).
    order, keep = datamodule.split_order(len(data)) if max_seconds is not None else (None, 0)
    config = AutoConfig.from_pretrained(resolve_target(datamodule.target))  # read once: the text config and the logit transform
    text_config = config.get_text_config()
    identity = build_identity(datamodule, text_config, layer_ids, target_adapter, dtype)
    num_layers, hidden_size = text_config.num_hidden_layers, text_config.hidden_size
    layer_ids = identity["target_layer_ids"]
    # Repeated ids are stored as given, a copy each, as the drafter reads them online: a run from before 2026-12-03
    # read the default [1, 2, 2, 2, 3] of a 6-layer target, and its resume keeps them (training.train.run_layer_ids)
    if not all(0 <= i < num_layers for i in layer_ids):
        raise DDTreeError(f"model.target_layer_ids {layer_ids} must be within 0..{num_layers - 1} "
                          f"(target {datamodule.target} has {num_layers} layers)")
    if teacher_top_k > text_config.vocab_size:
        raise DDTreeError(f"model.distill_top_k={teacher_top_k} is above target {datamodule.target}'s vocabulary of "
                          f"{text_config.vocab_size} tokens: set it at most {text_config.vocab_size}")
    width, itemsize, lengths = len(layer_ids) * hidden_size, dtype.itemsize, data.lengths()
    if order is not None:
        lengths = [lengths[i] for i in order]  # in store order
    row_width = width + (hidden_size if final_hidden else 0)  # values stored per token in `dtype`
    teacher_bytes = 8 * teacher_top_k  # per token: int32 ids and float32 log-probabilities
    # A top-k teacher is the softmax of the target's own logits: where its family transforms the LM head's output
    # (training.target.logit_transform) the manifest says how, and a store built before the teacher took the transform
    # (none recorded) differs in it, so it is rebuilt, not reused; other targets' manifests are as they were.
    transform = logit_transform(config) if teacher_top_k else None
    manifest = {
        **identity,
        "num_sequences": len(lengths), "total_tokens": sum(lengths),
        "final_hidden": final_hidden, "teacher_top_k": teacher_top_k,
        **({"teacher_logits": transform} if transform else {}),
        BUILD_ID: uuid.uuid4().hex,  # a resume keeps its unfinished build's
        "shards": plan_shards(lengths, row_width * itemsize + teacher_bytes, max_shard_bytes),
        **({"sequence_ids": order} if order is not None else {}),
        "lengths": lengths,  # last: the long list, below what a reader looks for
    }
    # this data's key, and those an earlier version gave it where its tokenization was the same (a store recorded them)
    same_data = datamodule.tokenization_keys(teacher=bool(teacher_top_k))
    if is_complete(out) and not force:
        existing = read_manifest(out / MANIFEST)
        # The same build whatever share of the data it holds (the tokenization key names the data and its lengths).
        fields = [key for key in manifest if key not in (*COVERAGE_FIELDS, BUILD_ID)]
        differing = differing_fields(existing, manifest, same_data, fields)
        if not differing and not lacks_validation_split(existing, datamodule):
            print(f"[features] {out} already holds these features ({coverage(existing)}); nothing to do", flush=True)
            return out
        if not differing:
            raise DDTreeError(f"{out} holds a feature store of {coverage(existing)} without this data's "
                              "validation split: it was built under another data.seed or data.val_fraction, and "
                              "training refuses it; pass --force (FORCE=1) to replace it, or give another --out")
        def shown(field: str) -> str:  # a value short enough to read in one line, beside the field's name
            values = existing.get(field), manifest.get(field)
            return f"{field} ({values[0]} there, {values[1]} here)" if len(str(values)) <= 60 else field

        # Only the dtype differing: training takes that store as it is (DistillModule.check_feature_store casts it and
        # says so), which a machine whose auto precision is the other one needs to know before it builds hours anew.
        usable = (f"; training reads it as it is, cast to {manifest['dtype']} (`--dtype {existing.get('dtype')}` here "
                  "says it is built)" if differing == ["dtype"] else "")
        raise DDTreeError(f"{out} holds a feature store of another build (differs in "
                          f"{', '.join(shown(field) for field in differing)}){usable}; pass --force (FORCE=1) to "
                          "replace it, or give another --out")

    partial = partial_path(out)
    done: set[str] = set()
    if partial.exists():
        previous = partial / MANIFEST
        try:
            previous_manifest = read_manifest(previous) if previous.is_file() else {}
        except DDTreeError:  # unreadable: an unfinished build of unknown settings, started over below
            previous_manifest = {}
        planned = {**OPTIONAL_MANIFEST_FIELDS, **manifest}  # read_manifest fills the optional fields in
        # Resumed only where the same shards are planned: every field the same, coverage too, or of the same content
        # (data, target or adapter at another path: a preempted build rescheduled on a node with its own copies).
        fields = (planned.keys() | previous_manifest.keys()) - {BUILD_ID}
        if previous_manifest and not differing_fields(previous_manifest, planned, same_data, fields):
            manifest[BUILD_ID] = previous_manifest[BUILD_ID]  # what its finished shards hold
            done = finished_shards(partial, manifest["shards"], width, manifest[BUILD_ID])
        elif previous_manifest.get("dtype") not in (None, manifest["dtype"]) and not force:
            # The precision can change without the user asking (trainer.precision: auto on another machine):
            # say so rather than silently dropping finished shards.
            raise DDTreeError(f"{partial} holds an unfinished build in {previous_manifest['dtype']}, this build is in "
                              f"{manifest['dtype']}: finish it in {previous_manifest['dtype']} (make features: --dtype "
                              f"{previous_manifest['dtype']}; training: --trainer.precision="
                              f"{LIGHTNING_PRECISION[parse_dtype(previous_manifest['dtype'])]}), or start over in "
                              f"{manifest['dtype']}: make features with --force (FORCE=1)")  # training has no --force
        else:
            print(f"[features] {partial} holds an unfinished build of other settings; starting over", flush=True)
            shutil.rmtree(partial)
    written = sum(s["num_tokens"] for s in manifest["shards"] if s["file"] in done)
    total_bytes = manifest["total_tokens"] * (row_width * itemsize + teacher_bytes)
    remaining = (manifest["total_tokens"] - written) * (row_width * itemsize + teacher_bytes)
    free = free_bytes(partial)
    print(f"[features] estimated size {format_bytes(total_bytes)} ({manifest['total_tokens']:,} tokens x "
          f"{len(layer_ids)} layers{' + the final hidden state' if final_hidden else ''} x {hidden_size} x "
          f"{itemsize} bytes, {manifest['dtype']}{f'; + the top {teacher_top_k} next tokens' if teacher_top_k else ''})"
          + (f", {format_bytes(total_bytes - remaining)} already written" if done else "")
          + f"; {format_bytes(free)} free under {partial.parent}", flush=True)
    if remaining > free:
        raise DDTreeError(f"the feature store needs {format_bytes(remaining)} more but only {format_bytes(free)} is free "
                          f"under {partial.parent}: free some space or give another --out (or "
                          "data.feature_store)")

    with unwritable_as_error(out):  # a read-only mount: said before the target loads, not as mkdir's traceback
        partial.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target, _ = load_frozen_target(datamodule.target, dtype, target_adapter, device=device)
    with write_failure_as_error(partial / MANIFEST):
        write_json_atomic(partial / MANIFEST, manifest)
    # The time box's clock: seconds spent up to the last finished shard, and the tokens and seconds of the shards
    # computed, for the speed; a resumed build goes on from its interrupted run's figures rather than a fresh box.
    clock = json.loads((partial / BOX_CLOCK).read_text()) if done and (partial / BOX_CLOCK).is_file() else {}
    spent_before = clock.get("seconds", 0.0)
    computed, computing = clock.get("computed_tokens", 0), clock.get("computing_seconds", 0.0)
    if max_seconds is not None:
        print(f"[features] time box {max_seconds / 60:.1f} min (data.store_max_minutes): where the machine is too slow "
              "for every sequence, the build ends before the shard that would overrun it", flush=True)
    # The bar counts the whole plan; boxed, its estimate is the whole store's, not when the box ends the build.
    desc = "features" if max_seconds is None else f"features (box {max_seconds / 60:.1f} min)"
    # None: resuming a build begun before ids were written, whose finished shards hold none
    shard_metadata = None if manifest[BUILD_ID] is None else {BUILD_ID: manifest[BUILD_ID]}
    with tqdm(total=manifest["total_tokens"], initial=written, unit="tok", desc=desc) as progress:
        for shard in manifest["shards"]:
            if shard["file"] in done:
                continue
            # The box never ends a build before its first shard of training sequences: the validation split alone
            # would leave training nothing to draw from.
            trains = any(s["first_sequence"] + s["num_sequences"] > keep for s in manifest["shards"] if s["file"] in done)
            if max_seconds is not None and computed and trains and shard["first_sequence"] >= keep:
                finish = spent_before + time.monotonic() - started + shard["num_tokens"] * computing / computed
                if finish > max_seconds:
                    break  # the rest of the plan stays out; `done` is what the store holds
            first = shard["first_sequence"]
            sequences = (order[first:first + shard["num_sequences"]] if order is not None
                         else list(range(first, first + shard["num_sequences"])))
            shard_started = time.monotonic()
            tensors = shard_tensors(target, data, sequences, layer_ids, width, pad_id, dtype, sequences_per_batch,
                                    progress, final_hidden, teacher_top_k)
            # Not ddtree.files.atomic_file: save_file streams to a path, a file object would need the
            # whole shard serialized in memory first. It creates the file 0600 whatever the umask, so the
            # mode is set as open() would have (a store on shared storage is read by other processes).
            staging = partial / f".{shard['file']}.tmp"
            with write_failure_as_error(partial / shard["file"], staging):
                save_file(tensors, str(staging), metadata=shard_metadata)
                follow_umask(staging)
                with staging.open("rb") as handle:  # on disk before the rename names it finished (a power cut)
                    os.fsync(handle.fileno())
                os.replace(staging, partial / shard["file"])  # only a complete shard ever has its final name
            done.add(shard["file"])
            computed, computing = computed + shard["num_tokens"], computing + time.monotonic() - shard_started
            if max_seconds is not None:
                with write_failure_as_error(partial / BOX_CLOCK):
                    write_json_atomic(partial / BOX_CLOCK, {"seconds": spent_before + time.monotonic() - started,
                                                            "computed_tokens": computed, "computing_seconds": computing})

    boxed = len(done) < len(manifest["shards"])
    if boxed:  # the time box ended it: the store holds the finished shards
        manifest = {**manifest, "shards": [shard for shard in manifest["shards"] if shard["file"] in done]}
        with write_failure_as_error(partial / MANIFEST):
            write_json_atomic(partial / MANIFEST, manifest)
    (partial / BOX_CLOCK).unlink(missing_ok=True)  # (after: a rerun of a build stopped above resumes on its clock)
    for staging in partial.glob(".shard-*.tmp"):  # a shard whose write was interrupted (Ctrl-C, a kill) and which
        staging.unlink()  # this build's box left out: it would stay in the store for good, up to MAX_SHARD_BYTES
    if out.exists():  # --force: the old store goes only now that the new one is complete (replace_folder)
        # Asides earlier --force builds could not delete (a shard a reader held open on NFS, a kill mid-delete) are
        # tried again first; the lock keeps other builds out. (.<out>.replaced: the one name before 2026-12-04.)
        for earlier in [out.with_name(f".{out.name}.replaced"),
                        *out.parent.glob(f".{glob.escape(out.name)}.replaced-{'[0-9a-f]' * 8}")]:
            shutil.rmtree(earlier, ignore_errors=True)
    replace_folder(partial, out, "store")
    held_bytes = sum(shard["num_tokens"] for shard in manifest["shards"]) * (row_width * itemsize + teacher_bytes)
    print(f"[features] wrote {out}: {coverage(manifest)}, {format_bytes(held_bytes)}; "
          f"train from it with --data.feature_store {out}", flush=True)
    if boxed:
        print(f"[features] the time box (data.store_max_minutes, {max_seconds / 60:.1f} min) ended the build: "
              "training draws from the sequences it holds; a machine with more time can build them all with "
              f"`{REBUILD}` FORCE=1 and data.store_max_minutes null", flush=True)
    return out


def coverage(manifest: dict) -> str:
    """"2042 sequences", or "780 of 2042 sequences (time-boxed)"."""
    held = sum(shard["num_sequences"] for shard in manifest["shards"])
    total = len(manifest["lengths"])
    return f"{total} sequences" if held == total else f"{held} of {total} sequences (time-boxed)"


def store_seconds(datamodule: DistillDataModule) -> float | None:
    """data.store_max_minutes in seconds: the build's time box; None: no box."""
    return None if datamodule.store_max_minutes is None else 60.0 * datamodule.store_max_minutes


def store_teacher(distill_weight: float, distill_top_k: int) -> tuple[bool, int]:
    """(final_hidden, teacher_top_k): what a recipe's store keeps for distillation (model.distill_weight > 0): the
    target's top k next tokens with model.distill_top_k k, else its final hidden states; neither without it."""
    distill = distill_weight > 0
    return distill and not distill_top_k, distill_top_k if distill else 0


def default_store_path(recipe: str, datamodule: DistillDataModule, final_hidden: bool = False,
                       teacher_top_k: int = 0) -> Path:
    """<ddtree cache>/features/<recipe>-<tokenization key>[-final][-top<k>]: another data, tokenizer or max_length is
    another folder, and so is a store with final hidden states or a top-k teacher (a run without distillation keeps
    the smaller one). A finished or unfinished store named by the key an earlier version gave the same tokenization
    (DistillDataModule.tokenization_keys) is taken where there is one."""
    suffix = ("-final" if final_hidden else "") + (f"-top{teacher_top_k}" if teacher_top_k else "")
    current, *earlier = (cache_dir() / "features" / f"{recipe}-{key}{suffix}"
                         for key in datamodule.tokenization_keys(teacher=bool(teacher_top_k)))
    # a store named by an earlier version serves, and an unfinished build of one resumes where it stopped
    return next((path for path in earlier if is_complete(path) or partial_path(path).exists()), current)


def resolve_store_path(feature_store: str | None, recipe: str, datamodule: DistillDataModule,
                       final_hidden: bool = False, teacher_top_k: int = 0, *, layer_ids: list[int] | None = None,
                       target_adapter: str | None = None, dtype: torch.dtype = torch.bfloat16) -> Path | None:
    """data.feature_store as a folder: None stays None (online features), "auto" is the recipe's default folder.

    A run that needs no final hidden states (nor a teacher) also takes a recipe's store that has them, when that
    one is built and the smaller one is not, and holds the features this run's build would write (layer_ids,
    target_adapter and dtype as build_feature_store takes them; the target and data are the datamodule's): nothing is
    built twice. Of several, the one with final hidden states, else the smallest top-k teacher's.
    """
    if not feature_store:
        return None
    if feature_store != AUTO_STORE:
        return Path(feature_store)
    store = default_store_path(recipe, datamodule, final_hidden, teacher_top_k)
    if final_hidden or teacher_top_k or is_complete(store):
        return store
    prefix = f"{store.name}-top"  # the teacher sizes built beside it; default_store_path names each folder
    sizes = sorted(int(k) for k in (path.name[len(prefix):] for path in store.parent.glob(f"{prefix}*")) if k.isdigit())
    richer = [(default_store_path(recipe, datamodule, final_hidden=True), False),
              *((default_store_path(recipe, datamodule, teacher_top_k=k), True) for k in sizes)]  # (path, teacher)
    built = [(path, teacher) for path, teacher in richer if is_complete(path)]
    if not built:
        return store
    # One built for other layers, another target or adapter, or in another dtype holds other features: a run would
    # stop on it (check_feature_store), and `make features` would take it as this build done.
    identity = build_identity(datamodule, target_text_config(datamodule.target), layer_ids, target_adapter, dtype)
    return next((path for path, teacher in built
                 if holds_features(path, identity, datamodule.tokenization_keys(teacher), datamodule)), store)


def holds_features(store: Path, identity: dict, same_data: tuple[str, ...], datamodule: DistillDataModule) -> bool:
    """Whether a finished store holds the features of a build of this identity (build_identity), and the
    datamodule's validation split where it is time-boxed; an unreadable manifest holds none."""
    try:
        manifest = read_manifest(store / MANIFEST)
    except DDTreeError:
        return False
    return (not differing_fields(manifest, identity, same_data, identity.keys())
            and not lacks_validation_split(manifest, datamodule))


def lacks_validation_split(manifest: dict, datamodule: DistillDataModule) -> bool:
    """Whether a time-boxed store lacks some of the datamodule's validation split, which its build stores first: it
    was built under another data.seed or data.val_fraction, and training refuses it (DistillDataModule.setup). Its
    coverage is no field of the build (COVERAGE_FIELDS), so this is judged apart."""
    ids = manifest["sequence_ids"]
    if ids is None:  # a store in the data's own order holds every sequence
        return False
    held = {ids[p] for shard in manifest["shards"]
            for p in range(shard["first_sequence"], shard["first_sequence"] + shard["num_sequences"])}
    order, num_val = datamodule.split_order(len(manifest["lengths"]))
    return not held.issuperset(order[:num_val])
