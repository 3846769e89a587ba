"""Toy conversations for the training tests: seeded, tiny vocabulary, replies of varied length."""

from __future__ import annotations

import json
import random
from pathlib import Path

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
