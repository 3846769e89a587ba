"""Corpus lookup: what the target's own replies most often said next, grafted into each tree beside the drafter's.

    corpus = CorpusLookup.from_conversations("data/smollm2-135m", tokenizer)   # the replies a drafter trained on
    generate(target, prompt, "ddtree", drafter, corpus=corpus)                 # `ddtree bench --corpus FOLDER`

A target repeats its own phrasing from answer to answer ("Here's an example of how you can use ..."). The index
maps every run of `ngram` tokens in the replies to the continuation that followed it most often (ties: the one
seen first), and a round grafts that continuation of the context's last `ngram` tokens as one more path of the
tree, within the budget (ddtree.decoding.draft_tree). Like every draft, it only decides how much one target
forward confirms; what is committed stays the target's own choice (README, Corpus lookup).
"""

from __future__ import annotations

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
    def from_conversations(cls, folder: str | Path, tokenizer, **settings) -> CorpusLookup:
        """The assistant turns of a `datasets` folder of conversations (data/regenerate.py writes them)."""
        from datasets import load_from_disk

        path = Path(folder)
        try:
            data = load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as error:
            raise DDTreeError(f"--corpus {folder}: not a datasets folder of conversations ({error}); give one "
                              "that data/regenerate.py wrote, such as data/smollm2-135m") from None
        if "messages" not in data.column_names:
            raise DDTreeError(f"--corpus {folder}: it has no `messages` column (columns: "
                              f"{', '.join(data.column_names)}); give a folder of conversations")
        replies = [turn["content"] for messages in data["messages"] for turn in messages if turn["role"] == "assistant"]
        if not replies:
            raise DDTreeError(f"--corpus {folder}: no assistant turn in it, so there is nothing to look up")
        return cls((tokenizer(reply, add_special_tokens=False)["input_ids"] for reply in replies), **settings)
