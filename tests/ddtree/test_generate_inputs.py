"""What `ddtree.decoding.generate` takes and refuses, on the tiny random target (fp32): drafters whose logits are
not finite, a batch of prompts, stop ids as a tensor, a drafter config's temperatures (found in a review,
2026-11-29), a listener to the committed tokens, a padded tokenizer encoding, and counts (lookup, redraft, top_k)
that are not whole numbers (found in a review, 2026-12-05).

    .venv/bin/pytest -q tests/ddtree/test_generate_inputs.py
"""

import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ddtree.decoding
from ddtree.decoding import DrafterRunner, generate
from ddtree.errors import DDTreeError
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.sizing import TreeSizer
from ddtree.targets import build_drafter_config
from rigged import RiggedDrafter

PROMPT = [5, 6, 7, 8]
NEW = 12


def greedy(target, prompt, new=NEW, stop=None):
    return target.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                           eos_token_id=stop)[0, len(prompt):].tolist()


class BrokenDrafter:
    """Drafts NaN at depth 1 (a diverged drafter, a 0 temperature) every `period`-th round, a confident token 7
    otherwise."""

    block_size = 4

    def __init__(self, vocab: int, period: int = 2):
        self.vocab, self.period, self.calls = vocab, period, 0

    def reset(self):
        pass

    def features(self, hidden_states):
        return hidden_states[-1]

    def propose(self, root_token, start, new_context, depth):
        self.calls += 1
        logits = torch.zeros(depth, self.vocab)
        logits[:, 7] = 3.0
        if self.calls % self.period == 0:
            logits[0] = float("nan")
        return logits


@pytest.mark.parametrize("sizer", [None, TreeSizer(fixed_ms=5.0, row_ms=1.0)], ids=["budget", "sizer"])
def test_a_drafter_whose_logits_are_not_finite_still_commits_greedy_decoding(tiny_target, sizer):
    """Its broken rounds verify no draft node and commit the target's own token (the sizer raised IndexError)."""
    target, _ = tiny_target
    drafter = BrokenDrafter(target.config.vocab_size)
    result = generate(target, PROMPT, "ddtree", drafter, budget=8, max_new_tokens=NEW, sizer=sizer)
    assert result.new_tokens == greedy(target, PROMPT)
    assert sum(r.tree_size == 0 for r in result.rounds) >= drafter.calls // 2 >= 2  # every broken round: no node


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_a_batch_of_prompts_is_refused_not_joined_into_one(tiny_target, method):
    target, _ = tiny_target
    drafter = BrokenDrafter(target.config.vocab_size, period=10**9)
    with pytest.raises(DDTreeError, match=r"one prompt at a time: prompt_ids has shape \(2, 4\)"):
        generate(target, torch.tensor([PROMPT, [9, 10, 11, 12]]), method, drafter, max_new_tokens=NEW)
    alone = generate(target, torch.tensor([PROMPT]), method, drafter, max_new_tokens=NEW)  # a batch of one is one prompt
    assert alone.new_tokens == greedy(target, PROMPT)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
@pytest.mark.parametrize("outside", [lambda rows: -1, lambda rows: rows, lambda rows: 10**6],
                         ids=["-1", "rows", "10**6"])  # rows: the first id past the last row, a tokenizer's added one
def test_a_prompt_id_outside_the_targets_embedding_is_one_line(tiny_target, method, outside):
    """An IndexError from inside the embedding before."""
    target, _ = tiny_target
    rows = target.get_input_embeddings().weight.shape[0]
    token = outside(rows)
    drafter = BrokenDrafter(target.config.vocab_size, period=10**9)
    with pytest.raises(DDTreeError, match=f"prompt token id {token} is outside the target's {rows} embedding rows"):
        generate(target, [5, token, 7], method, drafter, max_new_tokens=NEW)


@pytest.mark.parametrize("as_given", [list, torch.tensor, lambda ids: ids[0]], ids=["list", "tensor", "int"])
def test_stop_ids_stop_whether_a_list_a_tensor_or_one_id(tiny_target, as_given):
    target, _ = tiny_target
    stop = greedy(target, PROMPT)[3]  # the 4th greedy token
    reference = greedy(target, PROMPT, stop=stop)
    assert reference[-1] == stop and len(reference) <= 4
    result = generate(target, PROMPT, "ar", max_new_tokens=NEW, stop_ids=as_given([stop]))
    assert result.new_tokens == reference and result.stopped


@pytest.mark.parametrize("as_given", [torch.tensor, np.array], ids=["tensor", "numpy"])
def test_every_id_of_a_stop_ids_array_stops(as_given):
    """A tokenizer's eos ids often come as an array of several (a chat model's end-of-turn and end-of-text):
    each must stop the reply, not only the first."""
    assert ddtree.decoding.stop_id_set(as_given([[3, 7], [9, 11]])) == {3, 7, 9, 11}


def test_stop_ids_none_is_no_stop_ids(tiny_target):
    """A TypeError before."""
    target, _ = tiny_target
    result = generate(target, PROMPT, "ar", max_new_tokens=NEW, stop_ids=None)
    assert result.new_tokens == greedy(target, PROMPT) and not result.stopped


def drafter_with_temperatures(target, tokenizer, temperatures):
    """A one-layer drafter for tiny-random whose config holds `temperatures` as its draft_temperatures."""
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=1, block_size=4,
                                  target_layer_ids=[0, target.config.num_hidden_layers - 1])
    config.draft_temperatures = temperatures
    return DFlashDraftModel(config)


@pytest.mark.parametrize("temperatures", [[0.0, 1.0, 1.0], [1.0, float("nan"), 1.0], [-1.0, 1.0, 1.0], [1.0, 1.0],
                                          [1e-39, 1.0, 1.0], [1.0, 1.0, float("inf")]])
def test_draft_temperatures_that_cannot_divide_the_logits_are_one_line(tiny_target, temperatures):
    target, _ = tiny_target
    drafter = drafter_with_temperatures(*tiny_target, temperatures)
    # 1e-39 passed as positive, and its division overflowed fp32 logits to inf: every tree came out empty.
    with pytest.raises(DDTreeError, match=r"draft_temperatures .*: give one positive number per drafted position \(3\), "
                                          r"each within 0.01..100"):
        DrafterRunner(drafter, target)
    DrafterRunner(drafter, target, calibrated=False)  # the raw logits, to fit new ones from: the field is not read


def test_an_uncalibrated_runner_drafts_the_raw_logits_though_its_config_holds_draft_temperatures(tiny_target):
    """calibrated=False is what temperatures are fitted from (training's evaluation): had it divided by the config's
    draft_temperatures, a new fit would have learned on top of the old one. Its drafts, and so the acceptance the
    drafter predicts each round, are those of the same weights with no temperatures at all."""
    target, _ = tiny_target
    drafter = drafter_with_temperatures(*tiny_target, [4.0, 4.0, 4.0])
    calibrated, raw = DrafterRunner(drafter, target), DrafterRunner(drafter, target, calibrated=False)
    drafter.config.draft_temperatures = None
    plain = DrafterRunner(drafter, target)

    def expected(runner):
        return [r.expected for r in generate(target, PROMPT, "ddtree", runner, budget=6, max_new_tokens=NEW).rounds]

    assert expected(raw) == expected(plain) != expected(calibrated)


def test_a_budget_past_the_targets_context_is_one_error_not_an_out_of_memory(tiny_target):
    """`--budget 100000000` built a heap and a mask that size before the machine ran out of memory."""
    target, _ = tiny_target
    limit = target.config.max_position_embeddings
    drafter = BrokenDrafter(target.config.vocab_size, period=10**9)
    with pytest.raises(DDTreeError, match=f"^budget {limit}: a tree of that many nodes cannot be verified within the "
                                          f"target's context of {limit} tokens"):
        generate(target, PROMPT, "ddtree", drafter, budget=limit, max_new_tokens=NEW)
    assert generate(target, PROMPT, "ar", budget=limit, max_new_tokens=NEW).new_tokens == greedy(target, PROMPT)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_a_prompt_that_fills_the_targets_context_is_refused_and_one_a_token_shorter_gets_one_token(tiny_target, method):
    """The prefill's token takes the position after the prompt: a prompt of the whole context leaves it none (taken,
    its reply would be empty and say that max_new_tokens had ended it), one a token shorter leaves it the last."""
    target, _ = tiny_target
    limit = target.config.max_position_embeddings
    drafter = BrokenDrafter(target.config.vocab_size, period=10**9)
    with pytest.raises(DDTreeError, match=f"^prompt of {limit} tokens does not fit the target's context of {limit} "
                                          f"tokens: give one of at most {limit - 1}, which leaves the position of one "
                                          "new token$"):
        generate(target, [5] * limit, method, drafter, max_new_tokens=4)
    result = generate(target, [5] * (limit - 1), method, drafter, max_new_tokens=4)
    assert result.new_tokens == greedy(target, [5] * (limit - 1), new=1) and result.ended == "context"


@pytest.mark.parametrize("method, stop_at", [("ar", None), ("dflash", None), ("ddtree", None), ("ddtree", 8)])
def test_on_tokens_hears_each_committed_token_once_in_order_and_its_time_is_not_the_decodings(tiny_target, method,
                                                                                             stop_at, monkeypatch):
    """`ddtree generate` prints the reply through on_tokens as rounds commit it, rounds cut by max_new_tokens or a
    stop token included."""
    target, _ = tiny_target
    reference = greedy(target, PROMPT, new=NEW + 16)
    drafter = None if method == "ar" else RiggedDrafter(PROMPT + reference, target.config.vocab_size, block_size=8)
    stop = [] if stop_at is None else [reference[stop_at]]
    expected = reference[:NEW] if stop_at is None else reference[:reference.index(stop[0]) + 1]
    heard, hour, skipped = [], 3600.0, [0.0]  # each call to the listener moves decoding's clock on an hour

    def listen(tokens):
        heard.append(list(tokens))
        skipped[0] += hour

    clock = SimpleNamespace(perf_counter=lambda: time.perf_counter() + skipped[0])
    monkeypatch.setattr(ddtree.decoding, "time", clock)
    result = generate(target, PROMPT, method, drafter, budget=8, max_new_tokens=NEW, stop_ids=stop, on_tokens=listen)
    assert [token for tokens in heard for token in tokens] == result.new_tokens == expected
    assert [len(tokens) for tokens in heard] == [1] + [r.committed for r in result.rounds]  # the prefill's, each round's
    assert method == "ar" or max(r.committed for r in result.rounds) > 1  # rounds of several tokens
    assert result.decode_s < hour, (result.decode_s, len(result.rounds))  # the listener's hours left out


# ------------------------------------------------------------------------ a drafter of another target (review, 2027-01)


def small_target(seed=0, hidden=64, layers=4, vocab=256):
    """A random Llama target of the given shape, fast on a CPU (fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=16, max_position_embeddings=512)).eval()


def drafter_for(target):
    config = build_drafter_config(target, None, "small", num_layers=1, block_size=4,
                                  target_layer_ids=[0, target.config.num_hidden_layers - 1], mask_token_id=3)
    return DFlashDraftModel(config)


@pytest.mark.parametrize("other, problem", [
    (dict(hidden=96), r"hidden_size 64 != the target's 96; this drafter was built for another target"),
    (dict(layers=2), r"dflash_config.target_layer_ids \[0, 3\] must be non-empty and within 0..1 "
                    r"\(the target has 2 layers\)"),
    (dict(vocab=128), r"vocab_size 256 != the target's 128 embedding rows"),
], ids=["hidden", "layers", "vocab"])
def test_a_runner_of_a_drafter_built_for_another_target_is_refused_when_built(other, problem):
    """A shape mismatch or an IndexError deep in the first drafter forward, after the prefill, before."""
    drafter = drafter_for(small_target())
    with pytest.raises(DDTreeError, match=f"^drafter given to DrafterRunner: {problem}"):
        DrafterRunner(drafter, small_target(1, **other))


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_drafter_not_wrapped_in_a_runner_is_refused_with_how_to_wrap_it(method):
    """AttributeError 'features' after the prefill before."""
    target = small_target()
    with pytest.raises(DDTreeError, match=r"^drafter is a DFlashDraftModel, not a DrafterRunner: wrap it, "
                                          r"DrafterRunner\(drafter, target\)"):
        generate(target, PROMPT, method, drafter_for(target), budget=4, max_new_tokens=NEW)


class WithoutBlockSize(RiggedDrafter):
    """A drafter of its own with reset, features and propose, and no block_size."""

    def __getattribute__(self, name):
        if name == "block_size":
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("static", [False, True])
def test_a_drafter_of_its_own_without_block_size_or_redraft_is_refused_before_the_prefill(tiny_target, monkeypatch,
                                                                                           static):
    """Found in a review of the fixed-shape paths: the loop also reads block_size, and calls redraft when redraft > 0;
    a drafter without them passed the check and was an AttributeError after the prefill."""
    target, _ = tiny_target
    reference = PROMPT + greedy(target, PROMPT)
    without_redraft = RiggedDrafter(reference, target.config.vocab_size, block_size=4)  # rigged.py's has no redraft
    assert generate(target, PROMPT, "ddtree", without_redraft, budget=6, max_new_tokens=NEW, redraft=0,
                    static=static).new_tokens == greedy(target, PROMPT)  # without re-drafting, it decodes
    monkeypatch.setattr(ddtree.decoding.DynamicTarget, "prefill", lambda *args: pytest.fail("prefilled first"))
    monkeypatch.setattr(ddtree.decoding, "static_target", lambda *args, **kwargs: pytest.fail("built a static runner"))
    with pytest.raises(DDTreeError, match=r"^drafter is a WithoutBlockSize, not a DrafterRunner: wrap it, .*\(a "
                                          r"drafter of its own needs reset, features, propose and block_size; it has no "
                                          r"block_size\)$"):
        generate(target, PROMPT, "dflash", WithoutBlockSize(reference, target.config.vocab_size), max_new_tokens=NEW,
                 static=static)
    for method in ("dflash", "ddtree"):
        with pytest.raises(DDTreeError, match=r"^redraft 2 re-drafts with the drafter's redraft method, which this "
                                              r"RiggedDrafter has not: give redraft 0, or a DrafterRunner$"):
            generate(target, PROMPT, method, without_redraft, budget=6, max_new_tokens=NEW, redraft=2, static=static)


@pytest.mark.parametrize("vocab", [256, 128], ids=["same shapes", "fewer embedding rows"])
def test_a_runner_reused_with_another_target_is_refused(vocab):
    """Of the same shapes it drafted silently through the first target's embedding and LM head; of fewer embedding rows
    the verify indexed out of range."""
    first, second = small_target(0), small_target(1, vocab=vocab)
    runner = DrafterRunner(drafter_for(first), first)
    with pytest.raises(DDTreeError, match=r"^this DrafterRunner was built for another target"):
        generate(second, PROMPT, "ddtree", runner, budget=4, max_new_tokens=NEW)
    own = generate(first, PROMPT, "ddtree", runner, budget=4, max_new_tokens=NEW)  # with its own target it decodes
    assert own.new_tokens == greedy(first, PROMPT)


# ------------------------------------------------------------------------------ prompts straight from a tokenizer


def test_a_prompt_straight_from_a_tokenizer_decodes_as_its_input_ids(tiny_target):
    """apply_chat_template and tokenizer(text, return_tensors="pt") return a BatchEncoding (transformers 5): a
    TypeError about a str before."""
    target, tokenizer = tiny_target
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                         return_dict=True)
    ids = list(chat["input_ids"])
    assert generate(target, chat, "ar", max_new_tokens=4).new_tokens == greedy(target, ids, new=4)
    encoded = tokenizer("hello there", return_tensors="pt")  # input_ids (1, T)
    ids = encoded["input_ids"][0].tolist()
    result = generate(target, encoded, "ar", max_new_tokens=4)
    assert result.prompt_ids == ids and result.new_tokens == greedy(target, ids, new=4)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_encoding_decodes_as_its_unpadded_prompt(tiny_target, side):
    """Found in a review (2026-12-05): an encoding made with padding was decoded with its pad ids inside the prompt,
    and the reply silently differed from the unpadded prompt's."""
    target, tokenizer = tiny_target
    ids = tokenizer("hello there")["input_ids"]
    encoded = tokenizer("hello there", padding="max_length", max_length=len(ids) + 5, padding_side=side,
                        return_tensors="pt")
    assert 0 in encoded["attention_mask"]  # padded, on the side asked
    result = generate(target, encoded, "ar", max_new_tokens=6)
    assert result.prompt_ids == ids and result.new_tokens == greedy(target, ids, new=6)


@pytest.mark.parametrize("encoding, problem", [
    ({"input_ids": [[9, 5, 6, 7]], "attention_mask": [[1, 0, 1, 1]]},
     "prompt_ids has padding (attention_mask holds 0s) that is not one leading or trailing run (attended 3 of 4 "
     "positions): give the unpadded ids"),
    ({"input_ids": [0, 5, 6, 0], "attention_mask": [0, 1, 1, 0]}, "prompt_ids has padding (attention_mask holds 0s)"),
    ({"input_ids": [[0, 5, 6], [7, 8, 9]], "attention_mask": [[0, 1, 1], [1, 1, 1]]},
     "generate decodes one prompt at a time: prompt_ids has shape (2, 3)"),
    ({"input_ids": [5, 6, 7], "attention_mask": [1, 1]},
     "prompt_ids's attention_mask has 2 positions for 3 input_ids"),
    ({"input_ids": [0, 0], "attention_mask": [0, 0]}, "prompt_ids has padding (attention_mask holds 0s)"),
    ({"input_ids": [5, 6], "attention_mask": [[1], [1, 1]]},
     "prompt_ids's attention_mask is not 0s and 1s (expected sequence of length 1 at dim 1 (got 2)): give the "
     "encoding as the tokenizer returned it"),
    ({"input_ids": [5, 6], "attention_mask": [None, 1]}, "prompt_ids's attention_mask is not 0s and 1s ("),
], ids=["hole", "both ends", "padded batch", "mask too short", "all padding", "ragged mask", "mask of None"])
def test_padding_that_is_not_one_run_at_an_end_is_one_line(tiny_target, encoding, problem):
    target, _ = tiny_target
    with pytest.raises(DDTreeError) as error:
        generate(target, encoding, "ar", max_new_tokens=4)
    assert str(error.value).startswith(problem)


@pytest.mark.parametrize("prompt, problem", [
    ("hi", r"prompt_ids is text \('hi'\), not token ids: tokenize it first"),
    ({"attention_mask": [1, 1]}, r"prompt_ids is a mapping without \"input_ids\" \(keys \['attention_mask'\]\)"),
    (["hi", "there"], r"prompt_ids must be token ids \(a list of ints, or a 1-D or \(1, length\) tensor\), got a list"),
    ([5, None], r"prompt_ids must be token ids .*, got a list"),
    ([], r"the prompt is empty \(prompt_ids holds no token\): give at least one"),
    (torch.zeros(1, 0, dtype=torch.long), r"the prompt is empty \(prompt_ids holds no token\)"),
    # a bare number and booleans decoded as prompts before: [5], and True or a mask's [True, False] as [1] and [1, 0]
    (5, r"prompt_ids must be token ids .*, got the single number 5: give \[5\] for a one-token prompt"),
    (torch.tensor(7), r"prompt_ids must be token ids .*, got the single number 7: give \[7\]"),
    (True, r"prompt_ids must be token ids, whole numbers; got booleans: give the ids, not a mask"),
    ([True, False], r"prompt_ids must be token ids, whole numbers; got booleans"),
], ids=["text", "mapping without input_ids", "list of text", "None", "empty", "empty batch of one", "one number",
        "0-D tensor", "True", "booleans"])
def test_a_prompt_that_is_not_token_ids_is_one_line(tiny_target, prompt, problem):
    target, _ = tiny_target
    with pytest.raises(DDTreeError, match=f"^{problem}"):
        generate(target, prompt, "ar", max_new_tokens=4)


@pytest.mark.parametrize("method, problem", [
    ("beam", "unknown method 'beam': choose from ar, dflash, ddtree"),
    ("dflash", "method 'dflash' needs a drafter"),
    ("ddtree", "method 'ddtree' needs a drafter"),
])
def test_an_unknown_method_or_a_drafting_one_without_a_drafter_is_one_line(tiny_target, method, problem):
    target, _ = tiny_target
    with pytest.raises(DDTreeError) as error:
        generate(target, PROMPT, method, None, max_new_tokens=4)
    assert str(error.value) == problem


# ------------------------------------------------------------------------------ stop_ids and max_new_tokens


@pytest.mark.parametrize("as_given", [set, frozenset, lambda ids: dict.fromkeys(ids).keys(), lambda ids: [ids]],
                         ids=["set", "frozenset", "dict keys", "nested list"])
def test_stop_ids_stop_whether_a_set_dict_keys_or_a_nested_list(tiny_target, as_given):
    """A set of end-of-turn ids is a natural thing to pass: a TypeError before."""
    target, _ = tiny_target
    stop = greedy(target, PROMPT)[3]
    reference = greedy(target, PROMPT, stop=stop)
    result = generate(target, PROMPT, "ar", max_new_tokens=NEW, stop_ids=as_given([stop, 0]))
    assert result.new_tokens == reference and result.stopped


@pytest.mark.parametrize("stop_ids, problem", [
    ([None], "stop_ids holds None, not a token id: give integer ids (a tokenizer without an eos token has eos_token_id "
             "None: leave it out)"),
    ({2, 2.5}, "stop_ids holds 2.5, not a token id"),
    ([True], "stop_ids holds True, not a token id"),
    ("2", "stop_ids is text ('2'): give token ids"),
    (torch.tensor([2.0]), "stop_ids holds torch.float32 values: give integer token ids"),
    (torch.tensor([False, True]), "stop_ids holds torch.bool values: give integer token ids"),  # a mask, ids == eos
    (np.array([None]), "stop_ids is not integer token ids (can't convert np.ndarray of type numpy.object_"),
], ids=["None", "float", "bool", "text", "float tensor", "bool tensor", "array of objects"])
def test_a_stop_id_that_is_not_a_token_id_is_one_line(tiny_target, stop_ids, problem):
    """[tokenizer.eos_token_id] of a tokenizer without one ([None]) was a TypeError."""
    target, _ = tiny_target
    with pytest.raises(DDTreeError) as error:
        generate(target, PROMPT, "ar", max_new_tokens=NEW, stop_ids=stop_ids)
    assert str(error.value).startswith(problem)


@pytest.mark.parametrize("count", [None, -5, 2.0, "4", True])
def test_max_new_tokens_that_is_not_a_count_is_one_line(tiny_target, count):
    """None was a TypeError in a comparison; a negative count silently generated nothing (transformers refuses it)."""
    target, _ = tiny_target
    with pytest.raises(DDTreeError, match=f"^max_new_tokens {re.escape(repr(count))} must be a whole number >= 0"):
        generate(target, PROMPT, "ar", max_new_tokens=count)
    assert generate(target, PROMPT, "ar", max_new_tokens=0).new_tokens == []  # none asked, none given


@pytest.mark.parametrize("budget, problem", [(8.0, "budget 8.0 must be a whole number of nodes"),
                                             ("8", "budget '8' must be a whole number of nodes"),
                                             (True, "budget True must be a whole number of nodes"),
                                             (0, "budget 0 must be at least 1")])
def test_a_budget_that_is_not_a_node_count_is_one_line(tiny_target, budget, problem):
    """Found by a fuzzer (2026-12-02): a float budget was a TypeError deep in the tree's slicing."""
    target, _ = tiny_target
    with pytest.raises(DDTreeError, match=f"^{re.escape(problem)}"):
        generate(target, PROMPT, "ddtree", RiggedDrafter(list(range(3, 40)), target.config.vocab_size, block_size=4),
                 budget=budget, max_new_tokens=NEW)


@pytest.mark.parametrize("setting, problem", [
    (dict(lookup=2.5), "lookup 2.5 must be a whole number of tokens (an int)"),
    (dict(lookup=True), "lookup True must be a whole number of tokens (an int)"),
    (dict(lookup="3"), "lookup '3' must be a whole number of tokens (an int)"),
    (dict(redraft=1.5), "redraft 1.5 must be a whole number of depth-1 tokens (an int)"),
    (dict(redraft=True), "redraft True must be a whole number of depth-1 tokens (an int)"),
], ids=["lookup float", "lookup bool", "lookup text", "redraft float", "redraft bool"])
def test_a_lookup_or_redraft_that_is_not_a_count_is_one_line(tiny_target, setting, problem):
    """Found in a review (2026-12-05): redraft 1.5 passed the checks and was a TypeError in the first re-draft's topk,
    after the prefill; lookup 2.5 and True (taken as 1) decoded."""
    target, _ = tiny_target
    with pytest.raises(DDTreeError, match=f"^{re.escape(problem)}"):
        generate(target, PROMPT, "ddtree", RiggedDrafter(list(range(3, 40)), target.config.vocab_size, block_size=4),
                 budget=6, max_new_tokens=NEW, **setting)


@pytest.mark.parametrize("top_k", [2.5, True, "8", None, -1])
def test_a_top_k_that_is_not_a_count_is_one_line(top_k):
    """Found in a review (2026-12-05): Sampling(top_k=2.5) was taken, and the first sampled token was a TypeError in
    torch's topk, after the prefill."""
    with pytest.raises(DDTreeError, match=f"^bad sampling settings: top_k {re.escape(repr(top_k))} must be a whole "
                                          "number >= 0$"):
        ddtree.decoding.Sampling(temperature=1.0, top_k=top_k)
    assert ddtree.decoding.Sampling(temperature=1.0, top_k=np.int64(8)).top_k == 8  # a count read from an array: taken


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.5, float("nan")])
def test_a_top_p_outside_zero_to_one_is_one_line(top_p):
    """top_p 0 cuts every token: its probabilities would be NaN, and the first sampled token torch.multinomial's
    RuntimeError after the prefill. 1, no cut, is the edge taken."""
    with pytest.raises(DDTreeError, match=rf"^bad sampling settings: top_p {top_p} must be in \(0, 1\]$"):
        ddtree.decoding.Sampling(temperature=1.0, top_p=top_p)
    assert ddtree.decoding.Sampling(temperature=1.0, top_p=1.0).top_p == 1.0


def test_sampling_settings_broken_together_are_named_together_in_order():
    """Every broken setting is named, in the order of the keywords, each with its rule: a user fixes them in one go."""
    with pytest.raises(DDTreeError, match=r"^bad sampling settings: temperature -1.0 must be a finite number >= 0; "
                                          r"top_p 2.0 must be in \(0, 1\]; top_k -1 must be a whole number >= 0$"):
        ddtree.decoding.Sampling(temperature=-1.0, top_p=2.0, top_k=-1)


class GeneratorOnCuda(torch.Generator):
    """A CPU generator that says it is on CUDA: a CUDA target's caller who built theirs on the CPU, turned around, as
    this machine can build no CUDA generator."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_a_generator_on_another_device_than_the_target_is_one_line_before_the_prefill(tiny_target, monkeypatch):
    """Sampling draws on the target's device, and torch.multinomial refuses a generator of another: on a CUDA target a
    CPU generator was a RuntimeError after the prefill. Greedy decoding draws nothing, so any generator does."""
    target, _ = tiny_target
    sampled = ddtree.decoding.Sampling(temperature=1.0)
    assert len(generate(target, PROMPT, "ar", max_new_tokens=3, sampling=sampled,
                        generator=torch.Generator().manual_seed(0)).new_tokens) == 3  # on the target's device: taken
    assert generate(target, PROMPT, "ar", max_new_tokens=NEW, generator=GeneratorOnCuda()).new_tokens == greedy(
        target, PROMPT)
    monkeypatch.setattr(ddtree.decoding.DynamicTarget, "prefill", lambda *args: pytest.fail("prefilled first"))
    with pytest.raises(DDTreeError, match=r"^generator on cuda:0, target on cpu: sampling draws on the target's device; "
                                          r"build it there \(torch.Generator\(device=target.device\)\)$"):
        generate(target, PROMPT, "ar", max_new_tokens=NEW, sampling=sampled, generator=GeneratorOnCuda())


# ------------------------------------------------------------------------------ static


@pytest.mark.parametrize("static, built", [("off", False), ("auto", False), ("on", True), (False, False), (True, True)])
def test_static_takes_the_static_cache_names_as_the_cli_means_them(tiny_target, monkeypatch, static, built):
    """Found in a review of the fixed-shape paths: any text was taken as on, so static="off", the CLI's word for off,
    ran the static cache (the slower one on a CPU; with a sizer its error asked for what was given)."""
    target, _ = tiny_target
    runners = []  # the static runners generate built
    static_target = ddtree.decoding.static_target
    monkeypatch.setattr(ddtree.decoding, "static_target",
                        lambda *args, **kwargs: runners.append(args) or static_target(*args, **kwargs))
    drafter = RiggedDrafter(PROMPT + greedy(target, PROMPT), target.config.vocab_size, block_size=4)
    sizer = None if built else TreeSizer(fixed_ms=5.0, row_ms=1.0)  # "auto" on this CPU target: the dynamic cache
    result = generate(target, PROMPT, "ddtree", drafter, budget=6, max_new_tokens=NEW, static=static, sizer=sizer)
    assert result.new_tokens == greedy(target, PROMPT)
    assert len(runners) == built


@pytest.mark.parametrize("static", ["no", "OFF", 1, 0, "True"])
def test_a_static_that_is_not_a_setting_is_one_line(tiny_target, static):
    target, _ = tiny_target
    with pytest.raises(DDTreeError, match=f"^static {re.escape(repr(static))} must be None \\(the static cache on CUDA "
                                          r"only\), True or False, or one of --static-cache's 'auto', 'on', 'off'$"):
        generate(target, PROMPT, "ar", max_new_tokens=NEW, static=static)
