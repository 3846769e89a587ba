"""Corpus lookup (ddtree/corpus.py): the index, its graft into the tree within the budget, and losslessness."""

import errno
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset

from ddtree.cli import load_drafter
from ddtree.corpus import (CORPUS_FILE, CorpusLookup, majority_path, read_corpus, read_replies, sorted_unique,
                           write_replies)
from ddtree.decoding import DrafterRunner, OnlineCalibration, draft_tree, generate
from ddtree.errors import DDTreeError
from ddtree.sizing import TreeSizer
from ddtree.tree import build_tree
from rigged import hf_greedy  # tests/rigged.py


def test_the_majority_continuation_of_the_last_tokens_is_looked_up():
    corpus = CorpusLookup([[1, 2, 3, 4, 5], [6, 1, 2, 3, 9, 8], [1, 2, 3, 9, 8, 7]], ngram=3, length=2)
    assert corpus.continuation([0, 1, 2, 3], 7) == [9, 8]  # seen twice, against [4, 5] once
    assert corpus.continuation([0, 1, 2, 3], 1) == [9]
    assert corpus.continuation([2, 3, 9], 7) == [8, 7]  # both took 8; one reply ended there, the other went on to 7
    assert corpus.continuation([5, 5, 5], 7) == [] and corpus.continuation([2, 3], 7) == []


@pytest.mark.parametrize("settings, named", [
    (dict(ngram=0), "ngram=0"), (dict(ngram=-1), "ngram=-1"), (dict(ngram=2.5), "ngram=2.5"),
    (dict(ngram=True), "ngram=True"), (dict(length=0), "length=0"), (dict(length=-2), "length=-2"),
])
def test_an_ngram_or_length_below_one_token_is_one_line_naming_it(settings, named):
    """ngram 0 keyed a run of no tokens that lookups, keyed by the whole context, never matched; length 0 grafted
    nothing: both were built without a word."""
    with pytest.raises(DDTreeError, match=rf"^CorpusLookup {named}: give a whole number of tokens, at least 1"):
        CorpusLookup([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4]], **settings)
    assert CorpusLookup([[1, 2, 3, 4, 5, 6, 1, 2, 3, 4]], ngram=1, length=1).continuation([9, 3], 7) == [4]


def test_one_reply_given_where_replies_are_meant_is_one_line(tiny_target):
    """One reply given bare, its ids or its text, was indexed as replies of one token (or character) each: no run to
    look up, and nothing said."""
    with pytest.raises(DDTreeError, match=r"^CorpusLookup takes replies, each a list of token ids, and was given token "
                                          r"ids: give one reply as \[ids\]$"):
        CorpusLookup([5, 6, 7, 8, 9])
    with pytest.raises(DDTreeError, match=r"^CorpusLookup.from_text takes replies, a list of texts, and was given one "
                                          r"text: give one reply as \[text\]$"):
        CorpusLookup.from_text("the cat sat on the mat", tiny_target[1])
    assert len(CorpusLookup([[5, 6, 7, 8, 9]])) == 2 and len(CorpusLookup(torch.tensor([[5, 6, 7, 8, 9]]))) == 2


def test_an_ngram_too_long_to_pack_names_the_longest_that_fits():
    """600 distinct ids pack runs of 6 tokens into an int64 key, not of 7: the refusal blamed the ids, "more than a
    target's vocabulary ... not token ids of a target's replies", for the keyword's length."""
    replies = [list(range(600)) * 2]
    with pytest.raises(DDTreeError, match=r"^CorpusLookup ngram=7: runs of 7 tokens over the 600 distinct token ids "
                                          r"the corpus holds do not pack .*; give ngram at most 6 \(default 3\)$"):
        CorpusLookup(replies, ngram=7)
    assert CorpusLookup(replies, ngram=6).continuation(list(range(6)), 2) == [6, 7]


@pytest.mark.parametrize("values", [[], [7], [5, 5, 5], [3, -1, 3, 0, -1, 2 ** 40, 0], list(range(50, 0, -3)) * 3])
def test_the_corpus_ids_are_the_distinct_tokens_ascending_as_np_unique_gives_them(values):
    """CorpusLookup's ids (the ranks its run keys pack) come from a sort, not np.unique's hash table: the same ids."""
    values = np.asarray(values, dtype=np.int64)
    assert sorted_unique(values).tolist() == np.unique(values).tolist()


def test_each_depth_takes_the_majority_of_the_continuations_that_agree_so_far():
    # after [1, 2]: 5 twice, then 6 once and 7 once behind it; [4, 9, 9] twice: the path is 5, then the first seen
    corpus = CorpusLookup([[1, 2, 4, 9, 9], [1, 2, 5, 6], [1, 2, 4, 9, 9], [1, 2, 5, 7], [1, 2, 5, 7, 3]],
                          ngram=2, length=3)
    assert corpus.continuation([1, 2], 3) == [5, 7, 3]  # 5 (3 of 5), then 7 (2 of the 3), then 3
    assert majority_path([[4, 9], [5, 6], [4, 8]]) == [4, 9]  # 4 (2 of 3), then a tie between 9 and 8: 9 came first


def test_a_tie_goes_to_the_reply_seen_first_however_the_runs_interleave():
    """The index sorts every position by its run: the sort must keep each run's occurrences in their order (an
    unstable one reorders them among the other runs' positions, and a tie would go to whichever it put first)."""
    replies = [[run % 3, run % 3 + 1, 100 + reply] for reply in range(60) for run in range(3)]
    corpus = CorpusLookup(replies, ngram=2, length=1)
    assert [corpus.continuation([run, run + 1], 1) for run in range(3)] == [[100], [100], [100]]
    assert corpus.continuation([3, 4], 1) == [] and corpus.continuation([-1, 10**6], 1) == []  # ids no reply holds
    # one that sorts between ids the replies hold takes the rank of the next one up, 30: it must not borrow 30's run
    between = CorpusLookup([[10, 20, 30, 40, 50]], ngram=3, length=2)
    assert between.continuation([10, 20, 30], 2) == [40, 50] and between.continuation([10, 20, 25], 2) == []
    # one above every id the replies hold (a rare token the target emits) ranks past the end: [], not an IndexError
    assert between.continuation([10, 20, 60], 2) == [] and between.continuation([60, 10, 20], 2) == []
    assert len(corpus) == 3 and corpus.table == {(0, 1): [100], (1, 2): [100], (2, 3): [100]}


def test_the_quoted_path_takes_its_share_of_the_budget_and_leaves_the_drafter_a_node():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    tree = draft_tree(logits, 6, lookup=[1, 2], quoted=[3, 4, 5, 6, 7])
    assert len(tree.tokens) <= 6
    row = 0
    for token in (3, 4, 5):  # quoted [3, 4, 5]: 6 nodes - 2 for the lookup - 1 left to the drafter
        row = tree.children[row][token]
    assert tree.children[row] == {}
    assert len(draft_tree(logits, 2, lookup=[1, 2], quoted=[3]).tokens) <= 2  # no room left: nothing quoted


def test_the_sizer_counts_the_quoted_paths_rows_in_every_trees_cost():
    """The quoted path is verified whatever size the drafter's part takes: the sizer prices each size with its rows
    (a corpus is the shipped drafters' default: left out, every --adaptive-size round is sized as if they were free)."""
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0)) * 3
    sizer = TreeSizer(fixed_ms=10.0, row_ms=2.0)
    tree = draft_tree(logits, 16, sizer=sizer, quoted=[1, 2, 3, 4, 5, 6])
    drafted = build_tree(logits, 16 - 6)  # the drafter's share of the budget
    kept = sizer.size(drafted.log_probs, extra_rows=6)
    assert kept == 4 and sizer.size(drafted.log_probs) == 2  # the 6 quoted rows make larger trees pay
    assert len(tree.quoted) == 6 and tree.tokens[:-6] == drafted.tokens[:kept]


def test_conversations_give_their_assistant_turns(tmp_path, tiny_target):
    """The JSONL that `datasets`' to_json writes from a data/regenerate.py folder: the replies, not the prompts."""
    _, tokenizer = tiny_target
    reply, question = "the cat sat on the mat and the cat sat down", "where did the dog sit"
    Dataset.from_dict({"messages": [[{"role": "user", "content": question},
                                     {"role": "assistant", "content": reply}]]}).to_json(tmp_path / "replies.jsonl")
    corpus = CorpusLookup.from_conversations(tmp_path / "replies.jsonl", tokenizer)
    ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    assert corpus.table == CorpusLookup([ids]).table and len(corpus) > 0
    with pytest.raises(DDTreeError, match=r"--corpus .*missing.jsonl: no such file"):
        CorpusLookup.from_conversations(tmp_path / "missing.jsonl", tokenizer)
    # a drafter or `datasets` folder given as --corpus: an IsADirectoryError traceback without the check
    with pytest.raises(DDTreeError, match=r"a folder, not a file; give a JSONL file of conversations"):
        CorpusLookup.from_conversations(tmp_path, tokenizer)
    # a system prompt is not the target's phrasing, and a tool turn's content is whatever the tool returned (a dict)
    turns = [{"role": "system", "content": "You are a pirate. Always answer in pirate speak."},
             {"role": "user", "content": question}, {"role": "assistant", "content": reply},
             {"role": "tool", "content": {"weather": "sunny"}}]
    (tmp_path / "roles.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
    assert CorpusLookup.from_conversations(tmp_path / "roles.jsonl", tokenizer).table == CorpusLookup([ids]).table
    (tmp_path / "text.jsonl").write_text(json.dumps({"messages": []}) + "\n" + json.dumps({"text": reply}) + "\n")
    with pytest.raises(DDTreeError, match="text.jsonl:2: not a conversation"):
        CorpusLookup.from_conversations(tmp_path / "text.jsonl", tokenizer)
    # Tool-call turns (content null), lists of parts and another encoding were tracebacks once the target had loaded.
    for name, content in (("tool.jsonl", None), ("parts.jsonl", [{"type": "text", "text": reply}])):
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": content}]
        (tmp_path / name).write_text(json.dumps({"messages": turns}) + "\n")
        with pytest.raises(DDTreeError, match=f"{name}:1: an assistant turn's content is not a string"):
            CorpusLookup.from_conversations(tmp_path / name, tokenizer)
    (tmp_path / "latin1.jsonl").write_bytes(json.dumps({"messages": [{"role": "assistant", "content": "caf\u00e9"}]},
                                                       ensure_ascii=False).encode("latin-1") + b"\n")
    with pytest.raises(DDTreeError, match="latin1.jsonl:1: not UTF-8"):
        CorpusLookup.from_conversations(tmp_path / "latin1.jsonl", tokenizer)
    (tmp_path / "cut.jsonl").write_text('{"messages": [{"role": "assistant", "content": "a\\udc80b"}]}\n')
    with pytest.raises(DDTreeError, match="cut.jsonl:1: an assistant turn: not valid UTF-8 text"):  # a TypeError once
        CorpusLookup.from_conversations(tmp_path / "cut.jsonl", tokenizer)
    (tmp_path / "questions.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": question}]}))
    # a prompts file given as the corpus: said, and what to give instead (the line stopped at the problem)
    with pytest.raises(DDTreeError, match=r"questions.jsonl: no assistant turn in it, so there is nothing to look up; "
                                          r"give conversations holding the target's replies \(docs/decoding.md"):
        CorpusLookup.from_conversations(tmp_path / "questions.jsonl", tokenizer)


def test_a_corpus_of_the_reply_is_accepted_and_a_wrong_one_changes_no_token(tiny_target):
    model, tokenizer = tiny_target
    prompt = [5, 6, 7, 8, 9, 10, 11]
    greedy = hf_greedy(model, prompt, 40)
    runner = DrafterRunner(load_drafter("random", model, tokenizer, "tiny-random"), model)
    accepted = {}
    for name, corpus in [("none", None), ("the reply", CorpusLookup([prompt + greedy])),
                         ("wrong", CorpusLookup([prompt + [t + 1 for t in greedy]]))]:
        result = generate(model, prompt, "ddtree", runner, 16, 40, (), lookup=0, corpus=corpus)
        assert result.new_tokens == greedy, name
        assert all(r.tree_size <= 16 for r in result.rounds)
        accepted[name] = sum(r.accepted_depth for r in result.rounds)
    assert accepted["the reply"] > accepted["none"] + 10, accepted
    with pytest.raises(DDTreeError, match="method 'dflash' has none"):
        generate(model, prompt, "dflash", runner, 16, 4, (), corpus=CorpusLookup([greedy]))
    # Another tokenizer's replies: an IndexError traceback mid-decode, now one line before it starts; `vocab` itself,
    # one past the last id, is the boundary a `>` in the check would let through
    vocab = model.get_output_embeddings().weight.shape[0]
    for foreign in ([5, 6, 7, vocab], [5, 6, 7, vocab + 8], [5, 6, 7, -3], [5, 6, 7, 2 ** 40]):  # last: a corrupt file's
        refused = f"the corpus holds token id {foreign[-1]}, outside the target's vocabulary"
        with pytest.raises(DDTreeError, match=refused) as error:
            generate(model, prompt, "ddtree", runner, 16, 4, (), corpus=CorpusLookup([prompt + foreign]))
        assert "\n" not in str(error.value)


def test_a_corpus_file_reads_back_its_replies_and_a_broken_one_is_one_line(tmp_path, tiny_target):
    replies = [[5, 6, 7, 8], [], [49151, 0]]
    assert write_replies(tmp_path / CORPUS_FILE, replies, tiny_target[1]) == 3
    assert read_replies(tmp_path / CORPUS_FILE) == replies
    assert CorpusLookup.from_file(tmp_path / CORPUS_FILE).table == CorpusLookup(replies).table
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / CORPUS_FILE).read_bytes()[:-3])
    with pytest.raises(DDTreeError, match=r"corpus .*cut.safetensors is unreadable or not a corpus .*--corpus none"):
        read_replies(tmp_path / "cut.safetensors")
    # whole files of the wrong tensors: float ids were a TypeError traceback, offsets past the tokens cut replies short
    from safetensors.torch import save_file

    for name, tensors, problem in (
        ("float", {"tokens": torch.ones(10), "offsets": torch.tensor([0.0, 10.0])}, "tokens is 1-D torch.float32"),
        # bool ids would read as replies of 0s and 1s
        ("bool", {"tokens": torch.tensor([True, False]), "offsets": torch.tensor([0, 2])}, "tokens is 1-D torch.bool"),
        ("2d", {"tokens": torch.ones(2, 5, dtype=torch.int32), "offsets": torch.tensor([0, 10])}, "tokens is 2-D"),
        ("past", {"tokens": torch.ones(4, dtype=torch.int32), "offsets": torch.tensor([0, 9])}, "offsets do not run"),
        ("back", {"tokens": torch.ones(4, dtype=torch.int32), "offsets": torch.tensor([0, 3, 1, 4])}, "offsets do not run"),
        # offsets from 2: the first two tokens would be dropped without a word
        ("late", {"tokens": torch.ones(6, dtype=torch.int32), "offsets": torch.tensor([2, 6])}, "offsets do not run"),
    ):
        save_file(tensors, tmp_path / f"{name}.safetensors")
        with pytest.raises(DDTreeError, match=rf"corpus .*{name}.safetensors is unreadable or not a corpus \({problem}"):
            read_replies(tmp_path / f"{name}.safetensors")


def test_a_corpus_file_of_token_ids_is_read_as_one_whatever_its_name(tmp_path, tiny_target):
    """--corpus took a file for token ids by its exact suffix: a corpus.safetensors copied as replies.bin or
    CORPUS.SAFETENSORS was read as JSONL and refused as "not UTF-8 ... save it as UTF-8 JSONL"."""
    replies = [[5, 6, 7, 8, 9], [5, 6, 7, 10]]
    for name in ("replies.bin", "CORPUS.SAFETENSORS"):
        write_replies(tmp_path / name, replies, tiny_target[1])
        read = read_corpus(tmp_path / name)
        assert isinstance(read, CorpusLookup) and read.table == CorpusLookup(replies).table, name
    # JSONL stays JSONL, whatever it is named
    turns = [{"role": "assistant", "content": "a b c d"}]
    (tmp_path / "replies.txt").write_text(json.dumps({"messages": turns}) + "\n")
    assert read_corpus(tmp_path / "replies.txt") == ["a b c d"]


def test_a_broken_corpus_file_given_is_named_as_given_with_a_way_out_that_fits(tmp_path, tiny_target):
    """`--corpus cut.safetensors` was refused as "corpus cut.safetensors is unreadable ...; export the drafter again":
    advice for a drafter folder's own file, which leaves a file the user named as it is."""
    write_replies(tmp_path / CORPUS_FILE, [[5, 6, 7, 8]], tiny_target[1])
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((tmp_path / CORPUS_FILE).read_bytes()[:-3])
    for flag in ("--corpus ", "corpus="):
        with pytest.raises(DDTreeError) as raised:
            read_corpus(cut, flag)
        assert str(raised.value).startswith(f"{flag}{cut} is unreadable or not a corpus ("), str(raised.value)
        assert str(raised.value).endswith("; give a corpus.safetensors a run with model.corpus wrote (its drafter "
                                          "folder ships one), or a JSONL file of conversations"), str(raised.value)
    with pytest.raises(DDTreeError, match=r"^corpus .*cut.safetensors is unreadable or not a corpus .*; export the "
                                          r"drafter again, or decode without it \(ddtree: --corpus none\)$"):
        CorpusLookup.from_file(cut)  # a drafter folder's own file (ddtree.decoder.folder_corpus)


def test_a_corpus_this_user_cannot_read_is_one_line(tmp_path, monkeypatch):
    """An unreadable --corpus (another user's file, mode 600) was a PermissionError traceback; --prompts, read by the
    same iter_json_lines, too. Tests may run as root, which reads any file: the OS's refusal is stood in for."""
    path = tmp_path / "theirs.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "a b c d e"}]}) + "\n")
    opened = Path.open

    def refused(self, *args, **kwargs):
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return opened(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refused)
    line = rf"^{re.escape(str(path))}: cannot be read \(Permission denied\); give a file this user can read$"
    with pytest.raises(DDTreeError, match=line):
        read_corpus(path)


class Vocabulary:
    """A stand-in tokenizer of `size` tokens, token i spelt f"{spelling}{i}": what the corpus record reads of one."""

    def __init__(self, name: str, size: int, spelling: str):
        self.name_or_path, self.vocab_size, self.spelling = name, size, spelling

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        assert all(0 <= i < self.vocab_size for i in ids)
        return [f"{self.spelling}{i}" for i in ids]


def test_a_corpus_file_records_its_tokenizer_and_another_tokenizers_target_refuses_it(tmp_path, tiny_target):
    """docs/decoding.md said a corpus of another tokenizer's ids is one line, but only ids past the target's vocabulary
    were: a smaller tokenizer's (a SmolLM2 drafter's corpus given to a Qwen target, bytes) were grafted as the target's
    tokens, never accepted, without a word (found in a review). The file now says which tokenizer wrote its ids."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, tokenizer = tiny_target
    replies = [[5, 6, 7, 8, 9], [1, 2, 3, 4]]
    write_replies(tmp_path / CORPUS_FILE, replies, tokenizer)
    with safe_open(str(tmp_path / CORPUS_FILE), framework="pt") as saved:
        assert saved.metadata()["tokenizer_vocab_size"] == str(tokenizer.vocab_size) == "49152"
    corpus = CorpusLookup.from_file(tmp_path / CORPUS_FILE)
    corpus.check_tokenizer(tokenizer)  # its own: nothing said
    for other, named in ((Vocabulary("bytes", 256, "b"), "bytes (256 tokens)"),  # fewer ids than the writer's
                         (Vocabulary("qwen", 151643, "q"), "qwen (151643 tokens)")):  # more, other tokens
        with pytest.raises(DDTreeError, match=rf"^the corpus {tmp_path / CORPUS_FILE} was written with tokenizer "
                                              rf".* \(49152 tokens\), whose ids the target's tokenizer {re.escape(named)} gives "
                                              r"other tokens: give a corpus of this target's replies, or decode "
                                              r"without it \(ddtree: --corpus none\)$"):
            corpus.check_tokenizer(other)
    # The same tokens with more added after them (a chat variant's): its ids still mean what they meant
    written = Vocabulary("base", 1000, "t")
    write_replies(tmp_path / "base.safetensors", replies, written)
    CorpusLookup.from_file(tmp_path / "base.safetensors").check_tokenizer(Vocabulary("chat", 1024, "t"))
    # A file that records none (written before, or by another writer): its ids alone are checked, as before
    save_file({"tokens": torch.tensor([5, 6, 7, 8, 9]), "offsets": torch.tensor([0, 5])}, tmp_path / "plain.safetensors")
    plain = CorpusLookup.from_file(tmp_path / "plain.safetensors")
    assert plain.written_with is None and len(plain) == 2
    plain.check_tokenizer(Vocabulary("bytes", 256, "b"))
    # a record that is not write_replies': the file is not one it wrote (half a record: a KeyError traceback once
    # check_tokenizer read the hash it lacks)
    for name, record in (("odd", {"tokenizer": "x", "tokenizer_vocab_size": "many", "tokenizer_tokens_sha256": "0"}),
                         ("half", {"tokenizer": "x", "tokenizer_vocab_size": "49152"})):
        save_file({"tokens": torch.tensor([5, 6, 7, 8]), "offsets": torch.tensor([0, 4])},
                  tmp_path / f"{name}.safetensors", metadata=record)
        with pytest.raises(DDTreeError, match=rf"{name}.safetensors is unreadable or not a corpus \(its metadata's "
                                              r"record of the tokenizer is not write_replies'"):
            read_replies(tmp_path / f"{name}.safetensors")


class SharedBytes(Vocabulary):
    """A byte-level BPE vocabulary: its first 256 tokens the bytes, spelt alike in every such tokenizer, then its own
    merges."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"byte{i}" if i < 256 else token for i, token in zip(ids, super().convert_ids_to_tokens(ids))]


def test_a_corpus_of_a_tokenizer_of_the_same_size_and_bytes_is_refused_by_its_other_merges(tmp_path):
    """Two byte-level BPE tokenizers may hold as many tokens (SmolLM2's and StarCoder2's: 49,152) and spell their first
    ids alike: the size alone, or the first ids alone, would take one's corpus for the other's, and graft tokens the
    target never accepts without a word. The record's hash samples ids across the whole vocabulary."""
    write_replies(tmp_path / CORPUS_FILE, [[300, 301, 302, 303]], SharedBytes("smollm2", 49152, "s"))
    corpus = CorpusLookup.from_file(tmp_path / CORPUS_FILE)
    corpus.check_tokenizer(SharedBytes("smollm2-instruct", 49152, "s"))  # the same tokens: nothing said
    with pytest.raises(DDTreeError, match=r"was written with tokenizer smollm2 \(49152 tokens\), whose ids the "
                                          r"target's tokenizer starcoder2 \(49152 tokens\) gives other tokens"):
        corpus.check_tokenizer(SharedBytes("starcoder2", 49152, "c"))


def test_a_corpus_file_of_unsigned_integers_reads_as_its_replies(tmp_path):
    """Unsigned arrays are what numpy writers often choose: torch orders no uint16/32/64, so such offsets were a
    NotImplementedError traceback (before the target loaded, under --corpus; on loading a drafter that shipped one)."""
    from safetensors.numpy import save_file

    replies = [[1, 2, 3], [], [4, 5, 6, 7, 8]]
    tokens, offsets = np.array([1, 2, 3, 4, 5, 6, 7, 8]), np.array([0, 3, 3, 8])
    for tokens_dtype, offsets_dtype in ((np.int32, np.uint32), (np.uint16, np.uint16), (np.uint64, np.uint64),
                                        (np.uint32, np.int64)):
        path = tmp_path / f"{np.dtype(tokens_dtype).name}-{np.dtype(offsets_dtype).name}.safetensors"
        save_file({"tokens": tokens.astype(tokens_dtype), "offsets": offsets.astype(offsets_dtype)}, path)
        assert read_replies(path) == replies, path.name
        assert CorpusLookup.from_file(path).table == CorpusLookup(replies).table
    save_file({"tokens": tokens.astype(np.uint32), "offsets": np.array([0, 5, 3, 8], dtype=np.uint32)},
              tmp_path / "back.safetensors")  # the order checked, not only the ends
    with pytest.raises(DDTreeError, match=r"back.safetensors is unreadable or not a corpus \(offsets do not run"):
        read_replies(tmp_path / "back.safetensors")
    for name, huge in (("tokens", {"tokens": np.array([2**63, 1], dtype=np.uint64), "offsets": np.array([0, 2])}),
                       ("offsets", {"tokens": tokens, "offsets": np.array([0, 2**64 - 1, 8], dtype=np.uint64)})):
        save_file(huge, tmp_path / f"huge-{name}.safetensors")
        with pytest.raises(DDTreeError, match=rf"huge-{name}.safetensors is unreadable or not a corpus \({name} hold a "
                                              "uint64 value of 2\\^63 or more"):
            read_replies(tmp_path / f"huge-{name}.safetensors")


def test_the_drafters_corpus_is_the_default_and_false_leaves_it_out(tiny_target):
    model, tokenizer = tiny_target
    prompt = [5, 6, 7, 8, 9, 10, 11]
    greedy = hf_greedy(model, prompt, 40)
    drafter = load_drafter("random", model, tokenizer, "tiny-random")
    shipped = DrafterRunner(drafter, model, corpus=CorpusLookup([prompt + greedy]))
    accepted = {}
    for name, runner, corpus, online in [("default", shipped, None, None), ("true", shipped, True, None),
                                         ("off", shipped, False, None),
                                         ("online", shipped, None, OnlineCalibration()),
                                         ("plain runner", DrafterRunner(drafter, model), None, None)]:
        result = generate(model, prompt, "ddtree", runner, 16, 40, (), lookup=0, corpus=corpus, online=online)
        assert result.new_tokens == greedy, name
        accepted[name] = sum(r.accepted_depth for r in result.rounds)
    assert accepted["default"] > accepted["off"] + 10 and accepted["off"] == accepted["plain runner"], accepted
    assert accepted["true"] == accepted["default"], accepted  # True: a corpus, the drafter's own
    assert accepted["online"] > accepted["off"] + 10, accepted  # the calibration keeps it (and learns its acceptance)
    assert generate(model, prompt, "dflash", shipped, 16, 40, ()).new_tokens == greedy  # the chain has none


def test_online_calibration_learns_each_lookups_acceptance_by_depth(tiny_target):
    """A corpus holding the reply is right at every depth, a wrong one at none: the calibration scores their next
    grafted nodes by what it saw, each lookup on its own (the drafter's probabilities would say neither)."""
    model, tokenizer = tiny_target
    prompt = [5, 6, 7, 8, 9, 10, 11]
    greedy = hf_greedy(model, prompt, 40)
    runner = DrafterRunner(load_drafter("random", model, tokenizer, "tiny-random"), model)
    learned = {}
    right, wrong = CorpusLookup([prompt + greedy]), CorpusLookup([prompt + greedy])
    # every run of the reply found, with a wrong continuation
    wrong.continuation = lambda context, length: [token + 1 for token in right.continuation(context, length)]
    for name, corpus in [("right", right), ("wrong", wrong)]:
        online = OnlineCalibration()
        result = generate(model, prompt, "ddtree", runner, 16, 40, (), online=online, lookup=0, corpus=corpus)
        assert result.new_tokens == greedy, name
        learned[name] = [math.exp(online.graft_log_prob("corpus", depth)) for depth in (1, 3)]
        assert online.graft_rounds.get(("context", 1), 0) == 0  # lookup 0: the context lookup grafted nothing
    assert min(learned["right"]) > 0.75 and max(learned["wrong"]) < 0.25, learned


def test_a_corpus_of_conversations_is_named_by_its_file_in_its_errors(tmp_path, tiny_target):
    """The Python way to a corpus (CorpusLookup.from_conversations): a refusal names the file it was read from, not an
    anonymous "the corpus"."""
    _, tokenizer = tiny_target
    Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "ok"}]]}).to_json(tmp_path / "short.jsonl")
    corpus = CorpusLookup.from_conversations(tmp_path / "short.jsonl", tokenizer)
    with pytest.raises(DDTreeError, match=rf"^the corpus {re.escape(str(tmp_path / 'short.jsonl'))}: no reply in it"):
        corpus.check_runs()


def test_runs_whose_ranks_would_collide_under_a_smaller_base_keep_their_own_continuations():
    """Keys pack ranks in base len(ids): ids 0, 1, 2, 5, 6 rank 0..4, so runs (0, 6) and (1, 0) pack to 0*5+4 = 4 and
    1*5+0 = 5; packed in base 4 both were 4, one run, and (1, 0) would take (0, 6)'s continuation."""
    corpus = CorpusLookup([[0, 6, 5], [1, 0, 2]], ngram=2, length=1)
    assert len(corpus) == 2 and corpus.table == {(0, 6): [5], (1, 0): [2]}
    assert corpus.continuation([1, 0], 1) == [2]


def test_an_ngram_whose_keys_reach_two_to_the_63_blames_the_ngram_at_the_boundary():
    """2 distinct ids in runs of 63 make 2^63 keys, one past what the check allows (`>= 2 ** 63`): the refusal is the
    ngram's, naming 62 (2^62 keys), not the ids' "too many ... not token ids" (which 2 ids never are)."""
    with pytest.raises(DDTreeError, match=r"^CorpusLookup ngram=63: runs of 63 tokens over the 2 distinct token ids "
                                          r"the corpus holds do not pack .*; give ngram at most 62 \(default 3\)$"):
        CorpusLookup([[0, 1] * 40], ngram=63)
    assert CorpusLookup([[0, 1] * 40], ngram=62).continuation([0, 1] * 31, 2) == [0, 1]


def test_two_to_the_21_distinct_ids_are_refused_in_runs_of_three():
    """Runs of 3 over 2^21 ids make 2^63 keys: refused, as the check's comment says (2^21 - 1 ids pass it)."""
    with pytest.raises(DDTreeError, match=r"^the corpus holds 2097152 distinct token ids \(0 to 2097151\), too many"):
        CorpusLookup([np.arange(2 ** 21)])


class SharedHead(Vocabulary):
    """A vocabulary whose first 2048 tokens are spelt as every such tokenizer's, then its own."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"shared{i}" if i < 2048 else token for i, token in zip(ids, super().convert_ids_to_tokens(ids))]


def test_the_tokenizer_record_samples_ids_across_the_whole_vocabulary_not_its_first_ones(tmp_path):
    """vocabulary_hash takes 1024 ids spread evenly below the size (every 48th of 49,152): two tokenizers that spell
    their first 2048 ids alike differ at the 980 sampled above them, where a hash of ids 0..1023 saw the same."""
    write_replies(tmp_path / CORPUS_FILE, [[300, 301, 302, 303]], SharedHead("one", 49152, "a"))
    corpus = CorpusLookup.from_file(tmp_path / CORPUS_FILE)
    corpus.check_tokenizer(SharedHead("one-chat", 49152, "a"))
    with pytest.raises(DDTreeError, match=r"was written with tokenizer one \(49152 tokens\), whose ids the target's "
                                          r"tokenizer other \(49152 tokens\) gives other tokens"):
        corpus.check_tokenizer(SharedHead("other", 49152, "b"))


def test_a_corpus_file_given_as_a_flag_is_named_as_given_when_it_holds_no_run(tmp_path, tiny_target):
    """read_corpus hands from_file the flag and path as given: its refusals name them, not "the corpus <path>"."""
    path = tmp_path / "short.safetensors"
    write_replies(path, [[5, 6, 7], []], tiny_target[1])
    with pytest.raises(DDTreeError, match=rf"^--corpus {re.escape(str(path))}: no reply in it holds more than 3 "
                                          "tokens"):
        read_corpus(path)
