"""Corpus lookup: what the target's own replies most often said next, grafted into each tree beside the drafter's.

    corpus = CorpusLookup.from_conversations("replies.jsonl", tokenizer)   # the replies a drafter trained on
    generate(target, prompt, "ddtree", drafter, corpus=corpus)             # `ddtree bench --corpus replies.jsonl`

A target repeats its own phrasing from answer to answer ("Here's an example of how you can use ..."). The index
maps every run of `ngram` tokens in the replies to the continuation that followed it most often (ties: the one
seen first), and a round grafts that continuation of the context's last `ngram` tokens as one more path of the
tree, within the budget (ddtree.decoding.draft_tree). Like every draft, it only decides how much one target
forward confirms; what is committed stays the target's own choice (README, Corpus lookup).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

from .errors import DDTreeError

NGRAM = 3  # tokens of context matched; 3 is what the context lookup starts from too (ddtree/tree.py)
LENGTH = 7  # the longest continuation kept: a block of 8 drafts at most 7 tokens


class CorpusLookup:
    """The most frequent continuation, up to `length` tokens, of every `ngram`-token run in `sequences`."""

    def __init__(self, sequences: Iterable[list[int]], ngram: int = NGRAM, length: int = LENGTH):
        counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for tokens in sequences:
            for end in range(ngram, len(tokens)):
                counts[tuple(tokens[end - ngram:end])][tuple(tokens[end:end + length])] += 1
        self.ngram, self.length = ngram, length
        self.table = {key: list(seen.most_common(1)[0][0]) for key, seen in counts.items()}

    def __len__(self) -> int:
        return len(self.table)

    def continuation(self, context: list[int], length: int) -> list[int]:
        """What most often followed the context's last `ngram` tokens, up to `length` tokens; [] if never seen."""
        if len(context) < self.ngram or length < 1:
            return []
        return self.table.get(tuple(context[-self.ngram:]), [])[:length]

    @classmethod
    def from_conversations(cls, path: str | Path, tokenizer, **settings) -> CorpusLookup:
        """The assistant turns of a JSONL file of conversations, one {"messages": [...]} object a line.

        `datasets.load_from_disk("data/smollm2-135m").to_json("replies.jsonl")` writes one from a folder that
        data/regenerate.py made (this library does not read `datasets` folders itself).
        """
        path = Path(path)
        if not path.is_file():
            raise DDTreeError(f"--corpus {path}: no such file; give a JSONL file of conversations (README, Corpus lookup)")
        replies = []
        with path.open() as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    messages = json.loads(line)["messages"]
                    replies += [turn["content"] for turn in messages if turn["role"] == "assistant"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DDTreeError(f"--corpus {path}, line {number}: not a conversation; each line must be "
                                      '{"messages": [{"role": ..., "content": ...}, ...]}') from None
        if not replies:
            raise DDTreeError(f"--corpus {path}: no assistant turn in it, so there is nothing to look up")
        return cls((tokenizer(reply, add_special_tokens=False)["input_ids"] for reply in replies), **settings)
