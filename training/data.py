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
    against the full render in character space, then mapped to tokens with the tokenizer's offsets.
  - DistillDataModule: tokenizes once into a cache (prepare_data), loads it on every rank (setup),
    serves right-padded batches {input_ids (B,T) long, loss_mask (B,T) bool, attention_mask (B,T) bool}.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ddtree.targets import DDTreeError

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


def read_messages_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file of {"id"?, "messages": [...]} records (prompts or whole conversations).

    Records without an id get "<file stem>-<line number>". Errors name the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DDTreeError(f"{path}: no such file; give a JSONL file of {{\"id\", \"messages\"}} records")
    records, seen_ids = [], set()
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DDTreeError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(record, dict) or "messages" not in record:
                raise DDTreeError(f"{where}: each line must be an object with a 'messages' list")
            messages = check_messages(record["messages"], where)
            record_id = str(record.get("id", f"{path.stem}-{line_number}"))
            if record_id in seen_ids:
                raise DDTreeError(f"{where}: duplicate id {record_id!r}; ids must be unique")
            seen_ids.add(record_id)
            records.append({"id": record_id, "messages": messages})
    if not records:
        raise DDTreeError(f"{path}: the file is empty; it needs one JSON object per line")
    return records
