"""Tests of data/recover_ids.py: the ids a greedy target generated, found again from their text.

    .venv/bin/pytest -q tests/data/test_recover_ids.py
"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data"))
import recover_ids  # noqa: E402

from ddtree.bench import chat_prompt_ids  # noqa: E402
from ddtree.errors import DDTreeError  # noqa: E402
from training.conversations import CHAT_TARGET  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a list."}]


@pytest.fixture(scope="module")
def tiny():
    from ddtree.targets import load_target

    return load_target("tiny-random", torch.float32)


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_the_byte_alphabet_covers_every_byte_once():
    alphabet = recover_ids.byte_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n") and alphabet["a"] == ord("a")


def test_tokenize_starts_mid_character_with_single_byte_tokens(tiny):
    _, tokenizer = tiny
    tokens = recover_ids.ByteTokens(tokenizer)
    data = "é and more".encode("utf-8")
    ids = tokens.tokenize(data[1:])  # the second byte of é first: no text can start there
    assert tokens.join(ids) == data[1:] and tokens.bytes_of[ids[0]] == data[1:2]
    assert tokenizer.decode(tokens.tokenize(data)) == "é and more"
    # from a whole character on, the tokenizer's own split: é was cut into its two bytes when the lead byte (0xC3,
    # not a continuation) was skipped as one
    assert tokens.tokenize(data) == tokenizer("é and more", add_special_tokens=False)["input_ids"]


class OneTokenPerByte:
    """A byte-level tokenizer with a token per byte and nothing merged, and a BOS it adds when asked (as Llama 3's
    does): small enough to hold exactly the vocabulary a test needs."""

    name_or_path = "one-token-per-byte"
    all_special_ids = [256]

    def __init__(self, without: set[int] = frozenset()):
        self.vocab = {char: byte for char, byte in recover_ids.byte_alphabet().items() if byte not in without}

    def get_vocab(self):
        return {**self.vocab, "<bos>": 256}

    def get_added_vocab(self):
        return {"<bos>": 256}

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [256] * add_special_tokens + list(text.encode("utf-8"))}


def test_a_tokenizer_without_a_single_byte_token_for_every_continuation_byte_is_refused():
    # 0xBF is the last continuation byte: without its token, a reply cut after a character's lead byte could not be
    # tokenized again
    with pytest.raises(DDTreeError, match="one-token-per-byte: not a byte-level BPE tokenizer .*1 UTF-8"):
        recover_ids.ByteTokens(OneTokenPerByte(without={0xBF}))


def test_tokenize_adds_no_special_tokens_inside_a_reply():
    # a tokenizer that opens text with a BOS would otherwise put one mid-reply at every repair
    tokens = recover_ids.ByteTokens(OneTokenPerByte())
    data = "é!".encode("utf-8")
    assert tokens.tokenize(data) == list(data) and tokens.tokenize(data[1:]) == list(data[1:])


def test_a_greedy_reply_gets_the_ids_its_target_generated_not_the_tokenizers_split(tiny):
    """The tiny random target writes 40 single newlines; its tokenizer reads their text as 10 tokens of four. Every
    repair cuts the cache back and the next forward runs over the rest alone."""
    model, tokenizer = tiny
    prompt = chat_prompt_ids(tokenizer, MESSAGES, "MESSAGES", CHAT_TARGET)
    generated = greedy(model, prompt, 40)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != generated  # the text alone loses the split
    ids, disagreements = recover_ids.recover(model, recover_ids.ByteTokens(tokenizer), prompt, text)
    assert ids == generated and disagreements == 0


def test_a_reply_past_its_repair_budget_keeps_the_tokenizers_split_for_the_rest(tiny):
    """max_repairs bounds the forwards one reply costs: past it, the ids are the repairs made and then the tokenizer's
    split of the rest, still the reply's bytes (the command counts such a reply not_recovered by its length)."""
    model, tokenizer = tiny
    prompt = chat_prompt_ids(tokenizer, MESSAGES, "MESSAGES", CHAT_TARGET)
    generated = greedy(model, prompt, 40)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    tokens = recover_ids.ByteTokens(tokenizer)
    ids, disagreements = recover_ids.recover(model, tokens, prompt, text, max_repairs=2)
    assert tokens.join(ids) == text.encode("utf-8") and disagreements == 0
    assert ids[:2] == generated[:2] and ids[2:] == tokens.tokenize(tokens.join(generated[2:]))  # two repairs
    assert ids != generated


def test_a_reply_the_target_would_not_write_keeps_its_split_and_counts_the_disagreements(tiny):
    model, tokenizer = tiny
    prompt = chat_prompt_ids(tokenizer, MESSAGES, "MESSAGES", CHAT_TARGET)
    text = "Paris is the capital of France."
    ids, disagreements = recover_ids.recover(model, recover_ids.ByteTokens(tokenizer), prompt, text)
    assert tokenizer.decode(ids) == text and disagreements > 0


def test_every_position_is_the_targets_argmax_but_the_counted_disagreements(tiny):
    """The module's promise, checked by one teacher-forced forward over the result: the ids are the target's argmax
    wherever its argmax's bytes continue the reply, and disagreements counts the other positions once each. A reply
    opened by text the target would not write has disagreements before its repairs; rechecking from the start after
    each repair counted them again (5 for these 3)."""
    model, tokenizer = tiny
    prompt = chat_prompt_ids(tokenizer, MESSAGES, "MESSAGES", CHAT_TARGET)
    opening = tokenizer("Hello\n", add_special_tokens=False)["input_ids"]
    written = opening + greedy(model, prompt + opening, 24)
    text = tokenizer.decode(written)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != written  # repairs to make
    tokens = recover_ids.ByteTokens(tokenizer)
    ids, disagreements = recover_ids.recover(model, tokens, prompt, text)
    with torch.no_grad():
        choices = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
    data = text.encode("utf-8")
    assert tokens.join(ids) == data
    other = [j for j, (choice, token) in enumerate(zip(choices, ids)) if choice != token]
    assert other and disagreements == len(other)
    assert not any(data.startswith(tokens.bytes_of.get(choices[j], b"\xff"), len(tokens.join(ids[:j]))) for j in other)


def regenerated_row(name: str, reply: str, response_tokens: int, finish: str = "stop", **extra) -> dict:
    """A row of MESSAGES' prompt and `reply` as data/regenerate.py writes it (its 9 prompt tokens)."""
    return {"id": name, "messages": MESSAGES + [{"role": "assistant", "content": reply}], "finish_reason": finish,
            "prompt_tokens": 9, "response_tokens": response_tokens, **extra}


def write_regenerated(folder: Path, rows: list[dict], temperature: float = 0.0) -> Path:
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(folder))
    (folder / "regeneration.json").write_text(json.dumps({"target": "tiny-random", "temperature": temperature}))
    return folder


def test_the_command_adds_response_ids_where_they_decode_and_count_right(tiny, tmp_path, capsys):
    model, tokenizer = tiny
    generated = greedy(model, chat_prompt_ids(tokenizer, MESSAGES, "MESSAGES", CHAT_TARGET), 24)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    rows = [regenerated_row("a", text, len(generated), "length"),
            regenerated_row("b", "Paris.", 7)]  # a count no split of "Paris." has: not recovered
    source = write_regenerated(tmp_path / "data", rows)
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out")]) == 0
    from datasets import load_from_disk

    out = load_from_disk(str(tmp_path / "out")).to_list()
    assert out[0]["response_ids"] == generated and out[1]["response_ids"] is None
    summary = json.loads((tmp_path / "out" / "regeneration.json").read_text())["response_ids"]
    assert summary["recovered"] == 1 and summary["not_recovered"] == 1
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != generated  # a's text alone splits otherwise
    assert summary["split_changed"] == 1  # the README's "282 of them split otherwise" is this count
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out")]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err
    # and as a script, which checks its command line before torch loads (that check once broke every valid run)
    import subprocess

    script = Path(recover_ids.__file__)
    proc = subprocess.run([sys.executable, str(script), str(source), "--out", str(tmp_path / "again")],
                          capture_output=True, text=True, timeout=300, cwd=script.parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert load_from_disk(str(tmp_path / "again")).to_list() == out


def test_a_limited_recovery_records_the_counts_of_the_rows_it_wrote(tiny, tmp_path):
    """--limit 2 over the 2048 shipped rows copied their regeneration.json whole: the folder claimed num_prompts 2048
    and every token, and regenerate.py --check took it for the full dataset."""
    rows = [regenerated_row("a", "Paris.", 2), regenerated_row("b", "One, two", 3, "length"),
            regenerated_row("c", "Yes.", 2)]
    source = write_regenerated(tmp_path / "data", rows)
    recorded = json.loads((source / "regeneration.json").read_text())
    full = {"num_prompts": 3, "num_conversations": 3, "num_stopped": 2, "num_hit_max_new_tokens": 1,
            "prompt_tokens": 27, "response_tokens": 7}
    (source / "regeneration.json").write_text(json.dumps({**recorded, **full}))
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out"), "--limit", "2"]) == 0
    summary = json.loads((tmp_path / "out" / "regeneration.json").read_text())
    assert {key: summary[key] for key in full} == {"num_prompts": 2, "num_conversations": 2, "num_stopped": 1,
                                                   "num_hit_max_new_tokens": 1, "prompt_tokens": 18, "response_tokens": 5}
    assert summary["target"] == "tiny-random" and summary["response_ids"]["rows"] == 2
    # --limit 1 too: a test of `if args.limit > 1` kept every row
    assert recover_ids.main([str(source), "--out", str(tmp_path / "one"), "--limit", "1"]) == 0
    assert json.loads((tmp_path / "one" / "regeneration.json").read_text())["num_prompts"] == 1


def test_only_ids_that_decode_to_the_reply_and_count_its_response_tokens_are_kept(tiny, tmp_path, monkeypatch):
    """The two checks that stand between a recovery gone wrong and the ids training supervises: ids of other text with
    the right count, or of the right text with another count, leave the row to training's tokenizer (None); and the
    summary's disagreements are every row's, not the last one's."""
    _, tokenizer = tiny
    split = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    rows = [regenerated_row("a", "Paris.", len(split("Lyon."))),
            regenerated_row("b", "Paris.", len(split("Paris.")) - 1)]
    recovered = iter([(split("Lyon."), 2), (split("Paris."), 3)])  # (ids, disagreements) for rows a and b
    monkeypatch.setattr(recover_ids, "recover", lambda model, tokens, prompt, reply: next(recovered))
    source = write_regenerated(tmp_path / "data", rows)
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out")]) == 0
    from datasets import load_from_disk

    assert [row["response_ids"] for row in load_from_disk(str(tmp_path / "out")).to_list()] == [None, None]
    summary = json.loads((tmp_path / "out" / "regeneration.json").read_text())["response_ids"]
    assert summary["recovered"] == 0 and summary["not_recovered"] == 2 and summary["disagreements"] == 5


def test_each_reply_is_recovered_behind_its_whole_prompt(tiny, tmp_path, monkeypatch):
    """A prompt of several messages (earlier turns, as data/regenerate.py reads a conversation) is every message but the
    reply: behind its first message alone, the target's choices are those of another conversation."""
    _, tokenizer = tiny
    turns = [*MESSAGES, {"role": "assistant", "content": "1. one"}, {"role": "user", "content": "And another."}]
    rows = [{**regenerated_row("a", "Paris.", 2), "messages": [*turns, {"role": "assistant", "content": "Paris."}]},
            regenerated_row("b", "Yes.", 2)]
    prompts = []
    monkeypatch.setattr(recover_ids, "recover",
                        lambda model, tokens, prompt, reply: prompts.append(prompt) or ([], 0))
    source = write_regenerated(tmp_path / "data", rows)
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out")]) == 0
    assert prompts == [chat_prompt_ids(tokenizer, turns, "turns", CHAT_TARGET),
                       chat_prompt_ids(tokenizer, MESSAGES, "MESSAGES", CHAT_TARGET)]


def test_sampled_data_is_refused(tmp_path):
    source = write_regenerated(tmp_path / "data", [{"id": "a", "messages": MESSAGES}], temperature=0.7)
    with pytest.raises(DDTreeError, match="only greedy replies"):
        recover_ids.run(recover_ids.build_parser().parse_args([str(source), "--out", str(tmp_path / "out")]))


def test_data_written_with_a_target_adapter_is_refused_in_one_line(tmp_path, capsys):
    """recover_ids loads the recorded target alone: data of a target with its adapter merged had its exact
    response_ids replaced with ones recovered from the base model, and kept target_adapter in its regeneration.json,
    so training's check took the result for the adapted target's."""
    row = regenerated_row("a", "Paris.", 2, response_ids=[1, 2])
    source = write_regenerated(tmp_path / "data", [row])
    recorded = json.loads((source / "regeneration.json").read_text())
    (source / "regeneration.json").write_text(json.dumps({**recorded, "target_adapter": "adapters/sql"}))
    capsys.readouterr()
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {source}/regeneration.json: written with the target adapter adapters/sql, so its rows "
                   "already hold the ids the adapted target generated (response_ids): there is nothing to recover; "
                   f"train on {source} as it is")
    assert not (tmp_path / "out").exists()


def test_data_whose_rows_hold_the_ids_regenerate_recorded_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """regenerate.py records the ids it generates: recovering them again in fp32 wrote a folder where a bf16 reply's
    near tie, decided otherwise, had its exact ids replaced with None (1 of 8 SmolLM2 replies, 96 new tokens), without
    a word. Data whose regeneration.json records a recovery (the shipped data) is recovered again, as data/README.md
    runs it."""
    monkeypatch.setattr(recover_ids, "recover", lambda model, tokens, prompt, reply: ([], 0))
    rows = [regenerated_row("a", "Paris.", 2, response_ids=[1, 2]), regenerated_row("b", "Yes.", 2, response_ids=None)]
    source = write_regenerated(tmp_path / "data", rows)
    capsys.readouterr()
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {source}: its rows already hold the ids the target generated (response_ids, recorded by "
        f"data/regenerate.py): there is nothing to recover; train on {source} as it is")
    assert not (tmp_path / "out").exists()
    recorded = json.loads((source / "regeneration.json").read_text())
    (source / "regeneration.json").write_text(json.dumps({**recorded, "response_ids": {"recovered": 1}}))
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out")]) == 0


def test_a_negative_limit_is_one_line(tmp_path, capsys):
    assert recover_ids.main([str(tmp_path), "--out", str(tmp_path / "out"), "--limit", "-1"]) == 2
    assert "--limit -1: give a row count, or 0 for all rows" in capsys.readouterr().err


def test_a_damaged_regeneration_json_is_one_line_naming_it(tmp_path, capsys):
    source = write_regenerated(tmp_path / "data", [{"id": "a", "messages": MESSAGES}])
    (source / "regeneration.json").write_text('{"temperature": ')
    capsys.readouterr()
    assert recover_ids.main([str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {source / 'regeneration.json'}: not valid JSON") and len(err.splitlines()) == 1


def test_an_out_that_cannot_be_written_is_one_line_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """A file in the way or a read-only folder was found by the write after the whole recovery: about 1 s a reply,
    35 minutes for the shipped 2048, thrown away."""
    import os

    row = regenerated_row("a", "Paris.", 2)
    source = write_regenerated(tmp_path / "data", [row])
    monkeypatch.setattr(recover_ids, "load_target", lambda *args, **kwargs: pytest.fail("loaded the target"))
    (tmp_path / "afile").write_text("")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != read_only and access(path, mode))  # (root)
    for out, why in ((tmp_path / "afile" / "rec", f"{tmp_path / 'afile'} is a file, not a folder"),
                     (read_only / "rec", f"{read_only} is not writable here")):
        capsys.readouterr()
        assert recover_ids.main([str(source), "--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"error: cannot write {out}: {why}; give a path in a writable folder"


def test_a_folder_without_regeneration_json_is_one_line_naming_the_folder(tmp_path, capsys):
    """The data argument is the one thing the user can mend here: an error that leaves it out does not say which
    folder to point at data/regenerate.py's output instead."""
    (tmp_path / "data").mkdir()
    assert recover_ids.main([str(tmp_path / "data"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tmp_path / 'data'}: no regeneration.json; recover_ids reads a folder written by "
                   "data/regenerate.py")
