"""Recover the token ids a greedy regeneration generated, for data that kept only their text.

    .venv/bin/python data/recover_ids.py data/smollm2-135m --out /tmp/recovered     # then check and move it

Training supervises the ids the target generated (training/conversations.py, render_generated), and
data/regenerate.py records them as response_ids. Data regenerated before it did holds only the decoded
reply, and tokenizing that text again gives the tokenizer's own split wherever the target chose another
(`read` `line` where the tokenizer writes `readline`): in the shipped data/smollm2-135m, 275 of 2048
replies re-tokenize to another length than the response_tokens the regeneration counted.

For a greedy (temperature 0) regeneration the target's choices can be found again without decoding token
by token: one teacher-forced forward over the prompt and a candidate split gives the target's argmax at
every reply position. At the first position where the argmax is another token whose bytes the reply
continues with, the target took that token: it replaces the candidate's, the rest of the reply is
tokenized again behind it, and the next forward checks the new candidate. Where the argmax is a token the
reply does not continue with, the regeneration's precision (bf16) and this one's (fp32) disagree on a
near tie; the candidate's token stays, and the position is counted. A reply is recovered when its ids
decode to its text and their count equals its response_tokens; otherwise it keeps no response_ids and
training tokenizes its text, as before. Data written with a target adapter (its regeneration.json names one), and data
whose rows hold the response_ids regenerate.py recorded (no recovery in its regeneration.json), are refused: those are
the ids the target generated already.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddtree.errors import CommandParser, DDTreeError, command  # noqa: E402
from ddtree.files import check_output_file, path_argument, staged_folder  # noqa: E402
from training.arguments import answer_early  # noqa: E402
from training.recipe_data import read_summary  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="a folder written by data/regenerate.py (greedy)")
    p.add_argument("--out", type=path_argument, required=True, help="a new folder for the data with response_ids")
    p.add_argument("--limit", type=int, default=0, help="only the first N rows (0: all)")
    return p


def regeneration_settings(source: Path) -> dict:
    """A greedy regeneration's recorded settings (data/regenerate.py's regeneration.json), or the line saying why not."""
    settings = read_summary(source)
    if settings is None:
        raise DDTreeError(f"{source}: no regeneration.json; recover_ids reads a folder written by data/regenerate.py")
    if settings.get("temperature", 0.0) != 0.0:
        raise DDTreeError(f"{source}/regeneration.json: temperature {settings['temperature']}: only greedy replies "
                          "can be recovered from their text")
    if settings.get("target_adapter"):
        # regenerate.py records every row's response_ids since before it merged adapters; recovered here from the
        # base model alone, they would be replaced by another model's choices
        raise DDTreeError(f"{source}/regeneration.json: written with the target adapter {settings['target_adapter']}, "
                          "so its rows already hold the ids the adapted target generated (response_ids): there is "
                          f"nothing to recover; train on {source} as it is")
    return settings


def checked_args(args: argparse.Namespace) -> argparse.Namespace:
    if args.limit < 0:  # rows[:-1] dropped the last row without a word
        raise DDTreeError(f"--limit {args.limit}: give a row count, or 0 for all rows")
    regeneration_settings(Path(args.data))
    if Path(args.out).exists():
        raise DDTreeError(f"--out {args.out} exists; give a new folder (nothing is overwritten)")
    # A file in the way or a read-only place: said now, not by the write after the whole recovery (a reply a second)
    check_output_file(args.out, "--out")
    return args


# As a script: --help and bad input answered before torch and transformers load (9 s on the 2-core EPYC).
answer_early(__name__, build_parser, checked_args)


import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from data.regenerate import conversation_counts  # noqa: E402
from ddtree.targets import load_target  # noqa: E402
from ddtree.bench import chat_prompt_ids  # noqa: E402
from training.conversations import CHAT_TARGET  # noqa: E402


def byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for every byte -> the byte: bytes that print as themselves keep
    their character; the other 68 take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


class ByteTokens:
    """Each token id's bytes, for a byte-level BPE tokenizer (GPT-2's scheme: SmolLM2, Qwen, Llama 3)."""

    def __init__(self, tokenizer):
        alphabet = byte_alphabet()
        vocab = tokenizer.get_vocab()
        self.special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())  # not bytes
        self.bytes_of = {}
        for token, token_id in vocab.items():
            if token_id not in self.special and all(char in alphabet for char in token):
                self.bytes_of[token_id] = bytes(alphabet[char] for char in token)
        self.id_of_byte = {}
        for token_id, data in self.bytes_of.items():
            if len(data) == 1:
                self.id_of_byte[data[0]] = token_id
        missing = [b for b in range(0x80, 0xC0) if b not in self.id_of_byte]  # what tokenize() may need alone
        if missing:
            raise DDTreeError(f"{tokenizer.name_or_path}: not a byte-level BPE tokenizer (no single-byte token for "
                              f"{len(missing)} UTF-8 continuation bytes); recover_ids needs one")
        self.tokenizer = tokenizer

    def join(self, ids: list[int]) -> bytes:
        return b"".join(self.bytes_of[i] for i in ids)

    def tokenize(self, data: bytes) -> list[int]:
        """Ids whose bytes are `data`: the tokenizer's split of its text, behind single-byte tokens for the tail of a
        character that an earlier token began (text cannot start mid-character)."""
        start = 0
        while start < len(data) and data[start] & 0xC0 == 0x80:  # UTF-8 continuation bytes
            start += 1
        text = data[start:].decode("utf-8")
        ids = [self.id_of_byte[b] for b in data[:start]]
        return ids + self.tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def recover(model, tokens: ByteTokens, prompt: list[int], reply: str, max_repairs: int = 256) -> tuple[list[int], int]:
    """The ids the target's greedy choices give for `reply` behind `prompt` (see the module docstring), and the
    number of positions where its argmax is a token the reply does not continue with.

    After a repair at position j only the ids from j on are new: the cache is cut back to the prompt and ids[:j],
    and the next forward runs over the rest alone."""
    data = reply.encode("utf-8")
    ids = tokens.tokenize(data)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt + ids]), past_key_values=cache, use_cache=True).logits[0]
    choices = logits[len(prompt) - 1:-1].argmax(-1).tolist()  # choices[j]: the target's argmax for ids[j]
    checked, disagreements = 0, 0
    for _ in range(max_repairs):
        repaired = None
        for j in range(checked, len(ids)):
            if choices[j] == ids[j]:
                continue
            done = len(tokens.join(ids[:j]))
            choice_bytes = tokens.bytes_of.get(choices[j])
            if choice_bytes and data.startswith(choice_bytes, done):
                repaired = j
                ids = ids[:j] + [choices[j]] + tokens.tokenize(data[done + len(choice_bytes):])
                break
            disagreements += 1  # a near tie decided otherwise in this precision: keep the reply's own token
        if repaired is None:
            return ids, disagreements
        cache.crop(-(cache.get_seq_length() - len(prompt) - repaired))
        logits = model(input_ids=torch.tensor([ids[repaired:]]), past_key_values=cache, use_cache=True).logits[0]
        choices = choices[:repaired + 1] + logits[:-1].argmax(-1).tolist()
        checked = repaired + 1
    return ids, disagreements


def run(args: argparse.Namespace) -> dict:
    from datasets import Dataset, load_from_disk

    source, out = Path(args.data), Path(args.out)
    settings = regeneration_settings(source)
    rows = load_from_disk(str(source)).to_list()
    if "response_ids" not in settings and any(row.get("response_ids") is not None for row in rows):
        # ids data/regenerate.py recorded as it generated them (no recovery recorded in its regeneration.json): found
        # again here in fp32, a reply whose near tie this precision decides otherwise lost its exact ids for None
        raise DDTreeError(f"{source}: its rows already hold the ids the target generated (response_ids, recorded by "
                          f"data/regenerate.py): there is nothing to recover; train on {source} as it is")
    if args.limit:
        rows = rows[:args.limit]
    # The counts of the rows written, not the source's: a 2-row --limit claimed all 2048 prompts, and
    # regenerate.py --check (training's guard) took it for the whole dataset.
    settings.update(conversation_counts(rows))
    model, tokenizer = load_target(settings["target"], torch.float32)
    tokens = ByteTokens(tokenizer)
    counts = {"rows": len(rows), "recovered": 0, "split_changed": 0, "not_recovered": 0, "disagreements": 0}
    started = time.time()
    for i, row in enumerate(tqdm(rows, desc="recover ids", unit="reply", file=sys.stdout)):
        row.pop("response_ids", None)
        messages = row["messages"]
        prompt = chat_prompt_ids(tokenizer, messages[:-1], f"{source} row {i}", CHAT_TARGET)
        ids, disagreements = recover(model, tokens, prompt, messages[-1]["content"])
        counts["disagreements"] += disagreements
        decodes = tokenizer.decode(ids, skip_special_tokens=True) == messages[-1]["content"]
        if decodes and len(ids) == row["response_tokens"]:
            counts["recovered"] += 1
            counts["split_changed"] += ids != tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
            row["response_ids"] = ids
        else:
            counts["not_recovered"] += 1
            row["response_ids"] = None
    counts["seconds"] = round(time.time() - started, 1)
    settings["response_ids"] = {"recovered_by": "data/recover_ids.py (fp32 teacher forcing)", **counts}
    with staged_folder(out) as staging:
        Dataset.from_list(rows).save_to_disk(str(staging))
        (staging / "regeneration.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"[recover_ids] {json.dumps(counts)} -> {out}")
    return counts


@command
def main(argv: list[str] | None = None) -> int:
    run(checked_args(build_parser().parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
