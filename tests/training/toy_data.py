"""Toy conversations for the training tests: seeded, tiny vocabulary, replies of varied length."""

from __future__ import annotations

import json
import random
from pathlib import Path

# A launch whose evaluation is not under test: the primary budget alone (it ranks the checkpoints), replies of 4 tokens
# (the tiny recipe's 3 budgets of 16 tokens were a quarter of a tiny launch on a 2-core AVX2 EPYC); a test that reads
# other budgets gives them after these
SMALL_EVAL = ["--eval.budgets=[8]", "--eval.max_new_tokens=4"]

WORDS = "the a drafter proposes tokens target verifies block tree python list sort value returns".split()


def write_conversations(path: Path, count: int, min_words: int, max_words: int, seed: int = 0, with_ids: bool = True) -> Path:
    """Write `count` one-turn conversations ({"id"?, "messages"}) to a JSONL file; returns the path."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(count):
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
            messages = [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"id": str(i), "messages": messages} if with_ids else {"messages": messages}) + "\n")
    return path
