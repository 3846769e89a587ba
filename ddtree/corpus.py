"""Corpus lookup: what the target's own replies most often said next, grafted into each tree beside the drafter's.

    corpus = CorpusLookup.from_conversations("replies.jsonl", tokenizer)   # the replies a drafter trained on
    generate(target, prompt, "ddtree", drafter, corpus=corpus)             # `ddtree bench --corpus replies.jsonl`
    corpus = CorpusLookup.from_file(drafter_folder / CORPUS_FILE)           # what a recipe with model.corpus ships

A recipe with `model.corpus: true` writes its training replies' token ids to <run>/corpus.safetensors, with a record
of the tokenizer that gave them (`write_replies`), and every export of that run carries the file beside the weights:
decoders that load the drafter then graft from it by default (DrafterRunner.default_corpus; `--corpus none` leaves it
out), once the target's tokenizer is found to spell its ids alike (CorpusLookup.check_tokenizer).

A target repeats its own phrasing from answer to answer ("Here's an example of how you can use ..."). The index
maps every run of `ngram` tokens in the replies to the continuation that followed it, token by token the one most
of its occurrences took (majority_path), and a round grafts that continuation of the context's last `ngram`
tokens as one more path of the tree, within the budget (ddtree.decoding.draft_tree). Like every draft, it only
decides how much one target forward confirms; what is committed stays the target's own choice (docs/decoding.md, Corpus lookup).
"""

from __future__ import annotations

import hashlib
import numbers
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from .errors import DDTreeError, check_text, error_line
from .files import atomic_file, iter_json_lines, not_a_file
from .names import CORPUS_FILE  # noqa: F401 (importers read it from here)

NGRAM = 3  # tokens of context matched; 3 is what the context lookup starts from too (ddtree/tree.py)
LENGTH = 7  # the longest continuation kept: a block of 8 drafts at most 7 tokens


def write_replies(path: str | Path, replies: Iterable[list[int]], tokenizer) -> int:
    """Write token-id sequences to a safetensors file (one flat int32 `tokens`, int64 `offsets`), with what the ids
    mean in its metadata (tokenizer_record: the `tokenizer` that gave them); return the count.

    4 bytes a token: the default recipe's 2001 training replies (396,841 tokens) take 1.6 MB.
    """
    replies = [list(reply) for reply in replies]
    offsets = torch.tensor([0] + [len(reply) for reply in replies], dtype=torch.int64).cumsum(0)
    tokens = torch.tensor([token for reply in replies for token in reply], dtype=torch.int32)
    with atomic_file(path, "wb") as handle:
        handle.write(save({"tokens": tokens, "offsets": offsets}, metadata=tokenizer_record(tokenizer)))
    return len(replies)


def tokenizer_record(tokenizer) -> dict[str, str]:
    """What a corpus file says of the tokenizer its ids came from (safetensors metadata: strings): its name, the size of
    its vocabulary (without the tokens added to it, which a chat variant of the same model renames or extends) and
    vocabulary_hash over that size. CorpusLookup.check_tokenizer compares the target's with it."""
    size = tokenizer.vocab_size
    return {"tokenizer": str(tokenizer.name_or_path), "tokenizer_vocab_size": str(size),
            "tokenizer_tokens_sha256": vocabulary_hash(tokenizer, size)}


def vocabulary_hash(tokenizer, size: int, samples: int = 1024) -> str:
    """A short hash of the tokens a tokenizer gives `samples` ids spread evenly below `size`: two tokenizers' differ
    at nearly every id, and 1024 of them take about 1 ms (the whole vocabulary: 0.1 s for SmolLM2's 49,152, at every
    decoder start)."""
    ids = list(range(0, size, max(1, size // samples)))
    tokens = tokenizer.convert_ids_to_tokens(ids)
    return hashlib.sha256("\n".join(f"{i} {token}" for i, token in zip(ids, tokens)).encode()).hexdigest()[:16]


def read_replies(path: str | Path) -> list[list[int]]:
    """The sequences `write_replies` wrote, or that another writer stored as 1-D integer `tokens` and `offsets`, signed
    or unsigned (numpy's uint16/32/64 say)."""
    return read_corpus_file(path)[0]


def read_corpus_file(path: str | Path, source: str | None = None) -> tuple[list[list[int]], dict[str, str] | None]:
    """read_replies' sequences, and the record of the tokenizer they came from (tokenizer_record) where the file holds
    one (files written before write_replies recorded it, and other writers', hold none). `source`: how the user gave
    the file (`--corpus FILE`, `corpus=FILE`), None for a drafter folder's or a run's own."""
    try:
        with safe_open(str(path), framework="pt") as saved:
            tokens, offsets = saved.get_tensor("tokens"), saved.get_tensor("offsets")
            metadata = saved.metadata() or {}
        problem = next((f"{name} is {tensor.dim()}-D {tensor.dtype}, not 1-D integers"
                        for name, tensor in (("tokens", tokens), ("offsets", offsets))
                        if tensor.dim() != 1 or tensor.dtype.is_floating_point or tensor.dtype == torch.bool), None)
        if problem is None:  # int64 holds every uint64 but the top half, which no token id or length reaches
            problem = next((f"{name} hold a uint64 value of 2^63 or more, past any token id or length"
                            for name, tensor in (("tokens", tokens), ("offsets", offsets))
                            if tensor.dtype == torch.uint64 and bool((tensor.view(torch.int64) < 0).any())), None)
        if problem is None:
            # torch orders no unsigned integers but uint8: numpy's uint16/32/64 offsets were a NotImplementedError
            tokens, offsets = tokens.to(torch.int64), offsets.to(torch.int64)
            if (len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(tokens)
                    or bool((offsets[1:] < offsets[:-1]).any())):
                problem = f"offsets do not run from 0 to the {len(tokens)} tokens without going back"
        record = {key: metadata[key] for key in ("tokenizer", "tokenizer_vocab_size", "tokenizer_tokens_sha256")
                  if key in metadata} or None
        if problem is None and record is not None and not (len(record) == 3 and record["tokenizer_vocab_size"].isdigit()):
            problem = f"its metadata's record of the tokenizer is not write_replies': {record}"
        if problem is not None:
            raise ValueError(problem)
    except (OSError, SafetensorError, KeyError, ValueError) as error:
        if source is None:  # a drafter folder's or a run's own
            named, remedy = f"corpus {path}", "export the drafter again, or decode without it (ddtree: --corpus none)"
        else:  # a file the user named, which re-exporting the drafter (as the line said) leaves as it is
            named, remedy = source, ("give a corpus.safetensors a run with model.corpus wrote (its drafter folder "
                                     "ships one), or a JSONL file of conversations")
        raise DDTreeError(f"{named} is unreadable or not a corpus ({error_line(error)}); {remedy}") from None
    tokens, offsets = tokens.tolist(), offsets.tolist()
    return [tokens[start:end] for start, end in zip(offsets, offsets[1:])], record


def read_corpus(path: str | Path, flag: str = "--corpus ") -> list[str] | CorpusLookup:
    """--corpus, or one line saying why it cannot be read (read before a target loads, whole: a few MB, and kept, as a
    pipe can be read only once): the assistant turns of a JSONL file of conversations as text (for
    CorpusLookup.from_text), or the index of a corpus.safetensors of token ids as a drafter folder ships it (its
    check_tokenizer is for once the target's tokenizer has loaded). `flag`: how the caller's user gave the file, before
    its path in the errors (ddtree.Decoder's "corpus=")."""
    source = f"{flag}{path}"  # as given
    path = corpus_path(path, flag)
    if is_safetensors(path):
        return CorpusLookup.from_file(path, source=source).check_runs()
    return read_conversations(path, flag)


def is_safetensors(path: Path) -> bool:
    """Whether a --corpus file is token ids (a corpus.safetensors) rather than JSONL: by its name, or for a file by
    how it begins, an 8-byte little-endian header length (under 100 MB; 8 bytes of text read as one pass 2^61) and
    the header's `{`. A copy named otherwise (corpus.bin, CORPUS.SAFETENSORS) was read as JSONL, and refused as "not
    UTF-8 ... save it as UTF-8 JSONL". A pipe, which can be read only once, goes by its name."""
    if path.suffix.lower() == ".safetensors":
        return True
    if not path.is_file():
        return False
    try:
        with path.open("rb") as handle:
            head = handle.read(9)
    except OSError:  # unreadable: iter_json_lines names the file and why
        return False
    return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") < 100_000_000


def corpus_path(path: str | Path, flag: str = "--corpus ") -> Path:
    """--corpus as a Path, or one line saying there is no such file; a pipe (`--corpus <(...)`) is one."""
    path = Path(path)
    problem = not_a_file(path, pipe_ok=True)
    if problem:
        raise DDTreeError(f"{flag}{path}: {problem}; give a JSONL file of "
                          "conversations or a corpus.safetensors (docs/decoding.md, Corpus lookup)")
    return path


def read_conversations(path: str | Path, flag: str = "--corpus ") -> list[str]:
    """The assistant turns of a JSONL file of conversations, one {"messages": [...]} object a line, as text; bad JSON,
    UTF-8 or Unicode is one line naming the line. `flag` as read_corpus'."""
    path = corpus_path(path, flag)
    replies = []
    for _, where, record in iter_json_lines(path):
        try:
            turns = [turn["content"] for turn in record["messages"] if turn["role"] == "assistant"]
        except (KeyError, TypeError):
            raise DDTreeError(f"{flag}{where}: not a conversation; each line must be "
                              '{"messages": [{"role": ..., "content": ...}, ...]}') from None
        if not all(isinstance(turn, str) for turn in turns):
            raise DDTreeError(f"{flag}{where}: an assistant turn's content is not a string (a tool call, or a "
                              "list of parts): give the replies as text")
        for turn in turns:
            check_text(turn, f"{flag}{where}: an assistant turn")
        replies += turns
    if not replies:
        # (a prompts file, the likeliest mix-up, holds user turns only)
        raise DDTreeError(f"{flag}{path}: no assistant turn in it, so there is nothing to look up; give conversations "
                          "holding the target's replies (docs/decoding.md, Corpus lookup), or decode without it "
                          "(ddtree: --corpus none)")
    return replies


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values, ascending, by one sort: np.unique (numpy 2.4) counts them in a hash table first, which took
    4.7 s over the 3M distinct ids of a corrupt corpus that CorpusLookup then refuses, where the sort takes 0.13 s
    (one thread of a loaded 2-core AMD EPYC, 2026-12-07)."""
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))] if len(ordered) else ordered


def majority_path(continuations: list[list[int]]) -> list[int]:
    """Depth by depth, the token that most of the continuations still agreeing with the path take next (a tie: the
    one seen first), until none goes further.

    Each depth is as likely as the data allows given the ones before it, which is what a grafted path needs: on the
    held-out prompts' greedy answers it matched 0.695 tokens a position, the single most frequent whole
    continuation 0.630 (docs/decoding.md, Corpus lookup).
    """
    path: list[int] = []
    while True:
        if len(continuations) == 1:  # one left (most runs occur once): the rest of the path is its own
            return path + list(continuations[0][len(path):])
        counts = Counter(continuation[len(path)] for continuation in continuations if len(continuation) > len(path))
        if not counts:
            return path
        token = counts.most_common(1)[0][0]
        continuations = [c for c in continuations if len(c) > len(path) and c[len(path)] == token]
        path.append(token)


class CorpusLookup:
    """The majority continuation (majority_path), up to `length` tokens, of every `ngram`-token run in `sequences`.

    Indexed by sorting, not by a table of every run's path: each position's preceding `ngram` tokens are packed into
    one int64 key and the positions sorted by it (stably, so a run's occurrences keep their order and majority_path's
    ties still go to the first seen); a lookup finds its run's occurrences by binary search and takes their majority
    path once, remembered for the next. Decoding asks for a few hundred runs, where a table held all of them: for
    the default recipe's 2001 replies (396,564 tokens, 91,643 runs) the table took 4.6 s at every decoder start and
    training launch on a 2-core EPYC, the sorted index takes 0.17 s.
    """

    def __init__(self, sequences: Iterable[list[int]], ngram: int = NGRAM, length: int = LENGTH,
                 source: str = "the corpus", written_with: dict[str, str] | None = None):
        # source: how its lines name it ("--corpus replies.jsonl", the drafter's file); written_with: the record of the
        # tokenizer its ids came from, where its file holds one (tokenizer_record; check_tokenizer)
        for name, value, default in (("ngram", ngram, NGRAM), ("length", length, LENGTH)):
            # ngram 0 or less built an index its own lookups never matched (a key of the whole context), length 0 or
            # less one that grafted nothing, without a word
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise DDTreeError(f"CorpusLookup {name}={value!r}: give a whole number of tokens, at least 1 "
                                  f"(default {default})")
        ngram, length = int(ngram), int(length)
        sequences = [np.asarray(tokens, dtype=np.int64) for tokens in sequences]
        if any(sequence.ndim == 0 for sequence in sequences):  # each id was a reply of one token: nothing to look up
            raise DDTreeError("CorpusLookup takes replies, each a list of token ids, and was given token ids: give "
                              "one reply as [ids]")
        sequences = [sequence.reshape(-1) for sequence in sequences]
        self.ngram, self.length, self.source, self.written_with = ngram, length, source, written_with
        self.tokens = np.concatenate(sequences) if sequences else np.zeros(0, dtype=np.int64)  # every reply, end to end
        # A run's key packs its tokens' ranks among the ids the replies hold, not the ids themselves: a corpus of
        # another tokenizer's (or corrupt) ids still builds, for check_vocabulary to name the id in one line (unless no
        # tokenizer's: too many ids to pack, below).
        self.ids = sorted_unique(self.tokens)  # (U,)
        self.lowest = min(0, int(self.ids[0])) if len(self.ids) else 0  # the ids it holds (check_vocabulary)
        self.highest = int(self.ids[-1]) if len(self.ids) else -1
        if len(self.ids) ** ngram >= 2 ** 63 > len(self.ids) ** NGRAM:  # the ids would do, the runs are too long
            longest = next(n for n in range(ngram - 1, 0, -1) if len(self.ids) ** n < 2 ** 63)
            raise DDTreeError(f"CorpusLookup ngram={ngram}: runs of {ngram} tokens over the {len(self.ids)} distinct "
                              f"token ids {source} holds do not pack into the index's int64 keys; give ngram at most "
                              f"{longest} (default {NGRAM})")
        if len(self.ids) ** ngram >= 2 ** 63:  # runs of 3: 2^21 ids, 8x the largest vocabulary
            raise DDTreeError(f"{source} holds {len(self.ids)} distinct token ids ({int(self.ids[0])} to {self.highest}), "
                              f"too many to index its runs of {ngram} tokens and more than a target's vocabulary: "
                              "they are not token ids of a target's replies (another writer's, or a corrupt file); give "
                              "a corpus of this target's replies, or decode without it (ddtree: --corpus none)")
        ranks = np.searchsorted(self.ids, self.tokens)
        lengths = np.array([len(tokens) for tokens in sequences], dtype=np.int64)
        ends = np.cumsum(lengths)  # where each reply ends in self.tokens
        index = np.arange(len(self.tokens))
        follows_a_run = index - np.repeat(ends - lengths, lengths) >= ngram  # a whole run of its own reply before it
        positions = index[follows_a_run]  # (P,) the first token of each continuation
        stops = np.minimum(positions + length, np.repeat(ends, lengths)[follows_a_run])  # a continuation ends with its reply
        keys = np.zeros(len(positions), dtype=np.int64)
        for offset in range(ngram, 0, -1):
            keys = keys * len(self.ids) + ranks[positions - offset]
        order = np.argsort(keys, kind="stable")
        self.keys, self.starts, self.stops = keys[order], positions[order], stops[order]  # (P,) each, by key
        self.paths: dict[int, list[int]] = {}  # the runs looked up so far: key -> majority path

    def check_vocabulary(self, vocab_size: int) -> None:
        """One line where the corpus holds ids the target has no token for (another tokenizer's replies): grafted, they
        would index past the target's embedding mid-decode."""
        if self.lowest < 0 or self.highest >= vocab_size:
            bad = self.lowest if self.lowest < 0 else self.highest
            raise DDTreeError(f"{self.source} holds token id {bad}, outside the target's vocabulary of {vocab_size} ids: it "
                              "was written with another tokenizer; give a corpus of this target's replies, or decode "
                              "without it (ddtree: --corpus none)")

    def check_tokenizer(self, tokenizer) -> None:
        """One line where its file records another tokenizer than `tokenizer` (the target's): ids below the target's
        vocabulary size pass check_vocabulary, and grafted as the target's tokens they are never accepted. A file that
        records none (written before write_replies recorded it, or by another writer) is checked by its ids alone."""
        if self.written_with is None:
            return
        size, name = int(self.written_with["tokenizer_vocab_size"]), self.written_with["tokenizer"]
        if tokenizer.vocab_size < size or vocabulary_hash(tokenizer, size) != self.written_with["tokenizer_tokens_sha256"]:
            raise DDTreeError(f"{self.source} was written with tokenizer {name} ({size} tokens), whose ids the target's "
                              f"tokenizer {tokenizer.name_or_path} ({tokenizer.vocab_size} tokens) gives other tokens: "
                              "give a corpus of this target's replies, or decode without it (ddtree: --corpus none)")

    def check_runs(self) -> CorpusLookup:
        """Itself, or one line where it holds no run to look up (its replies empty, or none longer than `ngram` tokens):
        decoding with it grafted nothing, and bench recorded it as the corpus it ran with."""
        if not len(self):
            raise DDTreeError(f"{self.source}: no reply in it holds more than {self.ngram} tokens, so there is nothing to "
                              "look up; give the target's replies, or decode without it (ddtree: --corpus none)")
        return self

    def __len__(self) -> int:
        """The number of distinct runs."""
        return int(np.count_nonzero(np.diff(self.keys))) + 1 if len(self.keys) else 0

    def continuation(self, context: list[int], length: int) -> list[int]:
        """What most often followed the context's last `ngram` tokens, up to `length` tokens; [] if never seen."""
        if len(context) < self.ngram or length < 1:
            return []
        key = 0
        for token in context[-self.ngram:]:
            rank = int(np.searchsorted(self.ids, token))
            if rank == len(self.ids) or self.ids[rank] != token:
                return []  # an id no reply holds
            key = key * len(self.ids) + rank
        if key not in self.paths:
            first, last = np.searchsorted(self.keys, key, side="left"), np.searchsorted(self.keys, key, side="right")
            self.paths[key] = majority_path([self.tokens[start:stop].tolist() for start, stop
                                             in zip(self.starts[first:last], self.stops[first:last])])
        return self.paths[key][:length]

    @property
    def table(self) -> dict[tuple[int, ...], list[int]]:
        """Every run and its majority continuation, all computed (to inspect or compare indexes; decoding looks up)."""
        firsts = np.flatnonzero(np.diff(self.keys, prepend=self.keys[:1] - 1)) if len(self.keys) else []
        runs = [tuple(self.tokens[self.starts[i] - self.ngram:self.starts[i]].tolist()) for i in firsts]
        return {run: self.continuation(list(run), self.length) for run in runs}

    @classmethod
    def from_file(cls, path: str | Path, **settings) -> CorpusLookup:
        """The index of the replies in a file `write_replies` wrote (<run>/corpus.safetensors, a drafter's export)."""
        replies, record = read_corpus_file(path, settings.get("source"))
        return cls(replies, **{"source": f"the corpus {path}", "written_with": record, **settings})

    @classmethod
    def from_conversations(cls, path: str | Path, tokenizer, **settings) -> CorpusLookup:
        """The assistant turns of a JSONL file of conversations, one {"messages": [...]} object a line.

        `datasets.load_from_disk("data/smollm2-135m").to_json("replies.jsonl")` writes one from a folder that
        data/regenerate.py made (this library does not read `datasets` folders itself).
        """
        return cls.from_text(read_conversations(path), tokenizer, **{"source": f"the corpus {path}", **settings})

    @classmethod
    def from_text(cls, replies: Iterable[str], tokenizer, **settings) -> CorpusLookup:
        """The index of replies given as text (read_conversations), tokenized by the target's tokenizer."""
        if isinstance(replies, str):  # each character was a reply of its own: nothing to look up
            raise DDTreeError("CorpusLookup.from_text takes replies, a list of texts, and was given one text: give "
                              "one reply as [text]")
        return cls((tokenizer(reply, add_special_tokens=False)["input_ids"] for reply in replies), **settings)
