"""Training data: conversations -> chat-template tokens with an assistant-only loss mask -> batches.

    from training.data import DistillDataModule
    dm = DistillDataModule(target="smollm2-135m", data_path="data/smollm2-135m", max_length=2048, batch_size=4)
    trainer.fit(module, datamodule=dm)   # Trainer(use_distributed_sampler=False): see ResumableDataLoader

Pieces, top to bottom:
  - read_messages_jsonl / load_conversations: JSONL or Parquet files, saved `datasets` folders or
    Hub names -> a list of {"id", "messages"} records, with errors naming the file and line.
  - tokenize_conversation: render with the tokenizer's chat template; loss_mask = 1 on each
    assistant turn's content and its end-of-turn token (not the role header, not what the template
    adds after the end-of-turn token). Spans are found by rendering growing prefixes of the
    conversation (the prompt up to each assistant turn, with the generation prompt) and diffing
    against the full render; the render is then tokenized span by span.
  - DistillDataModule: tokenizes once into a cache (prepare_data), loads it on every rank (setup),
    serves right-padded batches {input_ids (B,T) long, loss_mask (B,T) bool, attention_mask (B,T) bool},
    plus features (B,T,K*H) read from an offline feature store when one is given (training/features.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from ddtree.bench import iter_json_lines
from ddtree.targets import DDTreeError
from training.features import AUTO_STORE, FeatureStore

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")


# ----------------------------------------------------------------------------- reading files

def check_messages(messages, where: str) -> list[dict]:
    """Raise a DDTreeError naming `where` unless messages is a non-empty list of {role, content: str}."""
    if not isinstance(messages, list) or not messages:
        raise DDTreeError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DDTreeError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        if message["role"] not in ROLES:
            raise DDTreeError(f"{where}: messages[{i}].role is {message['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DDTreeError(f"{where}: messages[{i}].content must be a string, got {type(message['content']).__name__}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def finish_reason_of(row) -> dict:
    """{"finish_reason": ...} when the row says why its last answer ended (regenerated data does)."""
    reason = row.get("finish_reason")
    return {"finish_reason": reason} if reason else {}


def read_messages_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file of {"id"?, "messages": [...]} records (prompts or whole conversations).

    Records without an id get "<file stem>-<line number>". Errors name the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DDTreeError(f"{path}: no such file; give a JSONL file of {{\"id\", \"messages\"}} records")
    records, seen_ids = [], set()
    for line_number, where, record in iter_json_lines(path):
        if not isinstance(record, dict) or "messages" not in record:
            raise DDTreeError(f"{where}: each line must be an object with a 'messages' list")
        messages = check_messages(record["messages"], where)
        record_id = str(record.get("id", f"{path.stem}-{line_number}"))
        if record_id in seen_ids:
            raise DDTreeError(f"{where}: duplicate id {record_id!r}; ids must be unique")
        seen_ids.add(record_id)
        records.append({"id": record_id, "messages": messages, **finish_reason_of(record)})
    if not records:
        raise DDTreeError(f"{path}: the file is empty; it needs one JSON object per line")
    return records


def rows_to_records(rows, source: str) -> list[dict]:
    """Validate rows of a datasets/Parquet table ({"messages", "id"?}) into records."""
    records = []
    for i, row in enumerate(rows):
        if "messages" not in row:
            raise DDTreeError(f"{source}: row {i} has no 'messages' column (columns: {', '.join(row)})")
        messages = check_messages(row["messages"], f"{source} row {i}")
        records.append({"id": str(row.get("id") or f"row-{i}"), "messages": messages, **finish_reason_of(row)})
    return records


def load_conversations(source: str | Path) -> list[dict]:
    """Load {"id", "messages"} records from a JSONL/Parquet file, a saved `datasets` folder or a Hub name.

    Prompt files load too (no assistant turn): tokenizing them then says that responses are
    missing. Hub names need internet; everything else is local.
    """
    path = Path(source)
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            records = read_messages_jsonl(path)
        elif path.suffix == ".parquet":
            from datasets import Dataset

            records = rows_to_records(Dataset.from_parquet(str(path)), str(path))
        else:
            raise DDTreeError(f"{path}: unknown file type {path.suffix!r}; give a .jsonl or .parquet file or a saved datasets folder")
    elif path.is_dir():
        from datasets import DatasetDict, load_from_disk

        if not ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
            raise DDTreeError(f"{path}: not a saved `datasets` folder (no state.json or dataset_dict.json)")
        loaded = load_from_disk(str(path))
        if isinstance(loaded, DatasetDict):
            split = "train" if "train" in loaded else next(iter(loaded))
            loaded = loaded[split]
        records = rows_to_records(loaded, str(path))
    elif str(source).count("/") == 1 and not str(source).startswith((".", "/")):
        from datasets import load_dataset

        try:
            records = rows_to_records(load_dataset(str(source), split="train"), str(source))
        except DDTreeError:
            raise
        except Exception as error:  # network, auth or format problems all end up here
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise DDTreeError(f"could not load Hub dataset {source!r}: {first_line}; without internet give a local file") from error
    else:
        raise DDTreeError(f"{source}: no such file or folder (and not a Hub dataset name owner/name)")
    if not records:
        raise DDTreeError(f"{source}: no conversations in it")
    return records


# ----------------------------------------------------------------------------- chat template + loss mask

def render_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a prompt ending with the assistant header, as decoding feeds it to the target."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes its own BOS/role tokens; the tokenizer must not add another BOS.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def end_of_turn_text(tokenizer) -> str:
    """The special token the chat template writes right after an assistant's content.

    Found by rendering a probe conversation: SmolLM2 and Qwen3 close a turn with "<|im_end|>\\n",
    Llama-3 with "<|eot_id|>"; only the special token itself is supervised (the model stops there;
    what the template writes after it is never generated).
    """
    probe = "PROBE-ANSWER-7f3a"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "probe"}, {"role": "assistant", "content": probe}], tokenize=False
    )
    suffix = text[text.rindex(probe) + len(probe):]
    special = sorted(
        (t for t in tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()) if t and suffix.startswith(t)),
        key=len, reverse=True,
    )
    if not special:
        raise DDTreeError(
            f"the chat template of {tokenizer.name_or_path!r} ends an assistant turn with {suffix[:30]!r}, "
            "not with a special token; the loss mask needs an end-of-turn token"
        )
    return special[0]


def render_with_loss_mask(tokenizer, messages: list[dict], eot: str | None = None) -> tuple[list[int], list[int]]:
    """Chat-template token ids of a whole conversation and the 0/1 mask of assistant tokens (untruncated).

    For assistant turn i the render of messages[:i] with the generation prompt is a prefix of the
    full render; the turn's content is the first occurrence of that content after this prefix (so
    a template's own additions such as Qwen3's empty <think></think> block stay unmasked) and
    ends at the next end-of-turn token, which is included.
    """
    eot = eot or end_of_turn_text(tokenizer)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0  # character spans [start, end) to supervise
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            prefix = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False) if i else ""
        except Exception:  # some templates reject a conversation that does not start with a user turn
            prefix = ""
        search_from = max(cursor, len(prefix) if text.startswith(prefix) else cursor)
        content = message["content"].strip()  # templates such as Llama-3's trim the content
        start = text.find(content, search_from) if content else -1
        content_end = start + len(content) if start >= 0 else search_from
        eot_at = text.find(eot, content_end)
        if (content and start < 0) or eot_at < 0 or text[content_end:eot_at].strip():
            raise DDTreeError(
                f"assistant turn {i} ({content[:40]!r}...) is not followed by {eot!r} in the chat template's "
                "render; this template rewrites message content in a way the loss mask cannot follow"
            )
        spans.append((start if content else eot_at, eot_at + len(eot)))
        cursor = eot_at + len(eot)
    # Tokenize piece by piece (unsupervised text, supervised span, ...): the prompt part then has
    # exactly the ids decoding feeds the target, and the answer the ids of its own text, with no
    # BPE merge across the boundary (which tokenizing the whole render at once can produce).
    input_ids, loss_mask, cursor = [], [], 0
    for start, end in spans + [(len(text), len(text))]:
        for piece, bit in ((text[cursor:start], 0), (text[start:end], 1)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                input_ids += piece_ids
                loss_mask += [bit] * len(piece_ids)
        cursor = end
    return input_ids, loss_mask


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int) -> dict[str, list[int]]:
    """{"input_ids", "loss_mask"} of one conversation, truncated to max_length tokens.

    loss_mask is 1 on each assistant turn's content and end-of-turn token, 0 elsewhere. A
    conversation without assistant tokens is an error (it is a prompt, not training data).
    """
    input_ids, loss_mask = render_with_loss_mask(tokenizer, messages)
    if not any(loss_mask):
        raise DDTreeError("the conversation has no assistant tokens to train on; generate responses first (make data)")
    return {"input_ids": input_ids[:max_length], "loss_mask": loss_mask[:max_length]}


def tokenize_conversations(tokenizer, records: list[dict], max_length: int, min_supervised_tokens: int,
                           source: str = "the data") -> tuple[list[dict], dict]:
    """Tokenize many conversations; skip (and count) those without enough supervised tokens.

    A record with finish_reason "length" has a last answer that the target did not finish (it
    hit max_new_tokens): the end-of-turn token the template writes after it was never the
    target's choice, so that token and everything after it are cut instead of supervised.
    """
    eot = end_of_turn_text(tokenizer)
    kept, counts = [], {"conversations": len(records), "no_assistant": 0, "too_few_supervised": 0, "truncated": 0}
    for record in records:
        input_ids, loss_mask = render_with_loss_mask(tokenizer, record["messages"], eot)
        if not any(loss_mask):
            counts["no_assistant"] += 1
            continue
        if record.get("finish_reason") == "length":
            last = len(loss_mask) - 1 - loss_mask[::-1].index(1)  # the last answer's end-of-turn token
            input_ids, loss_mask = input_ids[:last], loss_mask[:last]
        if len(input_ids) > max_length:
            counts["truncated"] += 1
            input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if sum(loss_mask) < min_supervised_tokens:
            counts["too_few_supervised"] += 1
            continue
        kept.append({"input_ids": input_ids, "loss_mask": loss_mask})
    counts["kept"] = len(kept)
    log.info("tokenized %s: %s", source, counts)
    if not kept:
        hint = (" (no assistant turns at all: this looks like a prompt file; generate responses with "
                "data/regenerate.py first)") if counts["no_assistant"] == len(records) else ""
        raise DDTreeError(
            f"{source}: none of {len(records)} conversations is usable: {counts['no_assistant']} have no assistant "
            f"tokens, {counts['too_few_supervised']} have fewer than {min_supervised_tokens} supervised tokens "
            f"within max_length {max_length}{hint}"
        )
    return kept, counts


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

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, end = self.offsets[index].item(), self.offsets[index + 1].item()
        item = {"input_ids": self.input_ids[start:end].long(), "loss_mask": self.loss_mask[start:end]}
        if self.features is not None:
            item["features"] = self.features[index]  # (T_i, K*H)
        return item


def collate(examples: list[dict[str, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence: input_ids (B,T) long, loss_mask/attention_mask (B,T) bool.

    Items with features (an offline store) give features (B,T,K*H) in the store's dtype, zero-padded.
    """
    width = max(len(e["input_ids"]) for e in examples)
    batch = {
        "input_ids": torch.full((len(examples), width), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((len(examples), width), dtype=torch.bool),
        "attention_mask": torch.zeros((len(examples), width), dtype=torch.bool),
    }
    if "features" in examples[0]:
        first = examples[0]["features"]
        batch["features"] = torch.zeros((len(examples), width, first.shape[-1]), dtype=first.dtype)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        batch["input_ids"][row, :n] = example["input_ids"]
        batch["loss_mask"][row, :n] = example["loss_mask"]
        batch["attention_mask"][row, :n] = True
        if "features" in batch:
            batch["features"][row, :n] = example["features"]
    return batch


class Collator:
    """Picklable collate_fn (worker processes need to pickle it)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, examples):
        return collate(examples, self.pad_id)


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
        order += order[: len(self) * self.world_size - self.num_items]  # equal share per rank
        mine = order[self.rank::self.world_size]
        start, self.start = self.start, 0
        yield from mine[start:]


class ResumableDataLoader(DataLoader):
    """A DataLoader with state_dict/load_state_dict, so Lightning restores its position on resume.

    Lightning saves the state of a train loader that has these two methods in every checkpoint
    and loads it before iterating again. The state is (epoch, batches already yielded this
    epoch); resuming rebuilds the same epoch permutation and skips the yielded batches' indices.
    This is exact because Lightning does not prefetch from a loader with a length, so "yielded"
    equals "trained on" when a checkpoint is written. Use Trainer(use_distributed_sampler=False):
    the sampler already splits the data across ranks.
    """

    def __init__(self, dataset: Dataset, sampler: EpochShuffleSampler, **kwargs):
        super().__init__(dataset, sampler=sampler, **kwargs)
        self.batches_yielded = 0

    def __iter__(self):
        # A generator: nothing runs until the first batch is asked for, i.e. after Lightning's
        # set_epoch and load_state_dict, whatever order it calls them in.
        self.batches_yielded = self.sampler.start // self.batch_size
        for batch in super().__iter__():
            self.batches_yielded += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.sampler.epoch, "batches_yielded": self.batches_yielded,
                "num_items": self.sampler.num_items, "world_size": self.sampler.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state["num_items"] != self.sampler.num_items or state["world_size"] != self.sampler.world_size:
            raise DDTreeError(
                f"the checkpoint's train loader had {state['num_items']} sequences on {state['world_size']} ranks, "
                f"this run has {self.sampler.num_items} on {self.sampler.world_size}: resume with the same data and devices"
            )
        self.sampler.epoch = state["epoch"]
        self.sampler.start = state["batches_yielded"] * self.batch_size
        self.batches_yielded = state["batches_yielded"]


# ----------------------------------------------------------------------------- the DataModule
TOKENIZATION_VERSION = 2  # bump when render_with_loss_mask changes, to invalidate cached tokenizations


def source_fingerprint(source: str) -> str:
    """Identify a data source by content-ish metadata: path, sizes and mtimes (a Hub name as is)."""
    path = Path(source)
    if not path.exists():
        return str(source)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return json.dumps([str(path.resolve())] + [(str(p.relative_to(path) if path.is_dir() else p.name),
                                                 p.stat().st_size, p.stat().st_mtime_ns) for p in files])


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
    ):
        super().__init__()
        if not 0 <= val_fraction < 1:
            raise DDTreeError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if max_length < 2 or batch_size < 1:
            raise DDTreeError(f"max_length ({max_length}) must be >= 2 and batch_size ({batch_size}) >= 1")
        self.save_hyperparameters()
        self.target, self.data_path, self.max_length = target, str(data_path), max_length
        self.batch_size, self.num_workers, self.val_fraction, self.seed = batch_size, num_workers, val_fraction, seed
        self.min_supervised_tokens = min_supervised_tokens
        if cache_dir is None:
            from ddtree.targets import cache_dir as ddtree_cache_dir

            cache_dir = str(ddtree_cache_dir() / "tokenized")
        self.cache_dir = Path(cache_dir)
        self.feature_store = feature_store
        self.store: FeatureStore | None = None  # opened in setup
        self.train_set: TokenizedConversations | None = None
        self.val_set: TokenizedConversations | None = None
        self.pad_id = 0

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        from ddtree.targets import resolve_target

        return AutoTokenizer.from_pretrained(resolve_target(self.target))

    def cache_path(self, tokenizer) -> Path:
        key = json.dumps([TOKENIZATION_VERSION, source_fingerprint(self.data_path), tokenizer.name_or_path,
                          tokenizer.chat_template, len(tokenizer), self.max_length, self.min_supervised_tokens])
        return self.cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.pt"

    def prepare_data(self) -> None:
        """Tokenize once (rank 0) into the cache; assigns no state, as Lightning requires."""
        tokenizer = self.load_tokenizer()
        path = self.cache_path(tokenizer)
        if path.exists():
            return
        records = load_conversations(self.data_path)
        examples, counts = tokenize_conversations(tokenizer, records, self.max_length, self.min_supervised_tokens, self.data_path)
        if counts["truncated"]:
            log.warning("%d of %d conversations were truncated to max_length %d",
                        counts["truncated"], counts["conversations"], self.max_length)
        data = TokenizedConversations.from_examples(examples)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            torch.save({"input_ids": data.input_ids, "loss_mask": data.loss_mask, "offsets": data.offsets,
                        "pad_id": pad_id, "counts": counts, "source": self.data_path}, tmp)
            os.replace(tmp, path)  # other ranks/processes never see a half-written cache
        finally:
            Path(tmp).unlink(missing_ok=True)

    def tokenization_key(self) -> str:
        """Names this data + tokenizer + max_length (the tokenized cache's file name); feature stores record it."""
        return self.cache_path(self.load_tokenizer()).stem

    def load_tokenized(self) -> tuple[TokenizedConversations, int, str]:
        """The whole tokenized data in cache order (train and val), its pad id and its tokenization key."""
        path = self.cache_path(self.load_tokenizer())
        if not path.exists():  # used without a Trainer, or on a node where prepare_data did not run
            self.prepare_data()
        cached = torch.load(path, weights_only=True)
        return TokenizedConversations(cached["input_ids"], cached["loss_mask"], cached["offsets"]), cached["pad_id"], path.stem

    def setup(self, stage: str | None = None) -> None:
        """Load the cached tokenization (on every rank), open the feature store if any, split train/val with the seed."""
        if self.train_set is not None:
            return
        data, self.pad_id, key = self.load_tokenized()
        if self.feature_store == AUTO_STORE:
            raise DDTreeError('data.feature_store "auto" names the recipe\'s store: train through training.train, '
                              "or give the store's folder")
        if self.feature_store:
            self.store = FeatureStore(self.feature_store)
            self.store.check_matches(key, data.lengths())
            data.features = self.store
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(self.seed)).tolist()
        num_val = min(len(data) - 1, max(1, round(len(data) * self.val_fraction))) if self.val_fraction > 0 else 0
        self.val_set = Subset(data, order[:num_val])
        self.train_set = Subset(data, order[num_val:])
        log.info("data %s: %d train / %d val sequences", self.data_path, len(self.train_set), len(self.val_set))

    def train_dataloader(self) -> ResumableDataLoader:
        rank, world = (self.trainer.global_rank, self.trainer.world_size) if self.trainer is not None else (0, 1)
        sampler = EpochShuffleSampler(len(self.train_set), self.seed, rank, world)
        return ResumableDataLoader(self.train_set, sampler, batch_size=self.batch_size, num_workers=self.num_workers,
                                   collate_fn=Collator(self.pad_id), persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          collate_fn=Collator(self.pad_id))
