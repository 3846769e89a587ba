"""Tests of data/regenerate.py on the tiny random target: decoding loop, shards, resume, errors.

    .venv/bin/pytest -q tests/data/test_regenerate.py
"""

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, load_from_disk
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data"))
import regenerate  # noqa: E402

from ddtree.calibration import weights_fingerprint  # noqa: E402
from ddtree.decoding import Sampling  # noqa: E402
from ddtree.errors import DDTreeError  # noqa: E402
from ddtree.targets import load_target, load_tokenizer  # noqa: E402
from training.conversations import CHAT_TARGET, read_messages_jsonl  # noqa: E402
from training.peft_utils import adapter_fingerprint  # noqa: E402
from training.target import load_frozen_target  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny-random", torch.float32)


def reference(model, prompt, stop, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=[stop], pad_token_id=0)
    return out[0, len(prompt):].tolist()


def count_generated(monkeypatch) -> list:
    """The prompts regenerate hands the model from now on, in order (it still generates them)."""
    generated = []
    real = regenerate.generate_transformers

    def counting(model, prompts, *args, **kwargs):
        generated.extend(prompts)
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(regenerate, "generate_transformers", counting)
    return generated


def test_batched_loop_matches_generate_and_drops_finished_rows(tiny):
    model, _ = tiny
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 5000, (n,), generator=generator).tolist() for n in (5, 14, 9)]
    never = model.config.vocab_size - 1
    unstopped = [reference(model, p, never, 8) for p in prompts[:1]]
    # Stop on a token that prompt 0 produces at step 3, so that row leaves the (one) batch early.
    stop = unstopped[0][3]
    expected = [reference(model, p, stop, 8) for p in prompts]
    assert len(expected[0]) <= 4 and max(len(e) for e in expected) == 8
    got = regenerate.generate_transformers(model, prompts, pad_id=0, stop_ids=[stop], batch_size=3,
                                           max_new_tokens=8, temperature=0.0, top_p=1.0)
    assert got == expected
    assert regenerate.cut_at_stop(got[0], {stop}) == (expected[0][:-1], "stop")


def test_a_left_padded_prompt_counts_its_positions_from_0_and_its_new_tokens_on_from_its_length(tiny):
    """tiny-random writes the same reply with its positions shifted by one, so the comparison with `generate` above
    passes positions that start at 1; a real target (SmolLM2) then writes other replies than its own greedy ones."""
    model, _ = tiny
    prompts = [[201, 202, 203, 204, 205, 206], [101, 102, 103]]  # one batch, longest first; the second left-padded by 3
    positions = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: positions.append(kwargs["position_ids"].tolist()),
                                           with_kwargs=True)
    try:
        regenerate.generate_transformers(model, prompts, pad_id=0, stop_ids=[model.config.vocab_size - 1],
                                         batch_size=2, max_new_tokens=3, temperature=0.0, top_p=1.0)
    finally:
        hook.remove()
    assert [row[-len(prompt):] for row, prompt in zip(positions[0], prompts)] == [[0, 1, 2, 3, 4, 5], [0, 1, 2]]
    assert positions[1:] == [[[6], [3]], [[7], [4]]]  # each new token at the position after the last one


def test_a_batch_whose_rows_all_stop_ends_without_a_forward_on_no_rows(tiny):
    """On a real target nearly every batch ends with all its rows stopped before max_new_tokens; tiny-random never
    writes its stop token, so no batch here did, and a loop that went on ran the model on 0 rows (a reshape error)."""
    model, _ = tiny
    prompts = [[201, 202, 203, 204], [101, 102, 103]]  # one batch, longest first
    free = regenerate.generate_transformers(model, prompts, pad_id=0, stop_ids=[model.config.vocab_size - 1],
                                            batch_size=2, max_new_tokens=6, temperature=0.0, top_p=1.0)
    stops = sorted({free[0][0], free[1][0]})  # each row stops on its first token
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        got = regenerate.generate_transformers(model, prompts, pad_id=0, stop_ids=stops, batch_size=2,
                                               max_new_tokens=6, temperature=0.0, top_p=1.0)
    finally:
        hook.remove()
    assert got == [free[0][:1], free[1][:1]]
    assert len(forwards) == 1  # the prompts' forward only


def test_sampling_is_seeded_and_top_p_keeps_the_head():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5]])
    assert regenerate.pick_next(logits, 0.0, 1.0).item() == 1
    # top_p below the top token's mass leaves only that token.
    generator = [torch.Generator().manual_seed(0)]
    assert all(regenerate.pick_next(logits, 1.0, 0.5, generator).item() == 1 for _ in range(20))
    generator = [torch.Generator().manual_seed(3)]
    first = [regenerate.pick_next(logits, 2.0, 1.0, generator).item() for _ in range(30)]
    generator = [torch.Generator().manual_seed(3)]
    assert first == [regenerate.pick_next(logits, 2.0, 1.0, generator).item() for _ in range(30)] and len(set(first)) > 1


def test_a_sampled_row_draws_from_its_own_generator_whatever_rows_are_beside_it():
    """One draw for the whole batch (on the global generator) gave a row other tokens with other rows beside it."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))  # (B, V)
    seeds = [regenerate.prompt_seed(0, f"p{i}") for i in range(4)]

    def draws(rows: list[int]) -> list[list[int]]:  # 10 steps of these rows batched, each row its prompt's generator
        generators = [torch.Generator().manual_seed(seeds[i]) for i in rows]
        return torch.stack([regenerate.pick_next(logits[rows], 1.0, 1.0, generators) for _ in range(10)]).T.tolist()

    batched = draws([0, 1, 2, 3])
    assert [draws([i])[0] for i in range(4)] == batched and draws([3, 1]) == [batched[3], batched[1]]
    assert all(len(set(row)) > 1 for row in batched)  # sampled: a row's generator moves on from step to step
    assert len({regenerate.prompt_seed(seed, f"p{i}") for seed in range(3) for i in range(100)}) == 300


def test_check_reads_the_ids_the_generator_gives_prompts_without_one(tmp_path):
    """--check digests the prompts without torch's imports; a prompt without an id must get there the id the generator
    gave it (<file stem>-<line>, the id its reply is recorded and seeded under), else the data of any prompts file
    without ids failed its check as edited."""
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"messages": [{"role": "user", "content": text}]} for text in ("Hi", "Name a prime.")]
    prompts.write_text("\n".join([json.dumps(lines[0]), "", json.dumps({**lines[1], "id": None})]) + "\n")
    generated = [{"id": r["id"], "messages": r["messages"]} for r in read_messages_jsonl(prompts)]
    assert [r["id"] for r in generated] == ["prompts-1", "prompts-3"]
    assert regenerate.read_prompts_torch_free(prompts, 2) == generated


def test_a_prompt_seed_fits_a_signed_64_bit_seed_and_keeps_seed_and_id_apart():
    """vLLM takes a signed 64-bit seed; and with --seed and the id run together, seed 1 with id "11" drew the replies
    of seed 11 with id "1": a prompts file numbering its ids shared replies across seeds."""
    assert all(0 <= regenerate.prompt_seed(seed, f"p{i}") < 2**63 for seed in range(3) for i in range(200))
    assert max(regenerate.prompt_seed(0, f"p{i}") for i in range(200)) >= 2**62  # all 63 bits used
    assert regenerate.prompt_seed(1, "11") != regenerate.prompt_seed(11, "1")


def test_sampling_rows_without_a_generator_each_is_refused():
    """zip would have cut the batch to its generators' count, and the rows beyond them lost their tokens."""
    with pytest.raises(ValueError, match="sampling needs a generator a row: 2 rows, 1 generators"):
        regenerate.pick_next(torch.zeros(2, 5), 1.0, 1.0, [torch.Generator()])


def sampled(model, prompts, seeds, stop_ids, batch_size):
    """generate_transformers at temperature 1, each prompt drawing from a fresh generator seeded with its seed."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    return regenerate.generate_transformers(model, prompts, pad_id=0, stop_ids=stop_ids, batch_size=batch_size,
                                            max_new_tokens=6, temperature=1.0, top_p=1.0, generators=generators)


def test_a_sampled_prompt_draws_from_its_own_generator_in_a_batch_sorted_by_length(tiny):
    """A batch is sorted longest first: a prompt that took the generator of its place in the batch drew another
    prompt's tokens, so its reply moved with the prompts sharing its chunk."""
    model, _ = tiny
    prompts, seeds, never = [[101, 102, 103], [201, 202, 203, 204, 205]], [11, 12], [model.config.vocab_size - 1]
    alone = [sampled(model, [prompt], [seed], never, 1)[0] for prompt, seed in zip(prompts, seeds)]
    assert sampled(model, prompts, seeds, never, 2) == alone and alone[0] != alone[1]


def test_a_sampled_row_keeps_its_own_generator_after_a_row_beside_it_stops(tiny):
    """Once a row leaves the batch, the rows still running draw from their own generators, not from the first ones."""
    model, _ = tiny
    prompts, seeds, never = [[201, 202, 203], [101, 102, 103]], [21, 22], [model.config.vocab_size - 1]
    free = sampled(model, prompts, seeds, never, 2)
    stop = free[0][1]  # row 0 stops at its second token
    assert stop != free[0][0] and stop not in free[1]
    assert sampled(model, prompts, seeds, [stop], 2) == [free[0][:2], free[1]]


def kept_by_pick_next(monkeypatch, logits, temperature, top_p) -> torch.Tensor:
    """The tokens regeneration may sample, (B, V) bool: the support of what pick_next hands to multinomial (a row at a
    time, each with its own generator)."""
    real_multinomial, seen = torch.multinomial, []

    def recording(probs, num_samples, generator=None):
        seen.append(probs.clone())
        return real_multinomial(probs, num_samples, generator=generator)

    monkeypatch.setattr(torch, "multinomial", recording)
    regenerate.pick_next(logits, temperature, top_p, [torch.Generator() for _ in logits])
    monkeypatch.undo()
    return torch.stack(seen) > 0


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The test's own top-p set of one row: the likeliest tokens, one by one, until their mass reaches top_p (1: no cut,
    where float32 sums reach 1 before the last tiny tokens)."""
    if top_p >= 1:
        return probs > 0
    ordered, order = probs.sort(descending=True)
    count = int((ordered.cumsum(0) < top_p).sum()) + 1  # the tokens before the sum reaches top_p, and the one reaching it
    kept = torch.zeros_like(probs, dtype=torch.bool)
    kept[order[:min(count, len(probs))]] = True
    return kept & (probs > 0)  # a token of probability 0 (underflowed) is never sampled, whatever the cut


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.75, 0.9, 0.99, 1.0])
def test_regeneration_samples_from_the_set_serving_samples_from(monkeypatch, top_p):
    generator = torch.Generator().manual_seed(int(top_p * 100))
    logits = torch.randn(16, 50, generator=generator) * torch.linspace(0.5, 4, 16)[:, None]  # flat to peaked rows
    for temperature in (1.0, 0.7):
        kept = kept_by_pick_next(monkeypatch, logits, temperature, top_p)
        serving = torch.stack([Sampling(temperature=temperature, top_p=top_p).probabilities(row) > 0 for row in logits])
        assert torch.equal(kept, serving), f"top_p {top_p}, temperature {temperature}"
        # both share top_p_filter: held to a reference of the test's own too, which a wrong cut in it would leave
        reference = torch.stack([nucleus(torch.softmax(row / temperature, -1), top_p) for row in logits])
        assert torch.equal(kept, reference), f"top_p {top_p}, temperature {temperature}"


@pytest.mark.parametrize("probs, top_p, expected", [
    ([0.5, 0.25, 0.25], 0.5, [True, False, False]),  # the head alone reaches top_p exactly: it is enough
    ([0.5, 0.25, 0.25], 0.75, [True, True, False]),
    ([0.25, 0.25, 0.25, 0.25], 0.5, [True, True, False, False]),
])
def test_a_cumulative_mass_equal_to_top_p_stops_the_set(monkeypatch, probs, top_p, expected):
    # Where a cumulative sum hits top_p exactly, a `>` cut would keep one token more than serving's `>=`.
    logits = torch.tensor([probs]).log()
    assert torch.equal(torch.softmax(logits, -1), torch.tensor([probs]))  # the sums really are exact in float32
    kept = kept_by_pick_next(monkeypatch, logits, 1.0, top_p)
    assert kept[0].tolist() == expected
    assert (Sampling(temperature=1.0, top_p=top_p).probabilities(logits[0]) > 0).tolist() == expected


def prompt_file(path, count):
    lines = [json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Say something about {i}."}]})
             for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def args_for_argv(tmp_path, *extra):
    return ["--target", "tiny-random", "--prompts", str(tmp_path / "prompts.jsonl"), "--out", str(tmp_path / "out"),
            "--chunk-size", "2", "--batch-size", "2", "--max-new-tokens", "6", "--dtype", "float32", *extra]


def args_for(tmp_path, *extra):
    return regenerate.parse_args(args_for_argv(tmp_path, *extra))


def test_shards_merge_resume_and_settings_guard(tmp_path):
    prompt_file(tmp_path / "prompts.jsonl", 5)  # 3 chunks: 2 + 2 + 1
    assert regenerate.run(args_for(tmp_path, "--num-shards", "2", "--shard-index", "0")) is None  # chunk 1 missing
    summary = regenerate.run(args_for(tmp_path, "--num-shards", "2", "--shard-index", "1"))
    assert summary["num_conversations"] == 5
    data = load_from_disk(str(tmp_path / "out"))
    assert data["id"] == [f"p{i}" for i in range(5)]
    for i, row in enumerate(data):
        assert row["messages"][0]["content"] == f"Say something about {i}."
        assert row["messages"][-1]["role"] == "assistant" and 0 <= row["response_tokens"] <= 6
        assert len(row["response_ids"]) == row["response_tokens"]  # the generated ids, which training supervises
    assert summary["response_tokens"] == sum(data["response_tokens"])

    # Resume (a job stopped before its merge): only the missing chunk is generated again, and it comes out the same
    # (greedy).
    parts = tmp_path / "out.parts"
    chunk0_mtime = (parts / "chunk-00000.jsonl").stat().st_mtime_ns
    chunk1 = (parts / "chunk-00001.jsonl").read_text()
    (parts / "chunk-00001.jsonl").unlink()
    shutil.rmtree(tmp_path / "out")
    regenerate.run(args_for(tmp_path))
    assert (parts / "chunk-00001.jsonl").read_text() == chunk1
    assert (parts / "chunk-00000.jsonl").stat().st_mtime_ns == chunk0_mtime

    with pytest.raises(DDTreeError, match="max_new_tokens: 6 -> 7"):
        regenerate.run(args_for(tmp_path, "--max-new-tokens", "7"))
    # A smaller --limit merges a prefix of the finished work (asked for with --overwrite: the merge drops the rest).
    assert regenerate.run(args_for(tmp_path, "--merge-only", "--limit", "3", "--overwrite"))["num_conversations"] == 3
    assert load_from_disk(str(tmp_path / "out"))["id"] == ["p0", "p1", "p2"]


def test_a_chunk_cut_short_by_a_smaller_limit_is_not_taken_as_finished_when_the_limit_grows(tmp_path, monkeypatch):
    """--limit 3 over chunks of 2 leaves chunk 1 holding p2 alone; a run over all 4 prompts with the work folder kept
    must answer p3 too, not take that chunk's prefix as the whole (the data then silently lacks p3)."""
    prompt_file(tmp_path / "prompts.jsonl", 4)
    regenerate.run(args_for(tmp_path, "--limit", "3"))
    generated = count_generated(monkeypatch)
    assert regenerate.run(args_for(tmp_path))["num_conversations"] == 4
    assert load_from_disk(str(tmp_path / "out"))["id"] == ["p0", "p1", "p2", "p3"]
    assert len(generated) == 2  # chunk 1 (p2, p3) made again; chunk 0 kept


def test_prompts_renamed_with_the_same_text_take_their_new_ids_and_pass_the_check(tmp_path, capsys):
    """A chunk counts as finished only for the same ids too: kept under their old ids, the rerun's data failed --check
    ("prompts ... changed") at every training start, and rerunning never mended it."""
    prompts = prompt_file(tmp_path / "prompts.jsonl", 4)
    regenerate.run(args_for(tmp_path))
    prompts.write_text(prompts.read_text().replace('"id": "p', '"id": "q'))
    assert regenerate.main([*args_for_argv(tmp_path), "--check"]) == 2  # the data's rows carry the old ids
    assert "prompts that" in capsys.readouterr().err
    regenerate.run(args_for(tmp_path))  # the work folder kept
    assert load_from_disk(str(tmp_path / "out"))["id"] == ["q0", "q1", "q2", "q3"]
    assert regenerate.main([*args_for_argv(tmp_path), "--check"]) == 0


def test_a_reply_that_stops_is_recorded_without_its_stop_token(tmp_path, monkeypatch):
    """tiny-random writes no end of turn within a test's few tokens, so every other row of these tests is cut at
    max_new_tokens: a reply that stopped could keep its stop token (trained as a reply token), be recorded as "length"
    (its end of turn never supervised), or keep a special token in its text. The target's tokens are scripted here:
    p0 and p2 stop, p1 runs out. A row's prompt_tokens is held to the prompt the target read too: nothing compared
    them. The target has two stop ids (<|endoftext|> added, as a generation config listing several eos ids gives),
    and p2 ends on the second: a reply cut at the first alone kept it as a reply token and was recorded as "length"."""
    tokenizer = load_tokenizer("tiny-random")
    words = tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    reply = words[:1] + [tokenizer.convert_tokens_to_ids("<|im_start|>")] + words[1:]  # a stray special token

    handed = []  # the prompts the target reads

    def scripted(model, prompts, pad_id, stop_ids, *args, **kwargs):  # the loop ends a reply with its stop token
        assert reply[1] not in stop_ids and len(stop_ids) == 2
        handed.extend(prompts)
        return [reply + [stop_ids[i // 2]] if i % 2 == 0 else reply for i in range(len(prompts))]

    monkeypatch.setattr(regenerate, "generate_transformers", scripted)
    real_stops = regenerate.stop_token_ids
    monkeypatch.setattr(regenerate, "stop_token_ids", lambda model, tokenizer: [*real_stops(model, tokenizer), 0])
    prompt_file(tmp_path / "prompts.jsonl", 3)
    summary = regenerate.run(args_for(tmp_path, "--chunk-size", "3", "--batch-size", "3"))
    data = load_from_disk(str(tmp_path / "out"))
    assert data["finish_reason"] == ["stop", "length", "stop"]
    assert data["response_ids"] == [reply] * 3 and data["response_tokens"] == [len(reply)] * 3
    assert [row[-1]["content"] for row in data["messages"]] == ["Hello there"] * 3
    assert data["prompt_tokens"] == [len(prompt) for prompt in handed]  # regeneration.json's sum, the README's count
    recorded = json.loads((tmp_path / "out" / "regeneration.json").read_text())
    assert summary["num_stopped"] == recorded["num_stopped"] == 2
    assert summary["num_hit_max_new_tokens"] == recorded["num_hit_max_new_tokens"] == 1


def test_the_counts_of_a_dataset_tell_replies_that_stopped_from_those_cut_at_max_new_tokens(capsys):
    """data/README.md quotes these counts of the shipped data (1147 hit the 256-token limit); its rows must not split
    evenly here, or counting one kind for the other passes."""
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
             "finish_reason": finish, "prompt_tokens": 9, "response_tokens": count}
            for i, (finish, count) in enumerate([("stop", 2), ("length", 6), ("stop", 3)])]
    counts = regenerate.conversation_counts(rows)
    assert (counts["num_stopped"], counts["num_hit_max_new_tokens"]) == (2, 1)
    assert (counts["prompt_tokens"], counts["response_tokens"]) == (27, 11)
    regenerate.report(counts, Path("out"))
    assert capsys.readouterr().out == ("[regenerate] wrote 3 conversations to out (11 response tokens, 1 hit "
                                       "max_new_tokens)\n")


def test_the_default_flags_are_the_shipped_datas_settings(monkeypatch):
    """data/smollm2-135m is what the default flags make (the module docstring's command): a default that moved (the
    reply length, the dtype, greedy decoding, the prompts file) would make a plain run's data other than the shipped
    data, and training from it other than the recipes measured. --check loads no model."""
    monkeypatch.chdir(Path(regenerate.__file__).resolve().parents[1])
    assert regenerate.main(["--out", "data/smollm2-135m", "--limit", "2048", "--check"]) == 0


SAMPLED = ["--temperature", "1", "--max-new-tokens", "8"]


def test_a_sampled_reply_is_the_same_whatever_the_batch_chunk_or_shard(tmp_path):
    """At T > 0 a chunk's replies drew together from one generator, seeded per chunk: --batch-size 1 against 2, or
    --chunk-size 4 against 2, gave every reply other tokens (fp32 too), though the settings check took the data as
    the job's and data/README.md said a resume with another batch size goes on."""
    prompt_file(tmp_path / "prompts.jsonl", 5)

    def replies(out: str, *flags: str) -> list[list[int]]:
        regenerate.run(args_for(tmp_path, *SAMPLED, "--out", str(tmp_path / out), *flags))
        return load_from_disk(str(tmp_path / out))["response_ids"]

    made = replies("chunks-of-2")  # batches of 2
    assert len({tuple(reply) for reply in made}) == 5 and all(len(reply) == 8 for reply in made)
    assert replies("batches-of-1", "--batch-size", "1") == made
    assert replies("chunks-of-4", "--chunk-size", "4", "--batch-size", "4") == made
    assert regenerate.run(args_for(tmp_path, *SAMPLED, "--out", str(tmp_path / "sharded"), "--num-shards", "2",
                                   "--shard-index", "1")) is None
    assert replies("sharded", "--num-shards", "2", "--shard-index", "0") == made
    assert replies("limit-3", "--limit", "3") == made[:3]
    assert regenerate.main([*args_for_argv(tmp_path, *SAMPLED, "--out", str(tmp_path / "chunks-of-2"), "--chunk-size",
                                           "4", "--batch-size", "1"), "--check"]) == 0
    assert replies("seed-1", "--seed", "1") != made  # the seed still chooses them
    assert json.loads((tmp_path / "chunks-of-2" / "regeneration.json").read_text())["sampling"] == "per-prompt"


def test_sampled_data_made_per_chunk_is_refused_rather_than_taken_or_extended(tmp_path, capsys):
    """Sampled data written before each prompt had its own generator (its settings hold no `sampling`) is not what a
    rerun would write: --check, a rerun and a resume said nothing and took it, or mixed new chunks with its own."""
    prompt_file(tmp_path / "prompts.jsonl", 4)  # 2 chunks
    regenerate.run(args_for(tmp_path, *SAMPLED))
    made = load_from_disk(str(tmp_path / "out")).to_list()
    summary = tmp_path / "out" / "regeneration.json"
    summary.write_text(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if k != "sampling"}))
    shutil.rmtree(tmp_path / "out.parts")
    capsys.readouterr()
    differs = "made with other settings (sampling: 'per-chunk' -> 'per-prompt')"
    assert regenerate.main([*args_for_argv(tmp_path, *SAMPLED), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tmp_path / 'out'} holds a dataset {differs}: generate it again with --overwrite (this "
                   "command without --check), or give another output folder")
    assert regenerate.main(args_for_argv(tmp_path, *SAMPLED)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --out {tmp_path / 'out'} holds a dataset {differs}: ") and len(err.splitlines()) == 1
    assert load_from_disk(str(tmp_path / "out")).to_list() == made and not (tmp_path / "out.parts").exists()
    # A work folder of that script's: its finished chunk is not resumed with chunks drawn the new way.
    assert regenerate.run(args_for(tmp_path, *SAMPLED, "--out", str(tmp_path / "new"), "--num-shards", "2",
                                   "--shard-index", "0")) is None
    settings = tmp_path / "new.parts" / "settings.json"
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items() if k != "sampling"}))
    capsys.readouterr()
    assert regenerate.main(args_for_argv(tmp_path, *SAMPLED, "--out", str(tmp_path / "new"))) == 2
    assert capsys.readouterr().err.strip().startswith(
        f"error: {tmp_path / 'new.parts'} holds chunks made with other settings (sampling: 'per-chunk' -> 'per-prompt')")
    # Greedy data records no sampling, as the shipped data does not: taken as before.
    regenerate.run(args_for(tmp_path, "--out", str(tmp_path / "greedy")))
    assert "sampling" not in json.loads((tmp_path / "greedy" / "regeneration.json").read_text())
    assert regenerate.main([*args_for_argv(tmp_path, "--out", str(tmp_path / "greedy")), "--check"]) == 0


def test_a_larger_limit_on_a_fresh_clone_reuses_the_merged_answers(tmp_path, monkeypatch):
    """The shipped dataset comes without its .parts folder: extending it generates only the new prompts."""
    prompt_file(tmp_path / "prompts.jsonl", 5)  # 3 chunks: 2 + 2 + 1
    regenerate.run(args_for(tmp_path, "--limit", "4"))
    shipped = load_from_disk(str(tmp_path / "out")).to_list()
    shutil.rmtree(tmp_path / "out.parts")

    generated = count_generated(monkeypatch)
    summary = regenerate.run(args_for(tmp_path))
    assert len(generated) == 1 and summary["num_conversations"] == 5
    assert load_from_disk(str(tmp_path / "out")).to_list()[:4] == shipped

    # Other settings: refused over the dataset unless --overwrite, and then nothing is reused (on a fresh clone: no
    # work folder).
    shutil.rmtree(tmp_path / "out.parts")
    with pytest.raises(DDTreeError, match=r"holds a dataset made with other settings \(max_new_tokens: 6 -> 5\)"):
        regenerate.run(args_for(tmp_path, "--max-new-tokens", "5"))
    assert load_from_disk(str(tmp_path / "out")).to_list()[:4] == shipped and not (tmp_path / "out.parts").exists()
    generated.clear()
    regenerate.run(args_for(tmp_path, "--max-new-tokens", "5", "--overwrite"))
    assert len(generated) == 5
    assert json.loads((tmp_path / "out" / "regeneration.json").read_text())["max_new_tokens"] == 5


@pytest.mark.parametrize("flags", [["--chunk-size", "4"], ["--seed", "1"]])
def test_a_larger_limit_with_settings_that_move_no_reply_reuses_the_merged_answers(tmp_path, monkeypatch, flags):
    """Another --chunk-size, or a greedy job's other --seed, writes the same replies (--check passes with them), yet
    extending the shipped data with one generated every answer again: hours on CPU, and the shipped replies replaced."""
    prompt_file(tmp_path / "prompts.jsonl", 5)
    regenerate.run(args_for(tmp_path, "--limit", "4"))
    shipped = load_from_disk(str(tmp_path / "out")).to_list()
    shutil.rmtree(tmp_path / "out.parts")  # as shipped

    generated = count_generated(monkeypatch)
    assert regenerate.run(args_for(tmp_path, *flags))["num_conversations"] == 5
    assert len(generated) == 1  # p4 only
    assert load_from_disk(str(tmp_path / "out")).to_list()[:4] == shipped
    assert regenerate.main([*args_for_argv(tmp_path, *flags), "--check"]) == 0


def test_a_smaller_limit_never_shrinks_a_finished_dataset_unasked(tmp_path, capsys):
    """A plain run with --limit 64 over the 2048 shipped answers merged 64 and lost the rest (no .parts folder on a
    fresh clone), with no model loaded and no --overwrite."""
    prompt_file(tmp_path / "prompts.jsonl", 5)
    regenerate.run(args_for(tmp_path))
    shipped = load_from_disk(str(tmp_path / "out")).to_list()
    shutil.rmtree(tmp_path / "out.parts")
    capsys.readouterr()
    for flags in (["--limit", "2"], ["--limit", "2", "--merge-only"], ["--limit", "4"]):  # 4: one answer fewer
        limit = int(flags[1])
        assert regenerate.main([*args_for_argv(tmp_path), *flags]) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: --out {tmp_path / 'out'} holds a dataset answering 5 prompts and this job writes {limit} "
            f"(--limit): the other {5 - limit} answers would be lost; give another --out, or pass --overwrite to "
            f"replace it with the {limit}; nothing was written")
        assert load_from_disk(str(tmp_path / "out")).to_list() == shipped and not (tmp_path / "out.parts").exists()
    assert regenerate.run(args_for(tmp_path))["num_conversations"] == 5  # the same count: nothing lost, nothing asked
    assert regenerate.run(args_for(tmp_path, "--limit", "2", "--overwrite"))["num_conversations"] == 2
    assert load_from_disk(str(tmp_path / "out")).to_list() == shipped[:2]


def test_data_made_before_response_ids_keeps_the_new_chunks_ids_when_extended(tmp_path):
    """The shipped data was made before regenerate.py kept response_ids: extended with a larger --limit, its reused
    first chunk has no such key, and Dataset.from_list (columns from the first row) dropped the new chunk's ids."""
    prompt_file(tmp_path / "prompts.jsonl", 4)  # 2 chunks
    regenerate.run(args_for(tmp_path, "--limit", "2"))
    summary = (tmp_path / "out" / "regeneration.json").read_text()
    old = load_from_disk(str(tmp_path / "out")).remove_columns(["response_ids"]).to_list()  # as the older script wrote it
    shutil.rmtree(tmp_path / "out")
    shutil.rmtree(tmp_path / "out.parts")
    Dataset.from_list(old).save_to_disk(str(tmp_path / "out"))
    (tmp_path / "out" / "regeneration.json").write_text(summary)

    regenerate.run(args_for(tmp_path))
    data = load_from_disk(str(tmp_path / "out"))
    assert data["response_ids"][:2] == [None, None]  # the reused answers train from their text, as before
    new = data.to_list()[2:]
    assert all(row["response_ids"] is not None and len(row["response_ids"]) == row["response_tokens"] for row in new)


def test_a_dataset_that_already_answers_the_job_is_left_as_it_is(tmp_path, monkeypatch, capsys):
    """Rerunning a finished job (`make data` on the default recipe, whose data ships) merged the dataset again from
    its own chunks: the shipped data/smollm2-135m was rewritten, its int32 response_ids widened and recover_ids.py's
    record dropped from regeneration.json, with nothing it answers changed."""
    prompt_file(tmp_path / "prompts.jsonl", 4)
    regenerate.run(args_for(tmp_path))
    shutil.rmtree(tmp_path / "out.parts")  # as shipped
    summary = tmp_path / "out" / "regeneration.json"
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "response_ids": {"recovered": 4}}))
    shipped = {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()}
    monkeypatch.setattr(regenerate, "load_frozen_target", lambda *args, **kwargs: pytest.fail("loaded the target"))
    capsys.readouterr()
    assert regenerate.run(args_for(tmp_path))["response_ids"] == {"recovered": 4}
    assert capsys.readouterr().out == (f"[regenerate] {tmp_path / 'out'} already answers these 4 prompts with these "
                                       "settings; nothing to do\n")
    assert {path.name: path.read_bytes() for path in (tmp_path / "out").iterdir()} == shipped
    assert not (tmp_path / "out.parts").exists()
    # An edited prompt (the same count) is answered again, as before.
    prompt_file(tmp_path / "prompts.jsonl", 4)
    lines = (tmp_path / "prompts.jsonl").read_text().splitlines()
    (tmp_path / "prompts.jsonl").write_text("\n".join([*lines[:3], lines[3].replace("about 3", "about three")]) + "\n")
    monkeypatch.undo()
    assert regenerate.run(args_for(tmp_path))["num_conversations"] == 4

    assert load_from_disk(str(tmp_path / "out"))[3]["messages"][0]["content"] == "Say something about three."


def test_an_edited_prompt_fails_the_check_every_training_start_runs(tmp_path, capsys):
    """--check counted the prompts file's lines: a prompt edited in place (the same count) passed every training start,
    which trained on the replies to the old text, while `make data` answered it again. regeneration.json records the
    sha256 of the prompts answered, which --check reads as the generator does (without torch's imports)."""
    prompts = tmp_path / "prompts.jsonl"
    lines = [  # an id, none, null, a number; fields the generator drops; a conversation's answer; a blank line
        {"id": "p0", "messages": [{"role": "user", "content": "Say something about 0."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "About 1?"}]},
        {"id": None, "messages": [{"role": "user", "content": "Say something about 2.", "name": "x"}], "source": "web"},
        {"id": 7, "messages": [{"role": "user", "content": "And 3?"}, {"role": "assistant", "content": "An old reply."}]},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines[:2]) + "\n\n"
                       + "\n".join(json.dumps(line) for line in lines[2:]) + "\n")
    assert regenerate.main(args_for_argv(tmp_path)) == 0
    assert len(json.loads((tmp_path / "out" / "regeneration.json").read_text())["prompts_sha256"]) == 64
    assert regenerate.main(args_for_argv(tmp_path, "--check")) == 0  # read as the generator read them
    prompts.write_text(prompts.read_text().replace("An old reply.", "Another old reply."))  # not a prompt's text
    assert regenerate.main(args_for_argv(tmp_path, "--check")) == 0

    prompts.write_text(prompts.read_text().replace("about 2.", "about two."))
    capsys.readouterr()
    assert regenerate.main(args_for_argv(tmp_path, "--check")) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {prompts}: prompts that {tmp_path / 'out'} answers changed since it was generated (the same 4, other "
        "text or ids): this command without --check regenerates the chunks that hold them")

    # as a script, the check still answers before torch loads
    script = Path(regenerate.__file__).resolve()
    checked = subprocess.run([sys.executable, "-X", "importtime", str(script), *args_for_argv(tmp_path, "--check")],
                             capture_output=True, text=True, cwd=script.parents[1],
                             env={**os.environ, "PYTHONPATH": str(script.parents[1])})
    assert checked.returncode == 2 and "prompts that" in checked.stderr
    assert not re.search(r"\|\s+torch$", checked.stderr, re.MULTILINE)
    assert regenerate.main(args_for_argv(tmp_path)) == 0
    assert regenerate.main(args_for_argv(tmp_path, "--check")) == 0
    # The script's own exit status is what training reads at each start: the data now passes there too.
    checked = subprocess.run([sys.executable, str(script), *args_for_argv(tmp_path, "--check")], capture_output=True,
                             text=True, cwd=script.parents[1], env={**os.environ, "PYTHONPATH": str(script.parents[1])})
    assert checked.returncode == 0 and not checked.stderr, checked.stderr

    # A line appended: the count's message, as before; a --limit of the prompts answered compares only those.
    prompts.write_text(prompts.read_text() + json.dumps({"messages": [{"role": "user", "content": "And 4?"}]}) + "\n")
    assert regenerate.main(args_for_argv(tmp_path, "--check")) == 2
    assert "holds a dataset made with other settings (prompts answered: 4 -> 5)" in capsys.readouterr().err
    assert regenerate.main(args_for_argv(tmp_path, "--check", "--limit", "4")) == 0

    # Data recorded without the digest (made before it was recorded) is checked as before: by the count.
    summary = tmp_path / "out" / "regeneration.json"
    summary.write_text(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if k != "prompts_sha256"}))
    prompts.write_text(prompts.read_text().replace("And 3?", "And three?"))
    assert regenerate.main(args_for_argv(tmp_path, "--check", "--limit", "4")) == 0


def test_a_check_of_data_or_prompts_not_there_is_one_line_naming_the_remedy(tmp_path, capsys):
    prompt_file(tmp_path / "prompts.jsonl", 2)
    assert regenerate.main(args_for_argv(tmp_path, "--check")) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'out'} does not exist yet: generate it (this "
                                               "command without --check)")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "regeneration.json").write_text(json.dumps({"target": "tiny-random", "num_prompts": 2}))
    missing = tmp_path / "moved.jsonl"
    assert regenerate.main([*args_for_argv(tmp_path), "--prompts", str(missing), "--check"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --prompts {missing} does not exist; give the prompts file the "
                                               "data was made from")


def test_a_prompt_the_generator_would_refuse_fails_the_check_in_one_line(tmp_path, capsys):
    """--check reads the prompts without torch: a line edited into no conversation (no messages, or not an object)
    is read as it is, so its digest matches none recorded, rather than a KeyError traceback at every training start."""
    prompts = prompt_file(tmp_path / "prompts.jsonl", 2)
    assert regenerate.main(args_for_argv(tmp_path)) == 0
    first = prompts.read_text().splitlines()[0]
    for edited in ({"id": "p1", "text": "Say something about 1."}, ["Say something about 1."]):
        prompts.write_text(f"{first}\n{json.dumps(edited)}\n")
        capsys.readouterr()
        assert regenerate.main(args_for_argv(tmp_path, "--check")) == 2
        assert capsys.readouterr().err.strip() == (
            f"error: {prompts}: prompts that {tmp_path / 'out'} answers changed since it was generated (the same 2, "
            "other text or ids): this command without --check regenerates the chunks that hold them")


def test_a_prompts_file_that_is_not_utf8_fails_the_check_in_the_generators_line(tmp_path, capsys):
    """--check counted the prompts in a file opened as text: a byte that is not UTF-8 (a prompt saved as latin-1)
    stopped it, and so every training start, with a UnicodeDecodeError traceback; the generator's line names it."""
    prompts = prompt_file(tmp_path / "prompts.jsonl", 2)
    assert regenerate.main(args_for_argv(tmp_path)) == 0
    prompts.write_bytes(prompts.read_bytes().replace(b"about 1", b"about caf\xe9"))
    capsys.readouterr()
    assert regenerate.main(args_for_argv(tmp_path, "--check")) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {prompts}:2: not UTF-8 (byte 0xe9 ")


def test_a_limit_above_the_prompts_files_length_answers_every_prompt_and_passes_the_check(tmp_path):
    """A recipe whose data.regenerate.limit is more than its prompts file holds: --check must count the prompts there
    are, or every training start refuses the data and asks for answers to prompts that do not exist."""
    prompt_file(tmp_path / "prompts.jsonl", 3)
    assert regenerate.run(args_for(tmp_path, "--limit", "10"))["num_prompts"] == 3
    assert regenerate.main(args_for_argv(tmp_path, "--limit", "10", "--check")) == 0


def test_a_smaller_limit_over_data_answering_the_whole_prompts_file_is_told_to_raise_the_limit(tmp_path, capsys):
    """Data that answers every prompt of its file, checked with a smaller --limit: the replies are this job's, so the
    remedy is the limit, not --overwrite, which would throw the answers away to make them again."""
    prompt_file(tmp_path / "prompts.jsonl", 3)
    regenerate.run(args_for(tmp_path))
    capsys.readouterr()
    assert regenerate.main(args_for_argv(tmp_path, "--limit", "2", "--check")) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("raise --limit to 3 to use all 3, or cut the data to 2 with --overwrite "
                        "(this command without --check)") and "\n" not in err, err


def lora_adapter(path, seed: int) -> str:
    """A LoRA adapter on tiny-random, strong enough to change its greedy replies."""
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                        init_lora_weights=False)
    model = get_peft_model(load_target("tiny-random", torch.float32)[0], config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.mul_(3)
    model.save_pretrained(path)
    return str(path)


def test_a_target_adapter_writes_the_replies_and_only_its_data_passes_the_check(tmp_path):
    """--target-adapter (a recipe's model.target_adapter): the replies are the target's with the adapter merged, as
    training merges it, and regeneration.json records the adapter, so that --check tells its data from the base
    model's. Before, there was no such option: a run with an adapter trained on the base model's replies."""
    prompt_file(tmp_path / "prompts.jsonl", 3)
    adapter = lora_adapter(tmp_path / "adapter", 0)
    summary = regenerate.run(args_for(tmp_path, "--target-adapter", adapter))
    assert summary["target_adapter"] == adapter and summary["target_adapter_sha256"] == adapter_fingerprint(adapter)
    recorded = json.loads((tmp_path / "out" / "regeneration.json").read_text())
    assert recorded["target_adapter"] == adapter and recorded["target_adapter_sha256"] == adapter_fingerprint(adapter)
    base_dir = tmp_path / "base"
    regenerate.run(args_for(tmp_path, "--out", str(base_dir)))
    adapted_ids = load_from_disk(str(tmp_path / "out"))["response_ids"]
    assert adapted_ids != load_from_disk(str(base_dir))["response_ids"]
    model, tokenizer = load_frozen_target("tiny-random", torch.float32, adapter)
    stops = regenerate.stop_token_ids(model, tokenizer)
    prompts = [regenerate.chat_prompt_ids(tokenizer, row["messages"][:-1], "test", "") for row in load_from_disk(str(tmp_path / "out"))]
    greedy = regenerate.generate_transformers(model, prompts, stops[0], stops, 2, 6, 0.0, 1.0)
    assert adapted_ids == [regenerate.cut_at_stop(tokens, set(stops))[0] for tokens in greedy]

    regenerate.run(args_for(tmp_path, "--target-adapter", adapter, "--check"))  # its own data
    with pytest.raises(DDTreeError, match=rf"holds a dataset made with other settings \(target_adapter: "
                                          rf"'{re.escape(adapter)}' -> None\)"):
        regenerate.run(args_for(tmp_path, "--check"))  # a run without the adapter
    with pytest.raises(DDTreeError, match=rf"\(target_adapter: None -> '{re.escape(adapter)}'\)"):
        regenerate.run(args_for(tmp_path, "--out", str(base_dir), "--target-adapter", adapter, "--check"))
    shutil.copytree(adapter, tmp_path / "copy")  # the same adapter at another path (a node's own disk)
    regenerate.run(args_for(tmp_path, "--target-adapter", str(tmp_path / "copy"), "--check"))
    lora_adapter(tmp_path / "adapter", 1)  # retrained where it was: its replies are another target's
    with pytest.raises(DDTreeError, match=r"\(target_adapter_sha256: '[0-9a-f]{64}' -> '[0-9a-f]{64}'\)"):
        regenerate.run(args_for(tmp_path, "--target-adapter", adapter, "--check"))


def local_target(tiny, folder: Path, seed: int | None = None) -> str:
    """tiny-random saved as a local target folder; with `seed`, its weights drawn again (a fine-tune saved over it)."""
    model, tokenizer = tiny
    if seed is not None:
        import copy

        model = copy.deepcopy(model)
        torch.manual_seed(seed)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_a_local_target_saved_over_in_place_is_told_from_the_one_that_wrote_the_data(tiny, tmp_path, capsys):
    """A target folder fine-tuned and saved at the same path writes other replies: --check passed the old model's and
    `make data` said "nothing to do", so training learned replies the target no longer gives. The weight files'
    fingerprint (weights_fingerprint, a feature store's target_weights) is recorded and compared; data recorded
    without it is taken as before."""
    prompt_file(tmp_path / "prompts.jsonl", 2)
    target = local_target(tiny, tmp_path / "target")
    argv = args_for_argv(tmp_path)
    argv[argv.index("tiny-random")] = target
    assert regenerate.main(argv) == 0
    recorded = json.loads((tmp_path / "out" / "regeneration.json").read_text())
    assert recorded["target_weights"] == weights_fingerprint(Path(target)) is not None
    assert json.loads((tmp_path / "out.parts" / "settings.json").read_text())["target_weights"] == recorded["target_weights"]
    assert regenerate.main([*argv, "--check"]) == 0
    shutil.copytree(tmp_path / "out", tmp_path / "before")

    local_target(tiny, Path(target), seed=1)  # fine-tuned and saved over
    capsys.readouterr()
    assert regenerate.main([*argv, "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tmp_path / 'out'} holds a dataset made with other settings (target {target}: its weight "
                   "files changed since the data was generated): generate it again with "
                   "--overwrite (this command without --check), or give another output folder")
    assert regenerate.main(argv) == 2  # a plain rerun: not "nothing to do"
    captured = capsys.readouterr()
    assert "nothing to do" not in captured.out and f"(target {target}: its weight files changed" in captured.err
    assert regenerate.main([*argv, "--overwrite"]) == 0  # the chunks of the old weights are replaced, not resumed
    assert f"removed 1 chunk of {tmp_path / 'out.parts'} made with other settings (target {target}: its weight " \
        "files" in capsys.readouterr().out
    assert regenerate.main([*argv, "--check"]) == 0

    # Data recorded before the fingerprint was (no target_weights) is taken as it was.
    shutil.rmtree(tmp_path / "out")
    shutil.move(tmp_path / "before", tmp_path / "out")
    summary = tmp_path / "out" / "regeneration.json"
    summary.write_text(json.dumps({k: v for k, v in json.loads(summary.read_text()).items() if k != "target_weights"}))
    assert regenerate.main([*argv, "--check"]) == 0


def test_a_target_adapter_that_cannot_be_merged_is_one_line_before_any_work(tmp_path, capsys):
    prompt_file(tmp_path / "prompts.jsonl", 2)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    assert regenerate.main(args_for_argv(tmp_path, "--target-adapter", str(tmp_path / "adapter"))) == 2
    assert capsys.readouterr().err.strip() == (f"error: --target-adapter={tmp_path / 'adapter'}: adapter_config.json is "
                                               "there but not the adapter's weights (adapter_model.safetensors or "
                                               "adapter_model.bin): copy the whole folder `save_pretrained` wrote")
    adapter = lora_adapter(tmp_path / "adapter", 0)
    assert regenerate.main(args_for_argv(tmp_path, "--target-adapter", adapter, "--backend", "vllm")) == 2
    assert "--backend vllm loads --target tiny-random from its files and merges no --target-adapter" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.parts").exists()


def test_a_job_stopped_before_its_first_chunk_takes_corrected_settings(tmp_path):
    """Bad input (a target that does not exist, say) stops after settings.json and before any chunk: the rerun with
    the right value was refused as 'other settings' though nothing was there to mix with."""
    prompt_file(tmp_path / "prompts.jsonl", 2)
    with pytest.raises(DDTreeError):
        regenerate.run(args_for(tmp_path, "--target", str(tmp_path / "no-such-target")))
    assert (tmp_path / "out.parts" / "settings.json").is_file() and not list((tmp_path / "out.parts").glob("chunk-*"))
    assert regenerate.run(args_for(tmp_path))["num_conversations"] == 2


def test_overwrite_replaces_the_unfinished_chunks_of_other_settings_too(tmp_path, capsys, monkeypatch):
    """A job stopped before its merge leaves chunks in <out>.parts; a rerun with other settings and --overwrite was
    still told to delete that folder by hand. --overwrite replaces them too, says so in one line, and deletes nothing
    else there."""
    prompt_file(tmp_path / "prompts.jsonl", 4)  # 2 chunks
    parts = tmp_path / "out.parts"
    assert regenerate.run(args_for(tmp_path, "--num-shards", "2", "--shard-index", "0")) is None  # chunk 0 only
    (parts / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert regenerate.main(args_for_argv(tmp_path, "--max-new-tokens", "5")) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {parts} holds chunks made with other settings (max_new_tokens: 6 -> 5); pass --overwrite to make them "
        "again (not with --merge-only), or choose another --out")
    # a merge makes none again: they are not removed for it to find none
    assert regenerate.main(args_for_argv(tmp_path, "--max-new-tokens", "5", "--merge-only", "--overwrite")) == 2
    assert "holds chunks made with other settings (max_new_tokens: 6 -> 5)" in capsys.readouterr().err
    assert (parts / "chunk-00000.jsonl").is_file()  # refused: nothing removed
    generated = count_generated(monkeypatch)
    summary = regenerate.run(args_for(tmp_path, "--max-new-tokens", "5", "--overwrite"))
    assert summary["num_conversations"] == 4 and len(generated) == 4  # the old chunk was not resumed
    assert f"[regenerate] --overwrite: removed 1 chunk of {parts} made with other settings (max_new_tokens: 6 -> 5)" \
        in capsys.readouterr().out
    assert json.loads((parts / "settings.json").read_text())["max_new_tokens"] == 5
    assert (parts / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("other, said", [
    ({"max_new_tokens": 3}, "max_new_tokens: 3 -> 6"),
    # the same replies, chunked otherwise: each job writes its chunk 1 over the other's, with other prompts in it
    ({"chunk_size": 3}, "chunk_size: 3 -> 2"),
    # deleted (its folder cleared by hand): the next job would record its own settings over this one's chunks
    (None, "settings.json is gone"),
])
def test_shards_started_together_with_other_settings_never_mix_their_chunks(tmp_path, monkeypatch, other, said):
    """Two shards launched at once: before either wrote a chunk, the second replaced settings.json with its own
    (max_new_tokens 3 over 6), and the merge held replies of both lengths under one regeneration.json."""
    prompt_file(tmp_path / "prompts.jsonl", 4)  # 2 chunks
    real = regenerate.generate_transformers
    started = []

    def other_shard_starts_meanwhile(model, prompts, *args, **kwargs):
        if not started:  # while shard 0 decodes its first chunk, settings.json changes under it
            started.append(True)
            if other is None:
                (tmp_path / "out.parts" / "settings.json").unlink()
            else:
                regenerate.check_settings(tmp_path / "out.parts", {**regenerate_settings(tmp_path), **other})
        return real(model, prompts, *args, **kwargs)

    monkeypatch.setattr(regenerate, "generate_transformers", other_shard_starts_meanwhile)
    with pytest.raises(DDTreeError, match=r"another job started there with other settings while this one ran "
                                          rf"\({re.escape(said)}\); this job wrote no chunk since"):
        regenerate.run(args_for(tmp_path, "--num-shards", "2", "--shard-index", "0"))
    assert not list((tmp_path / "out.parts").glob("chunk-*"))


def regenerate_settings(tmp_path) -> dict:
    """The settings run() records for args_for(tmp_path)."""
    return {"target": "tiny-random", "prompts": str(tmp_path / "prompts.jsonl"), "max_new_tokens": 6,
            "temperature": 0.0, "top_p": 1.0, "seed": 0, "dtype": "float32", "chunk_size": 2}


def test_work_files_follow_the_umask(tmp_path):
    # Chunks and settings go through a temp file (0600 as created); shards of other users must read them.
    previous = os.umask(0o022)
    try:
        regenerate.check_settings(tmp_path, {"target": "tiny-random"})
    finally:
        os.umask(previous)
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"]
    assert stat.S_IMODE((tmp_path / "settings.json").stat().st_mode) == 0o644


def test_cli_reports_bad_prompt_file_with_line(tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": "nope"}\n')
    assert regenerate.main(["--target", "tiny-random", "--prompts", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and f"{bad}:2:" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_record_of_assistant_turns_alone_is_one_line_naming_it_before_the_target_loads(tmp_path, capsys, monkeypatch):
    """A record with no prompt turn (a response file given as --prompts, say) leaves nothing for the target to
    answer. The tiny target's template refuses the empty conversation, but one that adds a default system turn
    renders it, and the job would then write a reply to nothing under the record's id: the cause is named first."""
    monkeypatch.setattr(regenerate, "load_frozen_target", lambda *args, **kwargs: pytest.fail("loaded the target"))
    prompts = prompt_file(tmp_path / "prompts.jsonl", 2)
    prompts.write_text(prompts.read_text()
                       + '{"id": "answer-only", "messages": [{"role": "assistant", "content": "Hello."}]}\n')
    assert regenerate.main(args_for_argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {prompts}: record 'answer-only' has only assistant turns; it needs a prompt"
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.parts").exists()


def test_a_lone_surrogate_in_a_prompt_is_one_line_naming_file_line_and_field_before_the_target_loads(
        tmp_path, capsys, monkeypatch):
    """JSON's "\\ud83d" (UTF-16 text cut mid-pair) is valid JSON and reads as a lone surrogate: the tokenizer's
    TypeError, a traceback with exit 1 naming neither the file nor the line, once the target had loaded."""
    monkeypatch.setattr(regenerate, "load_frozen_target", lambda *args, **kwargs: pytest.fail("loaded the target"))
    prompts = prompt_file(tmp_path / "prompts.jsonl", 2)
    prompts.write_text(prompts.read_text() + '{"messages": [{"role": "user", "content": "cut \\ud83d"}]}\n')
    assert regenerate.main(args_for_argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {prompts}:3: messages[0].content: not valid UTF-8 text (a lone surrogate, U+D83D")
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_target_without_a_chat_template_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """A base model's folder: rendering the first prompt raised transformers' ValueError, a 30-line traceback."""
    model, tokenizer = tiny
    monkeypatch.setattr(tokenizer, "chat_template", None)
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    prompts = prompt_file(tmp_path / "prompts.jsonl", 2)
    argv = args_for_argv(tmp_path)
    argv[argv.index("tiny-random")] = str(tmp_path / "base")
    assert regenerate.main(argv) == 2
    err = capsys.readouterr().err  # after the progress bars of saving and loading the target
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error: {prompts}:1: the target's tokenizer has no chat template to "
                                            f"apply; {CHAT_TARGET}")


@pytest.mark.parametrize("refused", [1, 2])
def test_a_prompt_the_template_refuses_stops_the_job_before_the_target_loads(tiny, tmp_path, capsys, monkeypatch,
                                                                             refused):
    """A template without a system role (Gemma's) refuses a system turn: the prompt that had one stopped the job only
    when its chunk came up, after the target had loaded and the chunks before it were generated (hours, on a CPU),
    and its advice was to give a chat (instruct) model, which the target was. One such prompt is enough."""
    model, tokenizer = tiny
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{% if m['role'] == 'system' %}"
                        "{{ raise_exception('System role not supported') }}{% endif %}{{ m['content'] }}{% endfor %}")
    model.save_pretrained(tmp_path / "no-system")
    tokenizer.save_pretrained(tmp_path / "no-system")
    monkeypatch.undo()
    monkeypatch.setattr(regenerate, "load_frozen_target", lambda *args, **kwargs: pytest.fail("loaded the target"))
    prompts = prompt_file(tmp_path / "prompts.jsonl", 3)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    prompts.write_text(prompts.read_text() + "".join(json.dumps({"messages": system}) + "\n" for _ in range(refused)))
    argv = args_for_argv(tmp_path)
    argv[argv.index("tiny-random")] = str(tmp_path / "no-system")
    assert regenerate.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {prompts}:4: the target's chat template refused the messages (System role not supported); fix "
        f"them, or {regenerate.TEMPLATE_REFUSED}; the template refuses {refused} of the job's {3 + refused} prompts, "
        "the first named here; nothing was generated")
    assert "chat (instruct) model" not in regenerate.TEMPLATE_REFUSED
    assert not list((tmp_path / "out.parts").glob("chunk-*")) and not (tmp_path / "out").exists()
    # A folder without a tokenizer is the line loading the target gave, now before the weights load.
    model.save_pretrained(tmp_path / "no-tokenizer")
    argv[argv.index(str(tmp_path / "no-system"))] = str(tmp_path / "no-tokenizer")
    assert regenerate.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith(f"error: could not load target '{tmp_path / 'no-tokenizer'}': ")
    assert "Traceback" not in err


@pytest.mark.parametrize("flags,named", [(["--limit", "0"], "--limit 0"), (["--limit", "-1"], "--limit -1"),
                                         (["--threads", "0"], "--threads 0"),
                                         (["--temperature", "-1"], "--temperature -1"),
                                         (["--temperature", "1", "--top-p", "0"], "--top-p 0"),
                                         (["--num-shards", "0"], "--num-shards 0 must be at least 1"),
                                         # no chunk is its own: it exited 0 ("other shards still running") and the
                                         # shard it was meant to be never ran
                                         (["--num-shards", "2", "--shard-index", "2"],
                                          "--shard-index 2 must be in 0..1"),
                                         (["--shard-index", "-1"], "--shard-index -1 must be in 0..0"),
                                         (["--chunk-size", "0"],
                                          "--chunk-size, --batch-size and --max-new-tokens must be positive")])
def test_bad_settings_are_one_line_before_any_work(tmp_path, capsys, flags, named):
    prompt_file(tmp_path / "prompts.jsonl", 2)
    assert regenerate.main([*args_for_argv(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and named in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.parts").exists()


@pytest.mark.parametrize("flags, named", [
    (["--backend", "vllm"], "--backend vllm: vLLM is not installed"),  # a ModuleNotFoundError traceback before
    (["--device", "cuda"], "--device cuda: this machine has no CUDA GPU"),  # an AssertionError once the target loaded
])
def test_a_backend_or_device_this_machine_lacks_is_one_line(tmp_path, capsys, flags, named):
    if flags[0] == "--backend" and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    if flags[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    prompt_file(tmp_path / "prompts.jsonl", 2)
    assert regenerate.main([*args_for_argv(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and named in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out.parts").exists()


def fake_vllm(monkeypatch) -> dict:
    """A stand-in vllm module (vLLM is not installed on the CPU box) that records what regenerate asks of it; each
    reply is the prompt's last token and then 2."""
    asked = {}

    class LLM:
        def __init__(self, **kwargs):
            asked["llm"] = kwargs

        def generate(self, prompts, params, use_tqdm):
            asked["params"] = [vars(p) for p in params]
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=(p["prompt_token_ids"][-1], 2))])
                    for p in prompts]

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(LLM=LLM, SamplingParams=SimpleNamespace))
    return asked


def test_the_vllm_backend_asks_for_the_jobs_stop_ids_length_and_per_prompt_seeds(monkeypatch):
    """The vLLM path runs on GPU machines only, where nothing held its settings: without stop_token_ids every reply
    runs past its end of turn to max_tokens, without max_tokens vLLM's default (16) cuts every reply, and a greedy
    job's top_p stays 1.0 as the settings record it."""
    asked = fake_vllm(monkeypatch)
    generator = regenerate.VLLMGenerator("tiny-random", "float32", 3)
    assert generator.generate([[1, 5], [6]], [2, 7], 9, 0.0, 0.5, [11, 12]) == [[5, 2], [6, 2]]
    assert (asked["llm"]["dtype"], asked["llm"]["seed"]) == ("float32", 3)
    assert asked["params"] == [{"temperature": 0.0, "top_p": 1.0, "max_tokens": 9, "stop_token_ids": [2, 7],
                                "seed": seed} for seed in (11, 12)]
    generator.generate([[1]], [2], 9, 0.8, 0.5, [13])
    assert (asked["params"][0]["temperature"], asked["params"][0]["top_p"]) == (0.8, 0.5)


def test_auto_picks_vllm_only_where_it_imports_and_a_gpu_is_present(monkeypatch):
    """--backend auto on a CPU machine with vLLM installed would hand the job to vLLM, which needs a GPU."""
    fake_vllm(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not regenerate.vllm_usable()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert regenerate.vllm_usable()
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed: its import fails
    assert not regenerate.vllm_usable()


def test_the_vllm_paths_stop_ids_are_every_end_of_turn_the_target_lists(tiny, tmp_path):
    """vLLM holds the weights, so its stop ids come from the target's config files: a generation config listing two
    eos ids (an end of turn and <|endoftext|>) must give both, or a reply ending on the other runs past it."""
    model, tokenizer = tiny
    folder = Path(local_target(tiny, tmp_path / "target"))
    ends = regenerate.stop_token_ids(model, tokenizer)
    ends = sorted({*ends, next(i for i in range(len(ends) + 1) if i not in ends)})  # a second end
    generation_config = folder / "generation_config.json"
    config = json.loads(generation_config.read_text()) if generation_config.is_file() else {}
    generation_config.write_text(json.dumps({**config, "eos_token_id": ends}))
    assert regenerate.tokenizer_and_stops(str(folder))[1] == ends


def test_a_vllm_job_writes_vllms_replies_cut_at_the_targets_stop_ids_without_loading_the_weights(tmp_path, monkeypatch,
                                                                                                  capsys):
    """The job's vLLM path, run here with a stand-in vllm: the tokenizer and stop ids from the target's files (vLLM
    holds the weights), every chunk's replies cut at the stop and written, and the progress bar counting them."""
    asked = fake_vllm(monkeypatch)
    sys.modules["vllm"].__spec__ = importlib.util.spec_from_loader("vllm", None)  # what find_spec reads
    monkeypatch.setattr(regenerate, "load_frozen_target", lambda *args, **kwargs: pytest.fail("loaded the weights"))
    prompt_file(tmp_path / "prompts.jsonl", 3)  # 2 chunks
    assert regenerate.run(args_for(tmp_path, "--backend", "vllm"))["num_conversations"] == 3
    tokenizer, stops = regenerate.tokenizer_and_stops("tiny-random")
    assert asked["llm"]["dtype"] == "float32"
    assert [(p["stop_token_ids"], p["max_tokens"]) for p in asked["params"]] == [(stops, 6)]  # the last chunk's one
    rows = load_from_disk(str(tmp_path / "out")).to_list()
    assert [row["id"] for row in rows] == ["p0", "p1", "p2"]
    for row in rows:  # each reply: the prompt's last token, then the stop (2, <|im_end|>), cut off
        assert (row["finish_reason"], row["response_tokens"]) == ("stop", 1) and stops == [2]
        assert row["messages"][-1]["content"] == tokenizer.decode(row["response_ids"]) == "\n"
    assert "3/3" in capsys.readouterr().out


def test_a_work_folder_path_that_is_a_file_is_one_line(tmp_path, capsys):
    prompt_file(tmp_path / "prompts.jsonl", 2)
    (tmp_path / "out.parts").write_text("mine")
    assert regenerate.main(args_for_argv(tmp_path)) == 2
    assert f"{tmp_path / 'out.parts'} (the work folder of --out" in capsys.readouterr().err
    assert (tmp_path / "out.parts").read_text() == "mine"


def test_an_out_folder_that_is_not_its_dataset_is_never_replaced(tmp_path, capsys):
    prompt_file(tmp_path / "prompts.jsonl", 2)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    assert regenerate.main(args_for_argv(tmp_path)) == 2
    assert "is not a dataset this script wrote" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["notes.txt"] and not (tmp_path / "out.parts").exists()
    (tmp_path / "out" / "notes.txt").unlink()  # an empty folder is used, and its own dataset is replaced
    assert regenerate.run(args_for(tmp_path))["num_conversations"] == 2
    assert regenerate.run(args_for(tmp_path, "--limit", "1", "--overwrite"))["num_conversations"] == 1


@pytest.mark.parametrize("section, named", [
    ("  regenerate:\n    dtype: bf16", "data.regenerate.dtype=bf16: invalid choice: 'bf16'"),  # a KeyError mid-run
    ("  regenerate:\n    backend: vlm", "data.regenerate.backend=vlm: invalid choice: 'vlm'"),  # silently transformers
    ("  regenerate:\n    limit: abc", "data.regenerate.limit=abc: invalid int value"),
    ("  regenerate:\n    - limit", "data.regenerate must map data/regenerate.py's options to values, not be a list"),
    ("  regenerate: [", "not valid YAML"),
])
def test_bad_regenerate_values_in_a_recipe_are_one_line_naming_the_field(tmp_path, section, named):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  target: tiny-random\ndata:\n  data_path: {tmp_path / 'out'}\n{section}\n")
    with pytest.raises(DDTreeError, match=re.escape(f"{recipe}: ") + ".*" + re.escape(named)):
        regenerate.parse_args(["--recipe", str(recipe)])


@pytest.mark.parametrize("text, named", [
    ("model:\n  target: tiny-random\ndata: data/smollm2-135m\n", "data must be a section of fields"),
    ("model: tiny-random\ndata:\n  data_path: out\n", "model must be a section of fields"),
])
def test_a_recipe_section_given_as_a_value_is_one_line(tmp_path, text, named):
    """`data: data/smollm2-135m` was an AttributeError traceback ('str' object has no attribute 'get')."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    with pytest.raises(DDTreeError, match=re.escape(f"{recipe}: {named} (field: value lines under it), not a str")):
        regenerate.parse_args(["--recipe", str(recipe)])


def test_a_recipes_null_limit_means_every_prompt(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  target: tiny-random\ndata:\n  data_path: {tmp_path / 'out'}\n  regenerate:\n"
                      "    limit: null\n    max_new_tokens: 5\n")
    args = regenerate.parse_args(["--recipe", str(recipe)])
    assert args.limit is None and args.max_new_tokens == 5


def test_recipe_supplies_target_and_output(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  target: tiny-random\ndata:\n  data_path: %s\n" % (tmp_path / "from-recipe"))
    args = regenerate.apply_recipe(regenerate.parse_args(["--recipe", str(recipe)]))
    assert (args.target, args.target_adapter, args.out) == ("tiny-random", None, tmp_path / "from-recipe")
    recipe.write_text(recipe.read_text().replace("target: tiny-random", "target: tiny-random\n  target_adapter: lora"))
    args = regenerate.apply_recipe(regenerate.parse_args(["--recipe", str(recipe)]))  # make data RECIPE=<it>
    assert (args.target, args.target_adapter) == ("tiny-random", "lora")
    args = regenerate.apply_recipe(regenerate.parse_args(["--recipe", str(recipe), "--out", "elsewhere"]))
    assert args.out == Path("elsewhere")
    with pytest.raises(DDTreeError, match="no output folder"):
        regenerate.apply_recipe(regenerate.parse_args([]))
    recipe.write_text("model:\n  target: tiny-random\ndata:\n  regenerate:\n    max_new_tokens: 5\n")  # no data_path
    assert regenerate.main(["--recipe", str(recipe)]) == 2
    assert capsys.readouterr().err.strip() == "error: no output folder: give --out, or --recipe with a data.data_path"
    # Neither a flag nor a recipe: the target the shipped data was written by, as --help says.
    assert regenerate.apply_recipe(regenerate.parse_args(["--out", "elsewhere"])).target == "smollm2-135m"


def test_a_recipe_is_named_as_training_names_it_or_given_as_a_file():
    by_name = regenerate.apply_recipe(regenerate.parse_args(["--recipe", "smollm2-135m"]))
    by_file = regenerate.apply_recipe(regenerate.parse_args(["--recipe", "recipes/smollm2-135m.yaml"]))
    assert (by_name.target, by_name.out) == (by_file.target, by_file.out) == ("smollm2-135m", Path("data/smollm2-135m"))
    with pytest.raises(DDTreeError, match="recipe smollm2 does not exist; give a file, or one of the recipes' names: .*tiny"):
        regenerate.parse_args(["--recipe", "smollm2"])


def test_a_recipe_file_outside_recipes_is_told_the_command_that_mends_its_data(tmp_path, capsys):
    """--check of a recipe given as a file elsewhere (no `make data` name) names regenerate.py --recipe <file>: the
    command must carry --overwrite, or pasted as it is it is refused again for the same data."""
    prompt_file(tmp_path / "prompts.jsonl", 2)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  target: tiny-random\ndata:\n  data_path: {tmp_path / 'out'}\n  regenerate:\n"
                      f"    prompts: {tmp_path / 'prompts.jsonl'}\n    max_new_tokens: 6\n    dtype: float32\n"
                      "    chunk_size: 2\n")
    assert regenerate.main(["--recipe", str(recipe)]) == 0
    recipe.write_text(recipe.read_text().replace("max_new_tokens: 6", "max_new_tokens: 5"))
    capsys.readouterr()
    assert regenerate.main(["--recipe", str(recipe), "--check"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        f"generate it again with --overwrite (`python data/regenerate.py --recipe {recipe} --overwrite`), or give "
        "another output folder")
    assert regenerate.main(["--recipe", str(recipe), "--overwrite"]) == 0  # the command named, pasted
    assert regenerate.main(["--recipe", str(recipe), "--check"]) == 0


def test_one_prompts_file_spelled_two_ways_resumes_and_reuses_the_answers(tmp_path, monkeypatch):
    """data/prompts/train_prompts.jsonl from the project's root, then by its absolute path: the work folder refused the
    resume ("delete <out>.parts to start over": every finished chunk lost), and a dataset extended without its .parts
    folder (the shipped one) reused nothing and generated every answer again."""
    monkeypatch.setattr(regenerate, "PROJECT_ROOT", tmp_path)  # tmp_path plays the project: prompts.jsonl is its file
    monkeypatch.chdir(tmp_path)
    prompt_file(tmp_path / "prompts.jsonl", 5)  # 3 chunks: 2 + 2 + 1
    relative, absolute = ["--prompts", "prompts.jsonl"], ["--prompts", str(tmp_path / "prompts.jsonl")]
    generated = count_generated(monkeypatch)
    assert regenerate.run(args_for(tmp_path, *relative, "--num-shards", "2", "--shard-index", "0")) is None
    assert len(generated) == 3  # chunks 0 and 2
    generated.clear()
    assert regenerate.run(args_for(tmp_path, *absolute))["num_conversations"] == 5
    assert len(generated) == 2  # chunk 1 only: the other two were taken as finished

    shutil.rmtree(tmp_path / "out.parts")  # as shipped
    prompt_file(tmp_path / "prompts.jsonl", 7)  # the same 5 first prompts, and 2 more
    generated.clear()
    assert regenerate.run(args_for(tmp_path, *relative))["num_conversations"] == 7
    assert len(generated) == 3  # chunk 2 (p4, now with p5) and chunk 3 (p6): chunks 0 and 1 came from the dataset


def test_a_recorded_prompts_path_is_the_projects_whatever_folder_the_job_runs_from(tmp_path, monkeypatch):
    """A relative prompts path in settings.json or regeneration.json is from the project's root (make runs there): read
    from the working folder instead, a job run elsewhere with the same file's absolute path was refused as other
    prompts, its finished chunks and the shipped data's answers with it."""
    project = tmp_path / "project"
    monkeypatch.setattr(regenerate, "PROJECT_ROOT", project)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    given = str(project / "data" / "prompts.jsonl")
    assert regenerate.changed_settings({"prompts": "data/prompts.jsonl"}, {"prompts": given}) == []
    assert regenerate.changed_settings({"prompts": "data/other.jsonl"}, {"prompts": given}) == [
        f"prompts: 'data/other.jsonl' -> {given!r}"]


def test_a_job_run_outside_the_project_records_its_prompts_so_that_their_absolute_path_resumes_it(
        tmp_path, monkeypatch):
    """`--prompts prompts.jsonl` in a folder of one's own was recorded as given and read back as the project's
    prompts.jsonl: the same job by the file's absolute path, or from another folder, was refused as other prompts (and
    offered --overwrite, which makes every answer again). Work recorded so before still resumes from its folder."""
    assert not tmp_path.is_relative_to(regenerate.PROJECT_ROOT)
    monkeypatch.chdir(tmp_path)
    prompt_file(tmp_path / "prompts.jsonl", 3)
    relative = ["--prompts", "prompts.jsonl"]
    assert regenerate.run(args_for(tmp_path, *relative, "--num-shards", "2", "--shard-index", "0")) is None
    recorded = json.loads((tmp_path / "out.parts" / "settings.json").read_text())["prompts"]
    assert recorded == str(tmp_path / "prompts.jsonl")
    elsewhere = tmp_path / "out.parts"
    monkeypatch.chdir(elsewhere)  # another folder, the file by its absolute path: the same job
    assert regenerate.run(args_for(tmp_path))["num_conversations"] == 3
    given_here = {"prompts": str(elsewhere / "prompts.jsonl")}
    assert regenerate.changed_settings({"prompts": "prompts.jsonl"}, given_here) == []


def test_greedy_data_recorded_without_sampling_is_never_read_as_sampled_per_chunk():
    """Only sampled data that records no `sampling` was made per chunk (recorded_settings): a greedy dataset asked to
    be sampled must be told it was greedy, not that it was sampled the old way."""
    greedy, sampled = {"temperature": 0}, {"temperature": 0.7, "sampling": regenerate.SAMPLING}
    assert regenerate.changed_settings(greedy, sampled) == [
        "temperature: 0 -> 0.7", f"sampling: None -> {regenerate.SAMPLING!r}"]
    assert regenerate.changed_settings({"temperature": 0.7}, sampled) == [
        f"sampling: 'per-chunk' -> {regenerate.SAMPLING!r}"]


def test_sampled_data_made_with_another_seed_is_not_this_jobs_though_greedy_data_is():
    """A sampled reply draws from a generator seeded from --seed, so data sampled with another seed holds other
    replies: --check and a resume must not take it for this job's. A greedy reply is the same whatever the seed."""
    sampled = {"temperature": 0.7, "sampling": regenerate.SAMPLING, "seed": 0}
    assert regenerate.changed_replies(sampled, {**sampled, "seed": 1}) == ["seed: 0 -> 1"]
    greedy = {"temperature": 0, "seed": 0}
    assert regenerate.changed_replies(greedy, {**greedy, "seed": 1}) == []


@pytest.mark.parametrize("text, said", [('{"target": ', "not valid JSON"), ("[]", "holds a JSON list")])
@pytest.mark.parametrize("flags", [["--check"], [], ["--merge-only"]])
def test_a_damaged_regeneration_json_is_one_line_naming_it(tmp_path, capsys, text, said, flags):
    """A record cut short by a copy, or edited by hand, was a JSONDecodeError (or, for a list, an AttributeError)
    traceback at every --check, run and merge, and so at every training start of its recipe."""
    prompt_file(tmp_path / "prompts.jsonl", 2)
    regenerate.run(args_for(tmp_path))
    shutil.rmtree(tmp_path / "out.parts")
    summary = tmp_path / "out" / "regeneration.json"
    summary.write_text(text)
    capsys.readouterr()
    assert regenerate.main([*args_for_argv(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {summary}: {said}") and f"move {tmp_path / 'out'} away" in err, err
    assert len(err.splitlines()) == 1 and summary.read_text() == text


def test_a_damaged_settings_json_beside_finished_chunks_is_one_line_naming_it_and_overwrite_replaces_them(
        tmp_path, capsys, monkeypatch):
    """Chunks whose settings.json is damaged are of unknown settings: refused in one line that offers --overwrite (it
    told the user to delete the folder, --overwrite or not), and --overwrite makes them again."""
    prompt_file(tmp_path / "prompts.jsonl", 4)
    regenerate.run(args_for(tmp_path, "--num-shards", "2", "--shard-index", "0"))
    parts = tmp_path / "out.parts"
    settings = parts / "settings.json"
    settings.write_text('{"target": "tiny')
    capsys.readouterr()
    assert regenerate.main(args_for_argv(tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {settings}: not valid JSON") and len(err.splitlines()) == 1, err
    assert err.endswith(f"pass --overwrite to make its chunks again (not with --merge-only), delete {parts}, or "
                        "choose another --out"), err
    assert regenerate.main(args_for_argv(tmp_path, "--merge-only", "--overwrite")) == 2  # a merge makes none again
    assert f"{settings}: not valid JSON" in capsys.readouterr().err and (parts / "chunk-00000.jsonl").is_file()
    generated = count_generated(monkeypatch)
    summary = regenerate.run(args_for(tmp_path, "--overwrite"))
    assert summary["num_conversations"] == 4 and len(generated) == 4  # the chunk of unknown settings was not resumed
    assert f"[regenerate] --overwrite: removed 1 chunk of {parts} made with other settings (settings.json could not " \
           "be read)" in capsys.readouterr().out
    assert json.loads(settings.read_text())["target"] == "tiny-random"


@pytest.mark.parametrize("damage", ["cut", "no id", "no messages"])
def test_a_damaged_chunk_is_made_again_with_a_warning_naming_it(tmp_path, capsys, damage):
    """A chunk cut short (a machine that stopped before the disk held it) stopped every resume and --merge-only with a
    JSONDecodeError traceback until it was found and deleted by hand."""
    prompt_file(tmp_path / "prompts.jsonl", 6)  # 3 chunks
    regenerate.run(args_for(tmp_path, "--num-shards", "2", "--shard-index", "0"))  # chunks 0 and 2
    chunk = tmp_path / "out.parts" / "chunk-00000.jsonl"
    whole = chunk.read_text()
    if damage == "cut":
        chunk.write_bytes(whole.encode()[:len(whole.splitlines()[0]) // 2])
    elif damage == "no id":
        chunk.write_text(whole.replace('"id"', '"name"', 1))
    else:  # a row edited by hand: its messages null, not a list (a TypeError where its prompt was compared)
        chunk.write_text(whole.replace('"messages": [', '"messages": null, "was": [', 1))
    capsys.readouterr()
    assert regenerate.main([*args_for_argv(tmp_path), "--merge-only"]) == 2  # chunks 0 and 1 are not finished
    err = capsys.readouterr().err
    assert f"warning: {chunk}: " in err and "2 of 3 chunks are not finished (first: 0)" in err
    assert regenerate.run(args_for(tmp_path))["num_conversations"] == 6
    assert chunk.read_text() == whole  # made again, the same (greedy)


def test_a_chunk_is_on_the_disk_before_its_rename(tmp_path, monkeypatch):
    """Without an fsync a machine that stops after the rename can leave the chunk's name with part of its bytes."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.path.basename(os.readlink(
        f"/proc/self/fd/{fd}")))), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda src, dst: (events.append(("replace", os.path.basename(src))),
                                                         real_replace(src, dst))[1])
    prompt_file(tmp_path / "prompts.jsonl", 3)  # 2 chunks
    regenerate.run(args_for(tmp_path))
    staged = [name for kind, name in events if kind == "replace" and name.startswith(".chunk-")]
    assert len(staged) == 2
    for name in staged:
        assert events.index(("fsync", name)) < events.index(("replace", name))


def test_the_shipped_data_read_by_another_recipe_is_not_offered_to_overwrite(tmp_path, monkeypatch, capsys):
    """`make data RECIPE=tiny` (tiny trains on data/smollm2-135m as it is) was told to pass --overwrite, which would
    put a random target's replies in the place of the 2048 shipped ones and their recovered response_ids."""
    project = Path(regenerate.__file__).resolve().parents[1]
    monkeypatch.chdir(project)
    assert regenerate.main(["--recipe", "recipes/tiny.yaml", "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data/smollm2-135m holds recipe smollm2-135m's data (its data.data_path, made as its "
                          "data.regenerate says), made with other settings (target: 'smollm2-135m' -> 'tiny-random'")
    assert "ARGS=--overwrite" not in err and len(err.splitlines()) == 1
    # From another folder, the folder given by its absolute path: a recipe's relative data_path is the project's.
    monkeypatch.chdir(tmp_path)
    shipped = project / "data" / "smollm2-135m"
    assert regenerate.main(["--recipe", str(project / "recipes" / "tiny.yaml"), "--out", str(shipped), "--prompts",
                            str(project / "data" / "prompts" / "train_prompts.jsonl"), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {shipped} holds recipe smollm2-135m's data") and "--overwrite (" not in err, err


def test_another_recipes_data_is_not_offered_to_overwrite(tmp_path, monkeypatch, capsys):
    prompt_file(tmp_path / "prompts.jsonl", 4)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    data = tmp_path / "data"
    (recipes / "owner.yaml").write_text(
        f"model:\n  target: tiny-random\ndata:\n  data_path: {data}\n  regenerate:\n"
        f"    prompts: {tmp_path / 'prompts.jsonl'}\n    max_new_tokens: 6\n    dtype: float32\n    batch_size: 2\n"
        "    chunk_size: 2\n")
    (recipes / "reader.yaml").write_text(f"model:\n  target: tiny-random\ndata:\n  data_path: {data}\n")
    monkeypatch.setattr(regenerate, "RECIPES_DIR", recipes)
    assert regenerate.run(regenerate.parse_args(["--recipe", "owner"]))["num_conversations"] == 4
    made = load_from_disk(str(data)).to_list()
    shutil.rmtree(tmp_path / "data.parts")  # as shipped
    capsys.readouterr()
    reader = ["--recipe", "reader", "--prompts", str(tmp_path / "prompts.jsonl"), "--dtype", "float32",
              "--chunk-size", "2"]
    for flags, differs in ((["--max-new-tokens", "5"], "made with other settings (max_new_tokens: 6 -> 5)"),
                           (["--max-new-tokens", "6", "--limit", "2"],
                            "answering 4 prompts where this job writes 2 (--limit)")):
        for check in (["--check"], []):
            assert regenerate.main([*reader, *flags, *check]) == 2
            err = capsys.readouterr().err.strip()
            if check and "--limit" in flags:  # --check compares the count: the same refusal, in its own words
                differs_here = "made with other settings (prompts answered: 4 -> 2)"
            else:
                differs_here = differs
            assert err.startswith(f"error: {data} holds recipe owner's data (its data.data_path, made as its "
                                  f"data.regenerate says), {differs_here}: --overwrite would replace it"), err
            assert len(err.splitlines()) == 1
    assert load_from_disk(str(data)).to_list() == made and not (tmp_path / "data.parts").exists()
    # The owner's own job, with other settings, is still offered --overwrite: it is its data to replace.
    assert regenerate.main(["--recipe", "owner", "--max-new-tokens", "5", "--check"]) == 2
    assert "generate it again with --overwrite (`make data RECIPE=owner ARGS=--overwrite`)" in capsys.readouterr().err
    # So is training's check, which gives every setting as a flag and names its recipe with --for-recipe: before,
    # it was told the data was "recipe owner's data", to be left alone, when it was its own.
    owner = ["--target", "tiny-random", "--out", str(data), "--prompts", str(tmp_path / "prompts.jsonl"),
             "--max-new-tokens", "6", "--dtype", "float32", "--for-recipe", "owner", "--check"]
    assert regenerate.main(owner) == 0
    regenerate_advice = ("generate it again with --overwrite (`make data RECIPE=owner ARGS=--overwrite`), or give "
                         "another output folder")
    # Fewer prompts beside another setting: the kept replies are the old setting's, so no --limit change can use them.
    for flags, advice in ((["--max-new-tokens", "5"], regenerate_advice),
                          (["--max-new-tokens", "5", "--limit", "2"], regenerate_advice),
                          (["--limit", "2"], "raise the recipe's data.regenerate.limit "
                                             f"({recipes / 'owner.yaml'}) to 4 to use all 4, or cut the data to 2 "
                                             "with --overwrite (`make data RECIPE=owner ARGS=--overwrite`)")):
        assert regenerate.main([*owner, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {data} holds a dataset made with other settings (") and err.endswith(advice), err
    # A job of flags alone, on data no recipe makes, is told to run itself again.
    shutil.copytree(data, tmp_path / "copy")
    alone = [str(tmp_path / "copy") if flag == str(data) else flag
             for flag in owner if flag not in ("--for-recipe", "owner")]
    assert regenerate.main([*alone, "--limit", "2"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "raise --limit to 4 to use all 4, or cut the data to 2 with --overwrite (this command without --check)")
    assert load_from_disk(str(data)).to_list() == made


def test_a_broken_recipe_beside_the_owner_of_the_data_hides_no_owner(tmp_path, monkeypatch, capsys):
    """Finding which recipe's data --out is reads every recipe: one that does not parse owns nothing (training names
    its fault when it is used), and neither stops the search nor fails this job."""
    prompt_file(tmp_path / "prompts.jsonl", 2)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "a-broken.yaml").write_text("data: [\n")
    (recipes / "owner.yaml").write_text(f"model:\n  target: tiny-random\ndata:\n  data_path: {tmp_path / 'out'}\n"
                                        "  regenerate:\n    max_new_tokens: 6\n")
    monkeypatch.setattr(regenerate, "RECIPES_DIR", recipes)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "regeneration.json").write_text(json.dumps({"target": "smollm2-135m", "num_prompts": 2}))
    assert regenerate.main(args_for_argv(tmp_path, "--check")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path / 'out'} holds recipe owner's data (its data.data_path, made as its "
                          "data.regenerate says), made with other settings (") and len(err.splitlines()) == 1, err


def test_the_readme_names_what_settings_json_records_and_what_moves_a_reply_besides(tmp_path):
    """data/README.md said settings.json "holds what changes an answer" and that a rerun on another CPU "can differ in
    a few answers": the batch size, which it does not hold, changes bf16 greedy replies too, and a rerun of the
    shipped first chunk gave 56 of 64 other replies. The README now lists the recorded settings by name, which this
    holds to response_settings, and names what moves a reply without being recorded."""
    readme = (Path(regenerate.__file__).resolve().parent / "README.md").read_text()
    assert "differ in a few answers" not in readme and "56 of 64" in readme
    paragraph = readme[readme.index("`<out>.parts/settings.json` records"):readme.index("The prompts file is one")]
    listed = set(re.findall(r"`(\w+)`", paragraph[:paragraph.index(");")]))
    assert listed == set(regenerate.response_settings(args_for(tmp_path, "--temperature", "1")))  # sampled: all of them
    assert "batch_size" not in listed and "`--batch-size`" in paragraph and "the machine" in paragraph


def test_another_target_is_one_change_not_also_its_weight_files():
    """Another target's weight files differ as a matter of course: the change is the target, said once, and not also
    'its weight files changed since the data was generated', which would send the user looking for a retrained model."""
    old = {"target": "/models/a", "target_weights": "aaaa"}
    assert regenerate.changed_settings(old, {"target": "/models/b", "target_weights": "bbbb"}) == [
        "target: '/models/a' -> '/models/b'"]


def test_the_target_reads_every_turn_of_a_conversation_and_its_reply_follows_them(tmp_path, monkeypatch):
    """A prompt of several turns is answered as the conversation it is: a target shown its last turn alone writes
    a reply to another conversation, which the drafter then learns as this one's."""
    tokenizer = load_tokenizer("tiny-random")
    turns = [{"role": "system", "content": "You answer in French."},
             {"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "Rouge."},
             {"role": "user", "content": "Another one?"}]
    handed = []

    def scripted(model, prompts, *args, **kwargs):
        handed.extend(prompts)
        return [tokenizer("Bleu.", add_special_tokens=False)["input_ids"] for _ in prompts]

    monkeypatch.setattr(regenerate, "generate_transformers", scripted)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": "p0", "messages": turns}) + "\n")
    regenerate.run(args_for(tmp_path))
    read = tokenizer.decode(handed[0])
    assert all(turn["content"] in read for turn in turns), read
    assert load_from_disk(str(tmp_path / "out"))["messages"][0] == turns + [{"role": "assistant", "content": "Bleu."}]
