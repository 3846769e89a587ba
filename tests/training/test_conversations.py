"""Tests of training/conversations.py: file loading and chat-template loss masks (golden).

    .venv/bin/pytest -q tests/training/test_conversations.py

Loss-mask goldens cover three template families: SmolLM2's real tokenizer and chat template, and
Qwen3- and Llama-3-format templates written here (their tokenizers are not downloadable offline)
on top of SmolLM2's tokenizer with those families' special tokens added; Qwen3's also with the thinking block
decoding meets (no enable_thinking), and Llama-2-chat's.
"""

import json
import re

import datasets
import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer

import training.conversations
from ddtree.bench import chat_prompt_ids
from ddtree.errors import DDTreeError
from ddtree.targets import builtin_target_folder
from training.conversations import (
    CHAT_TARGET,
    assistant_header,
    common_ending,
    end_of_turn_text,
    load_conversations,
    prompt_end,
    read_messages_jsonl,
    render_with_loss_mask,
    rows_to_records,
    tokenize_conversations,
)

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

# Qwen3's format: <|im_start|>role\n...<|im_end|>\n; assistant turns after the last user turn
# carry a (here empty) <think> block, earlier ones have it stripped; non-thinking generation
# prompt ends with the empty think block.
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and loop.last -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)

# Qwen3's format as decoding renders it (no enable_thinking): the generation prompt is "<|im_start|>assistant\n", and
# a reply after the last user turn renders as "<think>\n" + its reasoning + "\n</think>\n\n" + the reply, all of
# which the target writes after that prompt; a reply before the last user turn renders without its reasoning.
QWEN3_THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Llama-3's format: BOS, <|start_header_id|>role<|end_header_id|>\n\n + trimmed content + <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

# Llama-2-chat's format (meta-llama/Llama-2-7b-chat-hf's template, system prompt aside): BOS [INST] prompt [/INST],
# then ' ' + trimmed reply + ' ' + EOS: a space stands between the reply and its end-of-turn token.
LLAMA2_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{{- bos_token + '[INST] ' + m.content | trim + ' [/INST]' -}}"
    "{%- elif m.role == 'assistant' -%}{{- ' ' + m.content | trim + ' ' + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)

# Mistral-7B-Instruct-v0.3's template (its tokenizer_config.json): the system prompt is written into the last user turn
# only, so a render that ends with the reply has none, and decoding's prompt always has it.
MISTRAL_V3_TEMPLATE = (
    '{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}'
    '{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}'
    '{{- bos_token }}{%- for message in loop_messages %}'
    '{%- if message["role"] == "user" %}{%- if loop.last and system_message is defined %}'
    '{{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}'
    '{%- else %}{{- "[INST] " + message["content"] + "[/INST]" }}{%- endif %}'
    '{%- elif message["role"] == "assistant" %}{{- " " + message["content"]|trim + eos_token}}{%- endif %}'
    '{%- endfor %}'
)

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And the assistant says?"},
    {"role": "assistant", "content": "assistant"},  # same text as the role header: must not match it
]


@pytest.fixture(scope="module")
def smol_folder():
    return builtin_target_folder("smollm2-135m")


@pytest.fixture(scope="module")
def smol_tokenizer(smol_folder):
    return AutoTokenizer.from_pretrained(smol_folder)


@pytest.fixture(scope="module")
def qwen3_tokenizer(smol_folder):
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.add_tokens(["<think>", "</think>"])  # Qwen3: added, not special
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def qwen3_thinking_tokenizer(smol_folder):
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_THINKING_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def llama3_tokenizer(smol_folder):
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def s_tokens_tokenizer(smol_folder, template: str):
    """SmolLM2's tokenizer with <s> and </s> as its bos and eos, under a Llama-2-family template."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.add_tokens(["<s>", "</s>"], special_tokens=True)
    tokenizer.bos_token, tokenizer.eos_token = "<s>", "</s>"
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def llama2_tokenizer(smol_folder):
    return s_tokens_tokenizer(smol_folder, LLAMA2_TEMPLATE)


@pytest.fixture(scope="module")
def mistral_v3_tokenizer(smol_folder):
    return s_tokens_tokenizer(smol_folder, MISTRAL_V3_TEMPLATE)


def decoding_prompt(tokenizer, messages):
    """The prompt decoding feeds the target, which training's render must begin with."""
    return chat_prompt_ids(tokenizer, messages, "the test's messages", CHAT_TARGET)


def masked_runs(tokenizer, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, bit in zip(ids + [None], mask + [0]):
        if bit:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def assert_golden(tokenizer, messages, expected_text, expected_runs):
    ids, mask = render_with_loss_mask(tokenizer, messages)
    assert len(ids) == len(mask)
    assert tokenizer.decode(ids) == expected_text
    assert masked_runs(tokenizer, ids, mask) == expected_runs
    # Exactly the tokens of each supervised run, id for id, and nothing else is masked.
    expected_ids = [i for run in expected_runs for i in tokenizer(run, add_special_tokens=False)["input_ids"]]
    assert [i for i, bit in zip(ids, mask) if bit] == expected_ids


# ----------------------------------------------------------------------------- goldens

def test_smollm2_mask_covers_content_and_im_end_only(smol_tokenizer):
    expected = (
        SMOL_SYSTEM
        + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n2+2 is 4.<|im_end|>\n"
        + "<|im_start|>user\nAnd the assistant says?<|im_end|>\n<|im_start|>assistant\nassistant<|im_end|>\n"
    )
    assert_golden(smol_tokenizer, CONVERSATION, expected, ["2+2 is 4.<|im_end|>", "assistant<|im_end|>"])


def test_an_opening_assistant_turn_is_found_after_its_header_not_in_the_default_system_prompt(smol_tokenizer):
    """Searched from position 0, a reply that SmolLM2's default system prompt ends with ("...trained by Hugging
    Face") was supervised inside that prompt, and the reply itself was not."""
    messages = [{"role": "assistant", "content": "trained by Hugging Face"}, {"role": "user", "content": "Who?"},
                {"role": "assistant", "content": "Nobody."}]
    assert "trained by Hugging Face" in SMOL_SYSTEM
    expected = (SMOL_SYSTEM + "<|im_start|>assistant\ntrained by Hugging Face<|im_end|>\n<|im_start|>user\nWho?<|im_end|>\n"
                "<|im_start|>assistant\nNobody.<|im_end|>\n")
    ids, mask = render_with_loss_mask(smol_tokenizer, messages)
    assert smol_tokenizer.decode(ids) == expected
    first = mask.index(1)
    assert smol_tokenizer.decode(ids[:first]).endswith("<|im_start|>assistant\n")
    assert masked_runs(smol_tokenizer, ids, mask) == ["trained by Hugging Face<|im_end|>", "Nobody.<|im_end|>"]


def test_a_template_whose_prefix_render_is_no_prefix_still_masks_the_assistant_turn(smol_folder):
    """This template writes the conversation's length first, so no shorter render is a prefix of the whole one. The
    search for the second reply ("Yes") used to start at the first reply's end, and the user turn in between ends
    with the same text and the same <|im_end|>: the user's "Yes" was supervised, the reply not. A conversation that
    ends with that reply trains it after decoding's prompt, the first reply as context, as under
    Mistral-7B-Instruct-v0.3's template."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.chat_template = (
        "{{ '<|im_start|>system\\n' ~ messages | length ~ ' turns<|im_end|>\\n' }}"
        "{% for m in messages %}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "Say no."}, {"role": "assistant", "content": "No."},
                {"role": "user", "content": "Now repeat after me: Yes"}, {"role": "assistant", "content": "Yes"}]
    ids, mask = render_with_loss_mask(tokenizer, messages + [{"role": "user", "content": "Thanks."}])
    assert masked_runs(tokenizer, ids, mask) == ["No.<|im_end|>", "Yes<|im_end|>"]
    (second,) = [i for i in range(len(ids)) if mask[i] and not mask[i - 1]][1:]
    assert tokenizer.decode(ids[:second]).endswith("me: Yes<|im_end|>\n<|im_start|>assistant\n")
    ids, mask = render_with_loss_mask(tokenizer, messages)
    prompt = decoding_prompt(tokenizer, messages[:3])
    assert ids == prompt + tokenizer("Yes<|im_end|>", add_special_tokens=False)["input_ids"]
    assert mask.index(1) == len(prompt)


def test_a_reply_rendered_only_in_part_after_a_header_found_by_search_is_context_not_refused(smol_folder):
    """Where no shorter render is a prefix the turn is found after the assistant header, and a reply the template
    renders only the end of (its reasoning stripped, as Qwen3 does) is context: the turn's text begins after that
    header, so its kept end is the reply's. With the header counted in it, the reply would match nothing and the whole
    conversation be refused, its later replies untrained."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.chat_template = (  # the turn count first (no prefix renders), earlier replies without their reasoning
        "{{ '<|im_start|>system\\n' ~ messages | length ~ ' turns<|im_end|>\\n' }}"
        "{% for m in messages %}{% set content = m['content'] %}"
        "{% if m['role'] == 'assistant' and not loop.last %}{% set content = content.split('</think>')[-1] | trim %}"
        "{% endif %}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ content ~ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    messages = [{"role": "user", "content": "Say no."}, {"role": "assistant", "content": "<think>Easy.</think>\n\nNo."},
                {"role": "user", "content": "Now say yes."}, {"role": "assistant", "content": "Yes."},
                {"role": "user", "content": "Thanks."}]
    ids, mask = render_with_loss_mask(tokenizer, messages)
    assert masked_runs(tokenizer, ids, mask) == ["Yes.<|im_end|>"]
    assert tokenizer.decode(ids[:mask.index(1)]).endswith("Now say yes.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("fixture", ["smol_tokenizer", "llama3_tokenizer"])
def test_special_token_text_inside_a_reply_is_supervised_as_plain_text(fixture, request):
    """A reply about chat templates that writes "<|im_end|>": the target can only have written it as plain text (its
    special token would have ended the turn), so that is what the drafter learns; only the real end of turn is one.
    So too in a reply cut short (finish_reason "length"), which has no end of turn."""
    tokenizer = request.getfixturevalue(fixture)
    reply = "ChatML closes a turn with <|im_end|>, and Llama 3 with <|eot_id|>."
    messages = [{"role": "user", "content": "How do turns end?"}, {"role": "assistant", "content": reply}]
    ids, mask = render_with_loss_mask(tokenizer, messages)
    supervised = [i for i, bit in zip(ids, mask) if bit]
    eot = tokenizer.convert_tokens_to_ids([end_of_turn_text(tokenizer)])
    literal = tokenizer(reply, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert supervised == literal + eot
    assert not set(literal) & set(tokenizer.all_special_ids) and tokenizer.decode(literal) == reply
    (cut,), _ = tokenize_conversations(tokenizer, [{"messages": messages, "finish_reason": "length"}],
                                       max_length=500, min_supervised_tokens=1)
    assert [i for i, bit in zip(cut["input_ids"], cut["loss_mask"]) if bit] == literal


def test_smollm2_with_system_prompt_and_empty_answer(smol_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": ""}, {"role": "user", "content": "Hello?"},
                {"role": "assistant", "content": "Hello!"}]
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                "<|im_end|>\n<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n")
    # The empty answer still teaches "stop here": only its end-of-turn token is supervised.
    assert_golden(smol_tokenizer, messages, expected, ["<|im_end|>", "Hello!<|im_end|>"])


def test_qwen3_mask_skips_the_think_block_and_history_form(qwen3_tokenizer):
    expected = (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n2+2 is 4.<|im_end|>\n"
        "<|im_start|>user\nAnd the assistant says?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nassistant<|im_end|>\n"
    )
    assert_golden(qwen3_tokenizer, CONVERSATION, expected, ["2+2 is 4.<|im_end|>", "assistant<|im_end|>"])


@pytest.mark.parametrize("reply", ["2+2 is 4.", "hi", "in", "think"])
def test_qwen3s_thinking_template_supervises_the_think_block_the_target_writes_after_the_decoding_prompt(
        qwen3_thinking_tokenizer, reply):
    """Decoding's prompt ends "<|im_start|>assistant\n" and the target writes "<think>\n\n</think>\n\n" next: it was
    left out of the loss as prompt, and a reply found inside it ("hi", "in") had its conversation refused."""
    tokenizer, messages = qwen3_thinking_tokenizer, [{"role": "user", "content": "What is 2+2?"},
                                                    {"role": "assistant", "content": reply}]
    ids, mask = render_with_loss_mask(tokenizer, messages)
    prompt = decoding_prompt(tokenizer, messages[:1])
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert ids[:len(prompt)] == prompt and mask.index(1) == len(prompt)
    assert masked_runs(tokenizer, ids, mask) == [f"<think>\n\n</think>\n\n{reply}<|im_end|>"]
    think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert [i for i, bit in zip(ids, mask) if bit and i in think] == think  # the tokens the target writes, not text


def test_qwen3s_thinking_template_trains_on_a_conversation_whose_earlier_reply_has_its_reasoning_stripped(
        qwen3_thinking_tokenizer):
    """The template drops an earlier reply's <think> block from the history, so that reply was not found in the render
    and the conversation refused, stopping the whole data preparation. Found by its end, it was then supervised as
    its bare answer right after decoding's prompt, where the target writes "<think>": that reply is not supervised."""
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n2+2 is 4."},
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n6."}]
    expected = ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n2+2 is 4.<|im_end|>\n"
                "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\nAgain.\n</think>\n\n6.<|im_end|>\n")
    ids, mask = render_with_loss_mask(qwen3_thinking_tokenizer, messages)
    assert qwen3_thinking_tokenizer.decode(ids) == expected
    assert masked_runs(qwen3_thinking_tokenizer, ids, mask) == ["<think>\nAgain.\n</think>\n\n6.<|im_end|>"]
    later_prompt = decoding_prompt(qwen3_thinking_tokenizer, messages[:3])  # the history tokenized as decoding does
    assert ids[:len(later_prompt)] == later_prompt and mask.index(1) == len(later_prompt)


@pytest.mark.parametrize("earlier", [[], [{"role": "user", "content": "What is 2+2?"},
                                          {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4."}]])
def test_a_qwen3_reply_cut_inside_its_thinking_is_the_decoding_prompt_then_what_the_target_wrote(
        qwen3_thinking_tokenizer, earlier):
    """Cut by max_new_tokens before its "</think>", a reply gets an empty think block from the template in front of
    its own ("<think>\n\n</think>\n\n<think>\nLet me ..."), which was supervised: tokens the target never wrote."""
    tokenizer = qwen3_thinking_tokenizer
    reply = "<think>\nLet me add 17 and 25: 17 + 20 is 37, and"
    messages = [*earlier, {"role": "user", "content": "What is 17+25?"}, {"role": "assistant", "content": reply}]
    (cut,), _ = tokenize_conversations(tokenizer, [{"messages": messages, "finish_reason": "length"}],
                                       max_length=500, min_supervised_tokens=1)
    prompt = decoding_prompt(tokenizer, messages[:-1])
    assert cut["input_ids"][:len(prompt)] == prompt and cut["loss_mask"].index(1) == len(prompt)
    assert masked_runs(tokenizer, cut["input_ids"], cut["loss_mask"]) == [reply]  # no end of turn either
    think = tokenizer.convert_tokens_to_ids("<think>")
    assert cut["input_ids"][len(prompt)] == think and cut["input_ids"].count(think) == 1


def test_llama3_mask_with_trimmed_content(llama3_tokenizer):
    messages = [{"role": "system", "content": "You are terse."}] + CONVERSATION
    messages[2] = {"role": "assistant", "content": "  2+2 is 4.\n"}  # the template trims it
    expected = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n2+2 is 4.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd the assistant says?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nassistant<|eot_id|>"
    )
    assert_golden(llama3_tokenizer, messages, expected, ["2+2 is 4.<|eot_id|>", "assistant<|eot_id|>"])


def test_llama2_mask_supervises_the_space_before_eos_as_rendered_and_eos(llama2_tokenizer):
    """Llama-2-chat closes a reply with ' ' + eos: every conversation was refused ("not with a special token")."""
    assert end_of_turn_text(llama2_tokenizer) == "</s>"
    expected = ("<s>[INST] What is 2+2? [/INST] 2+2 is 4. </s><s>[INST] And the assistant says? [/INST] assistant </s>")
    # The space after [/INST] is past the prompt decoding feeds: the target writes it, with the reply's first token.
    assert_golden(llama2_tokenizer, CONVERSATION, expected, [" 2+2 is 4. </s>", " assistant </s>"])
    ids, mask = render_with_loss_mask(llama2_tokenizer, CONVERSATION)
    assert ids == llama2_tokenizer(expected, add_special_tokens=False)["input_ids"]  # the spaces: the template's tokens
    supervised = [token for token, bit in zip(llama2_tokenizer.convert_ids_to_tokens(ids), mask) if bit]
    assert supervised[-3:] == ["\u0120assistant", "\u0120", "</s>"]  # the space before eos, then eos itself
    ids, mask = render_with_loss_mask(llama2_tokenizer, CONVERSATION[:2])
    prompt = decoding_prompt(llama2_tokenizer, CONVERSATION[:1])
    assert ids[:len(prompt)] == prompt and mask.index(1) == len(prompt)


def test_prompt_render_is_a_prefix_of_the_conversation_render(smol_tokenizer, qwen3_tokenizer, llama3_tokenizer):
    # Training sees the same tokens decoding will feed the target before the first answer token.
    for tokenizer in (smol_tokenizer, llama3_tokenizer):
        ids, mask = render_with_loss_mask(tokenizer, CONVERSATION[:2])
        prompt = decoding_prompt(tokenizer, CONVERSATION[:1])
        assert ids[: len(prompt)] == prompt and mask.index(1) == len(prompt)
    # Qwen3's non-thinking prompt ends with the empty think block, which sits before the answer.
    ids, mask = render_with_loss_mask(qwen3_tokenizer, CONVERSATION[:2])
    prompt = decoding_prompt(qwen3_tokenizer, CONVERSATION[:1])
    assert ids[: len(prompt)] == prompt and mask.index(1) == len(prompt)


# ----------------------------------------------------------------------------- tokenize

def test_tokenize_conversations_truncates_to_a_prefix_and_rejects_prompts(smol_tokenizer, caplog):
    (full,), _ = tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION}], 10_000, 1)
    (cut,), counts = tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION}], 40, 1)
    assert len(full["input_ids"]) > 40 and len(cut["input_ids"]) == 40 == len(cut["loss_mask"])
    assert cut["input_ids"] == full["input_ids"][:40] and cut["loss_mask"] == full["loss_mask"][:40]
    assert counts["truncated"] == 1
    caplog.clear()  # (the cut above is warned of)
    with caplog.at_level("WARNING"):  # exactly max_length: nothing cut, so neither counted nor warned of as cut
        (whole,), counts = tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION}],
                                                  len(full["input_ids"]), 1)
    assert whole == full and counts["truncated"] == 0 and not caplog.records
    with pytest.raises(DDTreeError, match="1 have no assistant tokens.*looks like a prompt file"):
        tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION[:1]}], 100, 1)


def test_tokenize_conversations_counts_and_skips(smol_tokenizer, caplog):
    long_answer = {"role": "assistant", "content": "word " * 200}
    records = [
        {"messages": CONVERSATION},  # kept
        {"messages": CONVERSATION[:1]},  # prompt only: skipped
        {"messages": [CONVERSATION[0], long_answer]},  # truncated, kept
        {"messages": [CONVERSATION[0], {"role": "assistant", "content": "ok"}]},  # 2 supervised tokens: dropped
    ]
    with caplog.at_level("INFO"):
        kept, counts = tokenize_conversations(smol_tokenizer, records, max_length=120, min_supervised_tokens=4)
    assert counts == {"conversations": 4, "no_assistant": 1, "unaligned": 0, "too_few_supervised": 1,
                      "reply_truncated": 0, "truncated": 1, "kept": 2}
    assert [len(k["input_ids"]) for k in kept][1] == 120
    assert "'truncated': 1" in caplog.text
    with pytest.raises(DDTreeError, match="looks like a prompt file"):
        tokenize_conversations(smol_tokenizer, [records[1], records[1]], 120, 4)
    with pytest.raises(DDTreeError) as mixed:  # a prompt-only line among short replies: no prompt file
        tokenize_conversations(smol_tokenizer, [records[1], records[3]], 120, 4)
    assert "1 have no assistant tokens" in str(mixed.value) and "prompt file" not in str(mixed.value), mixed.value


def test_a_conversation_with_exactly_min_supervised_tokens_is_kept(smol_tokenizer):
    """data.min_supervised_tokens is the fewest kept ("fewer assistant tokens than this: dropped"): a conversation at
    the bound is trained on, one token short of it is not."""
    (whole,), _ = tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION}], 10_000, 1)
    supervised = sum(whole["loss_mask"])
    kept, counts = tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION}] * 2, 10_000, supervised)
    assert kept == [whole, whole] and counts["too_few_supervised"] == 0
    with pytest.raises(DDTreeError, match=f"2 fewer than {supervised + 1} supervised tokens"):
        tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION}] * 2, 10_000, supervised + 1)


def test_a_short_reply_behind_a_long_prompt_is_not_counted_as_cut_away_by_truncation(smol_tokenizer):
    """reply_truncated (the warning's "because truncation cut their reply", whose remedy is data.max_length) counts the
    replies that had enough supervised tokens before the cut: one too short whole is dropped for itself, cut or not."""
    long_prompt = {"role": "user", "content": "word " * 200}
    records = [{"messages": [long_prompt, {"role": "assistant", "content": "4."}]},  # too short, and cut
               {"messages": [long_prompt, {"role": "assistant", "content": "Four, since two and two make four."}]}]
    kept, counts = tokenize_conversations(smol_tokenizer, records + [{"messages": CONVERSATION}], max_length=120,
                                          min_supervised_tokens=4)
    assert len(kept) == 1 and counts["truncated"] == 2
    assert counts["too_few_supervised"] == 2 and counts["reply_truncated"] == 1


def test_what_tokenization_drops_is_one_warning_naming_each_reason_and_the_settings(smol_tokenizer, caplog):
    """A run shows warnings only, and the only one said "1 of 4 conversations were truncated": it reads as kept, but
    right-truncation had cut away the whole reply of a long prompt, and that one, a prompt-only line and a short reply
    were dropped without a word (found in a review: 60 of 120 conversations)."""
    question, reply = CONVERSATION[0], {"role": "assistant", "content": "Four, since two and two make four."}
    records = [
        {"messages": [question, reply]},  # kept
        {"messages": [question]},  # no assistant turn
        {"messages": [question, {"role": "assistant", "content": "4."}]},  # a reply under min_supervised_tokens
        {"messages": [{"role": "user", "content": "word " * 200}, reply]},  # a long prompt: its reply cut away
        {"messages": [question, {"role": "assistant", "content": "word " * 200}]},  # a long reply: cut, kept
    ]
    with caplog.at_level("WARNING"):
        kept, counts = tokenize_conversations(smol_tokenizer, records, max_length=120, min_supervised_tokens=4,
                                              source="mine.jsonl")
    assert len(kept) == 2 and counts["reply_truncated"] == 1 and counts["truncated"] == 2
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == ("mine.jsonl: kept 2 of 5 conversations; dropped 1 with no assistant turn, 2 with fewer than 4 "
                       "supervised tokens within max_length 120 (1 of them because truncation cut their reply); 1 kept "
                       "were cut to max_length 120; raise data.max_length or lower data.min_supervised_tokens to keep "
                       "more")
    caplog.clear()
    with caplog.at_level("WARNING"):  # nothing dropped nor cut: nothing to say
        tokenize_conversations(smol_tokenizer, records[:1], max_length=120, min_supervised_tokens=4)
    assert not caplog.records
    with caplog.at_level("WARNING"):  # each setting named for what it would keep: only a reply cut, only one short
        tokenize_conversations(smol_tokenizer, [records[0], records[4]], max_length=120, min_supervised_tokens=4)
        tokenize_conversations(smol_tokenizer, [records[0], records[2]], max_length=120, min_supervised_tokens=4)
    assert [r.getMessage().split("; ")[-1] for r in caplog.records] == [
        "raise data.max_length to keep more", "lower data.min_supervised_tokens to keep more"]


def test_none_usable_for_too_few_supervised_tokens_names_the_settings_that_keep_them(smol_tokenizer):
    """Every conversation dropped for too few supervised tokens: the error named the counts but neither setting (a
    user with short replies read "fewer than 16 supervised tokens" and no data.min_supervised_tokens), which the
    warning names when some are kept."""
    short = {"messages": [CONVERSATION[0], {"role": "assistant", "content": "Red."}]}
    with pytest.raises(DDTreeError) as refused:
        tokenize_conversations(smol_tokenizer, [short], max_length=120, min_supervised_tokens=16, source="mine.jsonl")
    assert str(refused.value) == ("mine.jsonl: none of 1 conversations is usable: 0 have no assistant tokens, 0 a "
                                  "render the loss mask cannot follow, 1 fewer than 16 supervised tokens within "
                                  "max_length 120; lower data.min_supervised_tokens to keep them")
    long_prompt = {"messages": [{"role": "user", "content": "word " * 200}, CONVERSATION[1]]}
    with pytest.raises(DDTreeError, match=r"because truncation cut their reply\); raise data.max_length or lower "
                                          "data.min_supervised_tokens to keep them$"):
        tokenize_conversations(smol_tokenizer, [long_prompt], max_length=120, min_supervised_tokens=4)


def test_a_target_without_a_chat_template_is_one_line_naming_it(smol_folder):
    """A base model's tokenizer: finding the end-of-turn token and rendering a conversation raised transformers'
    ValueError, a traceback through `python -m training.train`, where decoding's prompt render said one line."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.chat_template = None
    said = f"{smol_folder}: the target's tokenizer has no chat template to apply; {CHAT_TARGET}"
    for render in (end_of_turn_text, lambda t: render_with_loss_mask(t, CONVERSATION[:2], eot="<|im_end|>"),
                   lambda t: tokenize_conversations(t, [{"messages": CONVERSATION[:2]}], 500, 1)):
        with pytest.raises(DDTreeError) as refused:
            render(tokenizer)
        assert str(refused.value) == said


def test_a_template_that_ends_a_reply_without_a_special_token_is_one_line_naming_what_it_writes(smol_folder):
    tokenizer = AutoTokenizer.from_pretrained(str(smol_folder))
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] ~ '\\n\\n' }}{% endfor %}"
    with pytest.raises(DDTreeError) as refused:
        end_of_turn_text(tokenizer)
    assert str(refused.value) == (f"the chat template of '{smol_folder}' ends an assistant turn with '\\n\\n', "
                                  "not with a special token; the loss mask needs an end-of-turn token")


def test_a_conversation_the_loss_mask_cannot_follow_is_skipped_and_counted_unless_all_are(smol_folder, caplog):
    """One reply the template rewrote stopped the preparation of the whole data set, with an error that named no
    conversation; now it is skipped and counted, with one warning naming it. A template that rewrites them all is
    still refused."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.chat_template = (  # rewrites "colour" in a reply: the reply's text is then not in the render
        "{% for m in messages %}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] | replace('colour', 'color') "
        "~ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    plain = {"id": "plain", "messages": CONVERSATION[:2]}
    rewritten = {"id": "rewritten",
                 "messages": [CONVERSATION[0], {"role": "assistant", "content": "Its colour is red."}]}
    with caplog.at_level("WARNING"):
        kept, counts = tokenize_conversations(tokenizer, [plain, rewritten, rewritten], 500, 1, "colours.jsonl")
    assert len(kept) == 1 and counts["unaligned"] == 2 and counts["kept"] == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith("colours.jsonl: kept 1 of 3 conversations; dropped 2 whose render the loss mask cannot "
                              "follow (the first, 'rewritten': ") and warning.endswith(")"), warning
    with pytest.raises(DDTreeError, match="colours.jsonl: no conversation could be rendered .* 'rewritten'"):
        tokenize_conversations(tokenizer, [rewritten, rewritten], 500, 1, "colours.jsonl")
    # Beside a prompt without a reply, the render is one reason of two: each is counted, not the first one's error
    prompt = {"id": "prompt", "messages": CONVERSATION[:1]}
    with pytest.raises(DDTreeError, match="colours.jsonl: none of 2 conversations is usable: 1 have no assistant "
                                          "tokens, 1 a render the loss mask cannot follow"):
        tokenize_conversations(tokenizer, [rewritten, prompt], 500, 1, "colours.jsonl")
    # One that keeps a reply's first line only: the line is in the render, but only a reply's end may stand for it
    # (Qwen3 strips an earlier reply's reasoning); kept, the conversation trained without that turn.
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ (m['content'].split('\\n')[0] if m['role'] "
        "== 'assistant' else m['content']) ~ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    cut = {"id": "cut", "messages": [CONVERSATION[0], {"role": "assistant", "content": "Line one.\nLine two."},
                                     *CONVERSATION[2:]]}
    kept, counts = tokenize_conversations(tokenizer, [plain, cut], 500, 1, "lines.jsonl")
    assert len(kept) == 1 and counts["unaligned"] == 1 and counts["kept"] == 1


def test_unfinished_answer_does_not_supervise_an_end_of_turn(smol_tokenizer):
    finished = {"messages": CONVERSATION[:2]}
    unfinished = {"messages": CONVERSATION[:2], "finish_reason": "length"}
    (done, cut), _ = tokenize_conversations(smol_tokenizer, [finished, unfinished], max_length=500, min_supervised_tokens=1)
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert done["input_ids"][-2] == im_end and done["loss_mask"][-2] == 1  # "...<|im_end|>" then "\n"
    assert cut["input_ids"] == done["input_ids"][:-2] and cut["loss_mask"] == done["loss_mask"][:-2]
    assert smol_tokenizer.decode([i for i, m in zip(cut["input_ids"], cut["loss_mask"]) if m]) == "2+2 is 4."
    (longer,), _ = tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION, "finish_reason": "length"}],
                                          max_length=500, min_supervised_tokens=1)  # the earlier reply: context
    assert masked_runs(smol_tokenizer, longer["input_ids"], longer["loss_mask"]) == ["assistant"]


def test_a_reply_cut_short_without_an_assistant_turn_last_is_skipped_not_trained_on_the_users_text(smol_tokenizer):
    """finish_reason "length" says the last message is the target's reply cut short; where the last message is the
    user's (a hand-edited row), rendering it as that reply would supervise the user's words as the target's."""
    asked = {"id": "asked", "messages": CONVERSATION[:3], "finish_reason": "length"}
    kept, counts = tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION[:2]}, asked], max_length=500,
                                          min_supervised_tokens=1)
    assert counts["unaligned"] == 1 and counts["kept"] == 1
    with pytest.raises(DDTreeError, match="finish_reason is 'length' but it does not end with an assistant turn"):
        tokenize_conversations(smol_tokenizer, [asked], max_length=500, min_supervised_tokens=1)


def test_a_template_that_writes_the_system_prompt_in_the_last_user_turn_trains_the_last_reply_after_decodings_prompt(
        mistral_v3_tokenizer, caplog, monkeypatch):
    """Mistral-7B-Instruct-v0.3 writes the system prompt only into the last user turn: a conversation's render never
    held it, the mask fell back to the assistant header (" ") without a word, and the reply's first token was split
    off its space ("Ġ" + "Une", which the target never writes). The last reply is now trained after decoding's
    prompt, its earlier replies as context, with one warning."""
    monkeypatch.setattr(training.conversations, "OTHER_CONTEXT_WARNED", set())
    tokenizer = mistral_v3_tokenizer
    single = [{"role": "system", "content": "Always answer in French."},
              {"role": "user", "content": "What is a cache?"},
              {"role": "assistant", "content": "Une cache est une memoire rapide."}]
    multi = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit and say why."},
             {"role": "assistant", "content": "Apple, because it is sweet."},
             {"role": "user", "content": "Another one and why"}, {"role": "assistant", "content": "Pear, why not."}]
    with caplog.at_level("WARNING"):
        for messages in (single, multi):
            ids, mask = render_with_loss_mask(tokenizer, messages)
            prompt = decoding_prompt(tokenizer, messages[:-1])
            assert ids[:len(prompt)] == prompt and mask.index(1) == len(prompt)
            reply = " " + messages[-1]["content"] + "</s>"
            assert ids[len(prompt):] == tokenizer(reply, add_special_tokens=False)["input_ids"]  # "ĠUne", not "Ġ"
            assert masked_runs(tokenizer, ids, mask) == [reply]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]  # once, not per conversation
    assert "renders the turns before a conversation's last reply otherwise than the prompt decoding feeds" in warning


def test_a_reply_before_a_closing_user_turn_keeps_its_space_where_the_system_prompt_moves(mistral_v3_tokenizer):
    """A conversation that ends with a user turn has no last reply to train after decoding's prompt: its reply is
    placed in the render itself, where the assistant header (" ") first matched the space after the first "[INST]".
    The reply was then supervised from "Apple" after an unsupervised "Ġ", a split the target never writes after
    decoding's prompt ("...[/INST]"): it writes "ĠApple"."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "Apple, because it is sweet."}, {"role": "user", "content": "Thanks."}]
    ids, mask = render_with_loss_mask(mistral_v3_tokenizer, messages)
    reply = mistral_v3_tokenizer(" Apple, because it is sweet.</s>", add_special_tokens=False)["input_ids"]
    assert ids[mask.index(1):mask.index(1) + len(reply)] == reply
    assert masked_runs(mistral_v3_tokenizer, ids, mask) == [" Apple, because it is sweet.</s>"]


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_a_regenerated_conversation_supervises_the_targets_last_reply_only_with_or_without_its_ids(smol_tokenizer,
                                                                                                 finish_reason):
    """In regenerated data only the last reply is the target's; the earlier ones are the user's text. With its
    response_ids a row supervised that reply alone, without them (dropped, as the error for an edited reply advises,
    or never recovered) every earlier reply too: the same row trained 1 or 3 replies. Text data trains them all."""
    history = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "I want to learn tide pools."},
               {"role": "assistant", "content": "Start with the basics. EARLIER-REPLY-A"},
               {"role": "user", "content": "What next?"},
               {"role": "assistant", "content": "Practice every day. EARLIER-REPLY-B"},
               {"role": "user", "content": "And after that?"}]
    reply = "Teach someone else what you learned."
    ids = smol_tokenizer(reply, add_special_tokens=False)["input_ids"]
    row = {"messages": history + [{"role": "assistant", "content": reply}], "finish_reason": finish_reason}
    examples, _ = tokenize_conversations(smol_tokenizer, [dict(row, response_ids=ids), row], max_length=500,
                                         min_supervised_tokens=1)
    prompt = decoding_prompt(smol_tokenizer, history)
    runs = [masked_runs(smol_tokenizer, e["input_ids"], e["loss_mask"]) for e in examples]
    assert runs[0] == runs[1] == [reply + ("<|im_end|>" if finish_reason == "stop" else "")]
    assert all(e["input_ids"][:len(prompt)] == prompt for e in examples)  # the history as decoding feeds it
    (text,), _ = tokenize_conversations(smol_tokenizer, [{"messages": row["messages"]}], 500, 1)
    assert len(masked_runs(smol_tokenizer, text["input_ids"], text["loss_mask"])) == 3  # text data: every reply



@pytest.mark.parametrize("question", ["Are you sure? I want a plain Yes.", "Are you sure? Yes. or No.?"])
def test_a_trimmed_replys_leading_whitespace_is_not_searched_for_in_a_later_turn(llama3_tokenizer, question):
    """Llama-3 trims " Yes." to "Yes.": the search for " Yes." went on into the next user turn, so the user's text was
    supervised and the reply not, or, where the user's text went on after it, the conversation was refused."""
    messages = [{"role": "user", "content": "Is the sky blue? Answer Yes or No."},
                {"role": "assistant", "content": " Yes."},
                {"role": "user", "content": question}, {"role": "assistant", "content": "Yes, sure."}]
    ids, mask = render_with_loss_mask(llama3_tokenizer, messages)
    assert masked_runs(llama3_tokenizer, ids, mask) == ["Yes.<|eot_id|>", "Yes, sure.<|eot_id|>"]
    prompt = decoding_prompt(llama3_tokenizer, messages[:1])
    assert ids[:len(prompt)] == prompt and mask.index(1) == len(prompt)

def test_an_unfinished_llama2_reply_does_not_supervise_the_space_its_template_writes_before_eos(llama2_tokenizer):
    """Cut at max_new_tokens, the reply's " </s>" was cut to " ": a space the target never wrote was supervised. Nor
    is the space the template writes after [/INST]: a reply cut short is decoding's prompt, then its own text."""
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "one two three"}]
    (cut,), _ = tokenize_conversations(llama2_tokenizer, [{"messages": messages, "finish_reason": "length"}],
                                       max_length=500, min_supervised_tokens=1)
    prompt = decoding_prompt(llama2_tokenizer, messages[:1])
    assert cut["input_ids"][:len(prompt)] == prompt and cut["loss_mask"].index(1) == len(prompt)
    reply = cut["input_ids"][len(prompt):]
    assert llama2_tokenizer.decode(reply) == "one two three" and all(cut["loss_mask"][len(prompt):])

@pytest.mark.parametrize("reply", ["\n\nSure, here.", "  Sure, here.", "\n", "   "])
def test_a_replys_leading_whitespace_is_supervised_where_the_template_keeps_it(smol_tokenizer, reply):
    """It was trimmed before the search, so it joined the prompt piece: the training prompt then differed from the
    one decoding feeds the target, and the whitespace the target wrote went unsupervised. A reply of whitespace
    alone did so until the reply's span began where decoding's prompt ends."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    ids, mask = render_with_loss_mask(smol_tokenizer, messages)
    prompt = decoding_prompt(smol_tokenizer, messages[:1])
    assert ids[:len(prompt)] == prompt and mask.index(1) == len(prompt)
    assert smol_tokenizer.decode([i for i, m in zip(ids, mask) if m]) == reply + "<|im_end|>"


def test_a_regenerated_reply_supervises_the_ids_its_target_generated(smol_tokenizer):
    """The target may split a word otherwise than the tokenizer does (`read` `line` for `readline`): with
    response_ids the labels are those ids, after the prompt decoding feeds the target, then the end of turn."""
    messages = [{"role": "user", "content": "Read a line."}]
    generated = smol_tokenizer("f.read", add_special_tokens=False)["input_ids"] + \
        smol_tokenizer("line()", add_special_tokens=False)["input_ids"]
    text = smol_tokenizer.decode(generated)
    assert smol_tokenizer(text, add_special_tokens=False)["input_ids"] != generated  # the text alone loses the split
    record = {"id": "r", "messages": messages + [{"role": "assistant", "content": text}], "response_ids": generated}
    unfinished = dict(record, finish_reason="length")
    (done, cut), _ = tokenize_conversations(smol_tokenizer, [record, unfinished], max_length=500, min_supervised_tokens=1)
    prompt = decoding_prompt(smol_tokenizer, messages)
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert done["input_ids"] == prompt + generated + [im_end]
    assert done["loss_mask"] == [0] * len(prompt) + [1] * (len(generated) + 1)
    assert cut["input_ids"] == prompt + generated and cut["loss_mask"][-1] == 1  # no end of turn the target never chose
    text_only = {"messages": record["messages"]}
    (plain,), _ = tokenize_conversations(smol_tokenizer, [text_only], max_length=500, min_supervised_tokens=1)
    assert plain["input_ids"][:len(prompt)] == prompt and plain["input_ids"] != done["input_ids"]
    with pytest.raises(DDTreeError, match="do not decode to its last assistant turn"):
        tokenize_conversations(smol_tokenizer, [dict(record, response_ids=generated[:-1])], 500, 1)


def test_a_regenerated_reply_holding_a_special_token_is_kept_as_its_ids(smol_tokenizer):
    """data/regenerate.py writes a reply's text decoded without special tokens, while its response_ids keep every
    id the target chose (one such as <|im_start|> that is not a stop): the check that the ids are the reply's must
    decode them the same way, or each such row would be skipped as an edited reply and its ids never trained on."""
    messages = [{"role": "user", "content": "Say hi."}]
    im_start = smol_tokenizer.convert_tokens_to_ids("<|im_start|>")
    words = [smol_tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("Hi", " there")]
    generated = words[0] + [im_start] + words[1]
    text = smol_tokenizer.decode(generated, skip_special_tokens=True)  # as data/regenerate.py writes it
    record = {"id": "r", "messages": messages + [{"role": "assistant", "content": text}], "response_ids": generated}
    (example,), counts = tokenize_conversations(smol_tokenizer, [record], max_length=500, min_supervised_tokens=1)
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert counts["unaligned"] == 0
    assert example["input_ids"] == decoding_prompt(smol_tokenizer, messages) + generated + [im_end]


# ----------------------------------------------------------------------------- files

def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_read_messages_jsonl_errors_name_file_and_line(tmp_path):
    good = json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(DDTreeError, match=r"bad\.jsonl:2: not valid JSON"):
        read_messages_jsonl(write_lines(tmp_path / "bad.jsonl", [good, "{oops"]))
    with pytest.raises(DDTreeError, match=r"nomsg\.jsonl:1: .*'messages'"):
        read_messages_jsonl(write_lines(tmp_path / "nomsg.jsonl", ['{"id": 1}']))
    with pytest.raises(DDTreeError, match=r"shape\.jsonl:1: messages\[1\] must be an object with 'role' and 'content'"):
        read_messages_jsonl(write_lines(tmp_path / "shape.jsonl", ['{"messages": [{"role": "user", "content": "x"}, '
                                                                   '{"role": "assistant", "text": "y"}]}']))
    with pytest.raises(DDTreeError, match=r"text\.jsonl:1: messages\[0\]\.content must be a string, got list$"):
        read_messages_jsonl(write_lines(tmp_path / "text.jsonl",
                                        ['{"messages": [{"role": "user", "content": ["x"]}]}']))
    with pytest.raises(DDTreeError, match=r"role\.jsonl:1: messages\[0\]\.role is 'robot'"):
        read_messages_jsonl(write_lines(tmp_path / "role.jsonl", ['{"messages": [{"role": "robot", "content": "x"}]}']))
    # a conversation of no turns was read, to be dropped later as one "with no assistant turn", not named here
    with pytest.raises(DDTreeError, match=r"none\.jsonl:2: 'messages' must be a non-empty list"):
        read_messages_jsonl(write_lines(tmp_path / "none.jsonl", [good, '{"messages": []}']))
    with pytest.raises(DDTreeError, match=r"dup\.jsonl:2: duplicate id 'a'"):
        read_messages_jsonl(write_lines(tmp_path / "dup.jsonl", [good, good]))
    with pytest.raises(DDTreeError, match="empty"):
        read_messages_jsonl(write_lines(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(DDTreeError, match="no such file"):
        read_messages_jsonl(tmp_path / "missing.jsonl")
    records = read_messages_jsonl(write_lines(tmp_path / "ok.jsonl", [good, '{"messages": [{"role": "user", "content": "x"}]}']))
    assert [r["id"] for r in records] == ["a", "ok-2"]
    # "id": null is no id, as in a Parquet table: it was the string "None", a duplicate at the second such line
    nulls = ['{"id": null, "messages": [{"role": "user", "content": "x"}]}'] * 2
    assert [r["id"] for r in read_messages_jsonl(write_lines(tmp_path / "null.jsonl", nulls))] == ["null-1", "null-2"]


def test_a_duplicate_id_that_a_line_without_an_id_was_named_says_so(tmp_path):
    """A line without an id is named "<file stem>-<line>": a file whose line 1 has none and line 2 the id "mine-1" was
    refused as "mine.jsonl:2: duplicate id 'mine-1'", an id the file holds once; the error now names both lines."""
    prompt = {"messages": [{"role": "user", "content": "x"}]}
    lines = [json.dumps(prompt), json.dumps({"id": "mine-1", **prompt})]
    with pytest.raises(DDTreeError) as refused:
        read_messages_jsonl(write_lines(tmp_path / "mine.jsonl", lines))
    assert str(refused.value) == (f"{tmp_path}/mine.jsonl:2: duplicate id 'mine-1', as at {tmp_path}/mine.jsonl:1 (a "
                                  "line without an id, named so); ids must be unique: give the line an id of its own")
    with pytest.raises(DDTreeError) as refused:  # the other way round: the line without an id comes second
        read_messages_jsonl(write_lines(tmp_path / "mine.jsonl", [json.dumps({"id": "mine-2", **prompt}), lines[0]]))
    assert str(refused.value) == (f"{tmp_path}/mine.jsonl:2: duplicate id 'mine-2' (its line has no id), as at "
                                  f"{tmp_path}/mine.jsonl:1; ids must be unique: give the line an id of its own")


def test_a_conversation_with_a_tool_turn_is_read_with_its_roles_in_order(tmp_path):
    """Agentic data carries tool results between the user and assistant turns, and chat templates render them: the
    reader must keep a "tool" turn, not refuse the whole file at its first such line."""
    turns = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Calling get_weather."},
             {"role": "tool", "content": "{\"temp_c\": 3}"}, {"role": "assistant", "content": "It is 3 C."}]
    (record,) = read_messages_jsonl(write_lines(tmp_path / "tools.jsonl", [json.dumps({"messages": turns})]))
    assert record["messages"] == turns


def test_a_lone_surrogate_in_a_conversation_is_one_line_naming_file_line_and_field(tmp_path):
    """JSON's "\\ud83d" (UTF-16 text cut mid-pair, common in scraped chats) is valid JSON and reads as a lone
    surrogate: the tokenizer refused it with a TypeError naming neither the file nor the line, and the whole data
    preparation stopped on a traceback. An id is the same (data/regenerate.py hashes it into its prompt's seed)."""
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    cut = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "cut \\ud83d"}]}'
    with pytest.raises(DDTreeError, match=r"^\S*cut\.jsonl:2: messages\[1\]\.content: not valid UTF-8 text \(a lone "
                                          r"surrogate, U\+D83D, at character 5"):
        load_conversations(write_lines(tmp_path / "cut.jsonl", [good, cut]))
    with pytest.raises(DDTreeError, match=r"id\.jsonl:1: id: not valid UTF-8 text \(a lone surrogate, U\+DC00"):
        load_conversations(write_lines(tmp_path / "id.jsonl", ['{"id": "a\\udc00", "messages": [{"role": "user", '
                                                               '"content": "hi"}]}']))


def test_load_conversations_from_jsonl_parquet_and_saved_dataset(tmp_path):
    rows = [{"id": f"c{i}", "messages": [CONVERSATION[0], {"role": "assistant", "content": f"answer {i}"}]} for i in range(3)]
    jsonl = write_lines(tmp_path / "c.jsonl", [json.dumps(r) for r in rows])
    Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    json_named = write_lines(tmp_path / "c.json", [json.dumps(r) for r in rows])  # JSONL as many tools name it
    upper = write_lines(tmp_path / "C.JSONL", [json.dumps(r) for r in rows])  # was "unknown file type '.JSONL'"
    Dataset.from_list(rows).to_parquet(str(tmp_path / "C.PARQUET"))
    for source, where in ((jsonl, f"{jsonl}:{{}}"), (json_named, f"{json_named}:{{}}"), (upper, f"{upper}:{{}}"),
                          (tmp_path / "c.parquet", f"{tmp_path / 'c.parquet'} row {{}}"),
                          (tmp_path / "C.PARQUET", f"{tmp_path / 'C.PARQUET'} row {{}}"),
                          (tmp_path / "saved", f"{tmp_path / 'saved'} row {{}}")):
        records = load_conversations(source)
        assert [{k: v for k, v in r.items() if k != "where"} for r in records] == rows, source
        # where each record is, for what later finds fault with it (tokenize_conversations): lines from 1, rows from 0
        lines = source in (jsonl, json_named, upper)
        assert [r["where"] for r in records] == [where.format(i + lines) for i in range(3)], source
    with pytest.raises(DDTreeError, match="no such file or folder"):
        load_conversations(tmp_path / "nothing-here")
    csv = write_lines(tmp_path / "c.csv", ["id,messages"])
    with pytest.raises(DDTreeError) as refused:
        load_conversations(csv)
    assert str(refused.value) == (f"{csv}: unknown file type '.csv'; give a .jsonl or .parquet file or a saved "
                                  "datasets folder")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DDTreeError, match="not a saved `datasets` folder"):
        load_conversations(tmp_path / "plain")
    Dataset.from_list([{"text": "x"}]).save_to_disk(str(tmp_path / "nomessages"))
    with pytest.raises(DDTreeError, match="no 'messages' column"):
        load_conversations(tmp_path / "nomessages")


def test_a_folder_of_jsonl_files_is_refused_with_what_to_give_instead(tmp_path):
    """A user's data as a folder of several JSONL files was refused with only what it is not ("not a saved `datasets`
    folder"): the error now says what the data path takes."""
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        write_lines(folder / name, [json.dumps({"messages": CONVERSATION[:2]})])
    with pytest.raises(DDTreeError) as refused:
        load_conversations(folder)
    assert str(refused.value) == (f"{folder}: not a saved `datasets` folder (no state.json or dataset_dict.json); "
                                  "give one .jsonl or .parquet file (the files of a folder joined into one) or a "
                                  "folder saved with datasets' save_to_disk")


def test_a_hub_dataset_that_cannot_be_loaded_is_one_line_with_the_first_line_of_the_cause(tmp_path, monkeypatch):
    """datasets' errors put the cause first and a long hint (or a chained traceback's text) after it: the one line
    must keep the cause, which says whether it was the network, the name or the format."""
    def offline(name, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\n"
                              "Check the name and your internet connection, then retry.")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.chdir(tmp_path)  # "someone/chats" is no local folder here
    with pytest.raises(DDTreeError) as raised:
        load_conversations("someone/chats")
    assert str(raised.value) == ("could not load Hub dataset 'someone/chats': Couldn't reach 'someone/chats' on the "
                                 "Hub (LocalEntryNotFoundError); without internet give a local file")


def test_a_hub_dataset_without_messages_or_rows_is_one_line_naming_what_it_lacks_not_a_failed_load(tmp_path,
                                                                                                   monkeypatch):
    """A Hub dataset that loads but holds no conversations: its own fault, not "could not load" and "without internet
    give a local file", which would send the user looking at their network."""
    tables = {"someone/texts": datasets.Dataset.from_list([{"text": "x"}]),
              "someone/empty": datasets.Dataset.from_dict({"messages": []})}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: tables[name])
    monkeypatch.chdir(tmp_path)  # no local folders of those names here
    for name, said in (("someone/texts", "someone/texts: row 0 has no 'messages' column (columns: text)"),
                       ("someone/empty", "someone/empty: no conversations in it")):
        with pytest.raises(DDTreeError) as refused:
            load_conversations(name)
        assert str(refused.value) == said


def test_an_integer_id_0_reads_as_0_in_every_file_reader(tmp_path):
    """A table's integer id 0 was no id ("row-0", `row.get("id") or ...`) where JSONL kept "0"; only a missing id (or
    null, a table's missing cell) gets a name of its place."""
    rows = [{"id": i, "messages": CONVERSATION[:2]} for i in (0, 1)] + [{"id": None, "messages": CONVERSATION[:2]}]
    jsonl = write_lines(tmp_path / "ints.jsonl", [json.dumps(r) for r in rows])
    Dataset.from_list(rows).to_parquet(str(tmp_path / "ints.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert [r["id"] for r in load_conversations(jsonl)] == ["0", "1", "ints-3"]
    for source in (tmp_path / "ints.parquet", tmp_path / "saved"):
        assert [r["id"] for r in load_conversations(source)] == ["0", "1", "row-2"], source


def test_a_saved_dataset_dict_trains_on_its_train_split_and_one_without_is_refused_naming_its_splits(tmp_path):
    """A DatasetDict of "test" and "validation" trained on its first split, "test", without a word."""
    def split(name, count):
        return Dataset.from_list([{"id": f"{name}{i}", "messages": CONVERSATION} for i in range(count)])

    DatasetDict({"test": split("test", 2), "train": split("train", 3)}).save_to_disk(str(tmp_path / "with"))
    assert [r["id"] for r in load_conversations(tmp_path / "with")] == ["train0", "train1", "train2"]
    DatasetDict({"test": split("test", 2), "validation": split("val", 1)}).save_to_disk(str(tmp_path / "without"))
    with pytest.raises(DDTreeError) as refused:
        load_conversations(tmp_path / "without")
    assert str(refused.value) == (f"{tmp_path / 'without'}: a saved DatasetDict without a 'train' split (its splits: "
                                  "test, validation); save the split to train on as 'train', or on its own "
                                  "(dataset_dict['<split>'].save_to_disk(...))")


def test_an_empty_parquet_file_or_saved_dataset_has_no_conversations_in_it(tmp_path):
    """As an empty JSONL says: `datasets` gave a DatasetGenerationError or an IndexError traceback for them."""
    rows = [{"id": "c0", "messages": CONVERSATION}]
    Dataset.from_list(rows).select([]).to_parquet(str(tmp_path / "empty.parquet"))
    Dataset.from_list(rows).select([]).save_to_disk(str(tmp_path / "empty"))
    for source in (tmp_path / "empty.parquet", tmp_path / "empty"):
        with pytest.raises(DDTreeError) as refused:
            load_conversations(source)
        assert str(refused.value) == f"{source}: no conversations in it"


def test_every_file_reader_keeps_the_ids_a_regeneration_wrote(smol_tokenizer, tmp_path):
    """data/regenerate.py writes response_ids beside the reply's text; the readers used to drop them, so training
    tokenized the text again and supervised the tokenizer's split instead of the ids the target generated."""
    generated = smol_tokenizer("f.read", add_special_tokens=False)["input_ids"] + \
        smol_tokenizer("line()", add_special_tokens=False)["input_ids"]
    text = smol_tokenizer.decode(generated)
    rows = [{"id": "r", "messages": [{"role": "user", "content": "Read a line."},
                                     {"role": "assistant", "content": text}], "finish_reason": "stop",
             "response_ids": generated},
            {"id": "s", "messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}],
             "finish_reason": "stop", "response_ids": None}]  # a row without ids in a table whose other rows have them
    jsonl = write_lines(tmp_path / "r.jsonl", [json.dumps(row) for row in rows])
    Dataset.from_list(rows).to_parquet(str(tmp_path / "r.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for source in (jsonl, tmp_path / "r.parquet", tmp_path / "saved"):
        records = load_conversations(source)
        assert records[0]["response_ids"] == generated and "response_ids" not in records[1], source
        (example, _), _ = tokenize_conversations(smol_tokenizer, records, max_length=500, min_supervised_tokens=1)
        supervised = [i for i, m in zip(example["input_ids"], example["loss_mask"]) if m]
        assert supervised == generated + [smol_tokenizer.convert_tokens_to_ids("<|im_end|>")], source
    for bad, message in (('"12"', "must be a list"), ("[1, -2]", "must hold non-negative"), ("[1.5]", "must hold")):
        line = json.dumps(rows[1]).replace('"response_ids": null', f'"response_ids": {bad}')
        with pytest.raises(DDTreeError, match=rf"bad\.jsonl:1: 'response_ids' {message}"):
            read_messages_jsonl(write_lines(tmp_path / "bad.jsonl", [line]))


def test_every_file_reader_keeps_a_replys_finish_reason_so_one_cut_short_is_not_trained_as_finished(smol_tokenizer,
                                                                                                   tmp_path):
    """A reply that hit max_new_tokens (finish_reason "length", which data/regenerate.py writes) ends where the target
    was stopped: a reader that dropped the field had training supervise the end-of-turn token after it, teaching the
    drafter to close every reply at the length limit."""
    rows = [{"id": "cut", "messages": CONVERSATION[:2], "finish_reason": "length"},
            {"id": "done", "messages": CONVERSATION[:2], "finish_reason": "stop"}]
    jsonl = write_lines(tmp_path / "cut.jsonl", [json.dumps(row) for row in rows])
    Dataset.from_list(rows).to_parquet(str(tmp_path / "cut.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    im_end = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for source in (jsonl, tmp_path / "cut.parquet", tmp_path / "saved"):
        records = load_conversations(source)
        assert [r.get("finish_reason") for r in records] == ["length", "stop"], source
        (cut, done), _ = tokenize_conversations(smol_tokenizer, records, max_length=500, min_supervised_tokens=1)
        assert im_end not in [i for i, m in zip(cut["input_ids"], cut["loss_mask"]) if m], source
        assert im_end in [i for i, m in zip(done["input_ids"], done["loss_mask"]) if m], source


def test_response_ids_that_do_not_decode_to_the_reply_are_skipped_and_counted_naming_file_and_line(smol_tokenizer,
                                                                                                  tmp_path, caplog):
    """One hand-edited reply among 2048 stopped the whole preparation, with an error naming neither the file nor the
    line; a reply from text that the loss mask cannot follow was skipped and counted. Both are now."""
    ok = {"id": "ok", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "fine answer"}]}
    edited = {"id": "a", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
              "response_ids": [88]}  # 88 decodes to another text than "x"
    no_reply = {"id": "b", "messages": [{"role": "user", "content": "hi"}], "response_ids": [87]}
    assert smol_tokenizer.decode([88]) != "x"
    jsonl = write_lines(tmp_path / "ids.jsonl", [json.dumps(row) for row in (ok, edited, no_reply)])
    Dataset.from_list([{**ok, "response_ids": None}, edited, no_reply]).save_to_disk(str(tmp_path / "saved"))
    for source, where in ((jsonl, f"{jsonl}:2"), (tmp_path / "saved", f"{tmp_path / 'saved'} row 1")):
        caplog.clear()
        with caplog.at_level("WARNING"):
            kept, counts = tokenize_conversations(smol_tokenizer, load_conversations(source), 500, 1, str(source))
        assert len(kept) == 1 and counts["unaligned"] == 2 and counts["kept"] == 1, source
        (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warning.startswith(f"{source}: kept 1 of 3 conversations; dropped 2 whose render the loss mask cannot "
                                  f"follow (the first, 'a' ({where}): its response_ids do not decode to its last "
                                  "assistant turn"), warning
    with pytest.raises(DDTreeError, match=re.escape(f"{jsonl}: no conversation could be rendered with its loss mask; "
                                                    f"the first, 'b' ({jsonl}:3): it has response_ids but does not end "
                                                    "with an assistant turn")):
        tokenize_conversations(smol_tokenizer, load_conversations(jsonl)[2:], 500, 1, str(jsonl))


def test_response_ids_past_the_tokenizers_vocabulary_are_skipped_and_counted(smol_tokenizer, tmp_path):
    """An id past the tokenizer's vocabulary (another tokenizer's added token) decodes to nothing, so the reply's
    text matched and the conversation was kept: training then stopped at the target's embedding with an IndexError
    traceback. Such a conversation is now one the loss mask cannot follow."""
    text = "Rivers flow to the sea."
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    foreign = {"id": "f", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}],
               "response_ids": ids[:2] + [len(smol_tokenizer) + 8] + ids[2:]}
    assert smol_tokenizer.decode(foreign["response_ids"], skip_special_tokens=True) == text  # what let it through
    jsonl = write_lines(tmp_path / "foreign.jsonl", [json.dumps(foreign)])
    with pytest.raises(DDTreeError) as refused:
        tokenize_conversations(smol_tokenizer, load_conversations(jsonl), 500, 1, str(jsonl))
    assert str(refused.value) == (
        f"{jsonl}: no conversation could be rendered with its loss mask; the first, 'f' ({jsonl}:1): its response_ids "
        f"hold id {len(smol_tokenizer) + 8}, past the {len(smol_tokenizer)} tokens of the target's tokenizer (ids "
        "another tokenizer wrote?); drop the response_ids field or regenerate the data with this target")


def test_a_reply_with_exactly_min_supervised_tokens_cut_by_max_length_is_counted_as_cut_away_by_truncation(
        smol_tokenizer):
    """A reply at the data.min_supervised_tokens bound is kept whole (the bound is the fewest kept), so where
    max_length cuts it below the bound, truncation dropped it: reply_truncated counts it, and the warning's remedy
    is data.max_length, not data.min_supervised_tokens."""
    (whole,), _ = tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION}], 10_000, 1)
    supervised, last_supervised = sum(whole["loss_mask"]), max(i for i, bit in enumerate(whole["loss_mask"]) if bit)
    with pytest.raises(DDTreeError, match=r"\(1 of them because truncation cut their reply\)"):
        tokenize_conversations(smol_tokenizer, [{"messages": CONVERSATION}], last_supervised, supervised)


@pytest.mark.parametrize("ids", ["12 13", b"\x0c\x0d"])
def test_response_ids_held_as_text_or_bytes_are_one_line_naming_the_row(ids):
    """A table whose response_ids column was written as a string or a binary column iterates to characters or byte
    values, which read as token ids would train the drafter on tokens the target never generated."""
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
             "response_ids": ids}]
    with pytest.raises(DDTreeError, match=rf"data.parquet row 0: 'response_ids' must be a list of token ids, "
                                          rf"got {type(ids).__name__}"):
        rows_to_records(rows, "data.parquet")


# ----------------------------------------------------------------------------- small pieces and edges

def test_a_message_is_read_as_its_role_and_content_alone(tmp_path):
    """Other keys a message carries (a "name", a "weight") are not passed on to the chat template, which might write
    them into the render that training and decoding must share."""
    line = json.dumps({"messages": [{"role": "user", "content": "Hi", "name": "Ann", "weight": 0}]})
    (record,) = read_messages_jsonl(write_lines(tmp_path / "extra.jsonl", [line]))
    assert record["messages"] == [{"role": "user", "content": "Hi"}]


def test_response_ids_holding_token_id_0_are_kept_and_a_negative_id_is_not():
    """Id 0 is a token like any other (SmolLM2's <|endoftext|>); a negative one is no token at all."""
    rows = [{"messages": [{"role": "user", "content": "Hi"}], "response_ids": [0, 12]}]
    assert rows_to_records(rows, "t.parquet")[0]["response_ids"] == [0, 12]
    with pytest.raises(DDTreeError, match=r"t.parquet row 0: 'response_ids' must hold non-negative integer token ids"):
        rows_to_records([dict(rows[0], response_ids=[3, -1])], "t.parquet")


def test_an_empty_reply_generated_as_no_ids_trains_its_end_of_turn_alone(smol_tokenizer, tmp_path):
    """A target that ended its reply at once wrote response_ids []: still regenerated data, whose last reply alone is
    the target's; read as a row without ids, its earlier reply (the user's text) was supervised as well."""
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "Say nothing."}]
    row = {"id": "e", "messages": history + [{"role": "assistant", "content": ""}], "response_ids": []}
    (record,) = read_messages_jsonl(write_lines(tmp_path / "empty.jsonl", [json.dumps(row)]))
    assert record["response_ids"] == []
    (example,), _ = tokenize_conversations(smol_tokenizer, [record], max_length=500, min_supervised_tokens=1)
    prompt = decoding_prompt(smol_tokenizer, history)
    assert example["input_ids"] == prompt + [smol_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert example["loss_mask"] == [0] * len(prompt) + [1]


def test_a_response_id_equal_to_the_tokenizers_length_is_past_its_vocabulary(smol_tokenizer):
    """Ids run from 0 to len(tokenizer) - 1: the first id past them is refused as any later one is."""
    text = "Rivers flow."
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    record = {"id": "f", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}],
              "response_ids": ids + [len(smol_tokenizer)]}
    with pytest.raises(DDTreeError, match=f"hold id {len(smol_tokenizer)}, past the {len(smol_tokenizer)} tokens"):
        tokenize_conversations(smol_tokenizer, [record], 500, 1)


def test_a_replys_leading_space_after_the_think_block_the_target_writes_is_tokenized_with_the_reply(
        qwen3_thinking_tokenizer):
    """The think block is the template's text, tokenized as such; the reply's own leading space belongs to its first
    word ("ĠHello", as the target writes it), not to the end of the think block."""
    tokenizer = qwen3_thinking_tokenizer
    messages = [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": " Hello there."}]
    ids, mask = render_with_loss_mask(tokenizer, messages)
    expected = (tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
                + tokenizer(" Hello there.", add_special_tokens=False)["input_ids"]
                + tokenizer.convert_tokens_to_ids(["<|im_end|>"]))
    assert [i for i, bit in zip(ids, mask) if bit] == expected


def test_an_earlier_reply_rendered_after_a_space_with_its_reasoning_stripped_is_context(smol_folder):
    """A template that writes a space before each reply and drops an earlier reply's reasoning: that reply's kept end
    is found after the space, so it is context, and the conversation is not refused."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_THINKING_TEMPLATE.replace("'<|im_start|>assistant\\n' + content",
                                                              "'<|im_start|>assistant\\n ' + content")
    messages = [{"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n2+2 is 4."},
                {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}]
    ids, mask = render_with_loss_mask(tokenizer, messages)
    assert "<|im_start|>assistant\n 2+2 is 4.<|im_end|>" in tokenizer.decode(ids)
    assert masked_runs(tokenizer, ids, mask) == ["<think>\n\n</think>\n\n6.<|im_end|>"]


def test_common_ending_counts_the_characters_alike_at_the_end():
    """common_ending(text, end, prompt): how many characters text[:end] and prompt end alike, at most the shorter."""
    assert common_ending("xx[/INST] a", 9, "y [/INST]") == 7  # "[/INST]"; then "x" against " "
    assert common_ending("[/INST]", 7, "[/INST]") == 7  # the whole prompt
    assert common_ending("ST]", 3, "[INST]") == 3  # all of text[:end], shorter than the prompt
    assert common_ending("ab]", 3, "ab]c") == 0


def test_prompt_end_is_the_last_place_ending_most_alike_from_the_turns_start_and_none_where_none_does():
    # "]" ends the text at 3 and at 6, alike with the prompt's one "]" each: the last of them, up to the reply's start
    assert prompt_end("ab]  ]R", "x]", 0, 6) == 6
    assert prompt_end("ab]  ]R", "x]", 0, 5) == 3
    assert prompt_end("Q]R", "Q]", 2, 2) == 2  # the turn's start itself is a place
    assert prompt_end("abc", "xyz", 0, 3) is None


def test_assistant_header_is_what_the_template_writes_before_a_reply_in_the_history(smol_tokenizer,
                                                                                     qwen3_thinking_tokenizer,
                                                                                     smol_folder):
    assert assistant_header(smol_tokenizer) == "<|im_start|>assistant\n"
    assert assistant_header(qwen3_thinking_tokenizer) == "<|im_start|>assistant\n"  # no think block in the history
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    # a template that closes the conversation with a count: a one-turn render's ending is nowhere in a longer one
    tokenizer.chat_template = ("{% for m in messages %}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ "
                               "'<|im_end|>\\n' }}{% endfor %}{{ messages | length ~ ' turns' }}")
    assert assistant_header(tokenizer) == ""


def test_the_end_of_turn_token_is_the_longest_special_token_the_template_closes_a_turn_with(smol_folder):
    """A shorter special token that the end-of-turn token starts with ("<|im") is not the end of turn."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.add_tokens(["<|im"], special_tokens=True)
    assert end_of_turn_text(tokenizer) == "<|im_end|>"


def test_an_earlier_reply_found_after_a_header_is_supervised_from_its_content_on(smol_folder):
    """Where no shorter render is a prefix, a reply's turn is placed by the assistant header, and the template's text
    between it and the reply (a think block) is not supervised: only whitespace there joins the reply."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = "{{ '<|im_start|>system\\n' ~ messages | length ~ ' turns<|im_end|>\\n' }}" + \
        QWEN3_THINKING_TEMPLATE
    messages = [{"role": "user", "content": "Look it up."}, {"role": "assistant", "content": "Looking."},
                {"role": "tool", "content": "42"}]
    ids, mask = render_with_loss_mask(tokenizer, messages)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nLooking.<|im_end|>" in tokenizer.decode(ids)
    assert masked_runs(tokenizer, ids, mask) == ["Looking.<|im_end|>"]


def test_special_tokens_the_template_writes_after_decodings_prompt_are_supervised_as_special_tokens(smol_folder):
    """A template whose target opens its reply with special tokens (a channel, as gpt-oss's harmony format does):
    the target writes them as tokens, so they are supervised as those tokens, not spelled out as text."""
    tokenizer = AutoTokenizer.from_pretrained(smol_folder)
    tokenizer.add_tokens(["<|channel|>", "<|message|>"], special_tokens=True)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ '<|im_start|>assistant<|channel|>final<|message|>' ~ m['content'] ~ '<|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant' }}{% endif %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    ids, mask = render_with_loss_mask(tokenizer, messages)
    channel, message, im_end = tokenizer.convert_tokens_to_ids(["<|channel|>", "<|message|>", "<|im_end|>"])
    final = tokenizer("final", add_special_tokens=False)["input_ids"]
    reply = tokenizer("Hello.", add_special_tokens=False)["input_ids"]
    assert [i for i, bit in zip(ids, mask) if bit] == [channel, *final, message, *reply, im_end]


def test_a_tokenizer_that_adds_a_bos_itself_adds_none_to_the_pieces_of_a_render(smol_folder):
    """Llama-2's and Mistral's tokenizers put <s> in front of what they tokenize, and their templates write it into
    the text too: each piece of the render (prompt, reply, end of turn) is tokenized without one of its own."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = s_tokens_tokenizer(smol_folder, LLAMA2_TEMPLATE)
    bos = tokenizer.convert_tokens_to_ids("<s>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert tokenizer("Hi")["input_ids"][0] == bos
    text = "<s>[INST] What is 2+2? [/INST] 2+2 is 4. </s><s>[INST] And the assistant says? [/INST] assistant </s>"
    ids, mask = render_with_loss_mask(tokenizer, CONVERSATION)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"] and ids.count(bos) == 2
    (cut,), _ = tokenize_conversations(tokenizer, [{"messages": CONVERSATION[:2], "finish_reason": "length"}],
                                       max_length=500, min_supervised_tokens=1)  # the reply's own text, as well
    assert [i for i, bit in zip(cut["input_ids"], cut["loss_mask"]) if bit] == \
        tokenizer("2+2 is 4.", add_special_tokens=False)["input_ids"]


def test_response_ids_holding_one_number_are_one_line_naming_the_line(tmp_path):
    """A single id where a list belongs ("response_ids": 12) was a TypeError traceback naming neither file nor line."""
    line = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "response_ids": 12})
    path = write_lines(tmp_path / "one.jsonl", [line])
    with pytest.raises(DDTreeError, match=r"one\.jsonl:1: 'response_ids' must be a list of token ids, got int$"):
        read_messages_jsonl(path)
