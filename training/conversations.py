"""Conversations: read them from files, render them with the chat template, mask the loss to the assistant.

    records = load_conversations("data/smollm2-135m")       # [{"id", "messages", "where", "finish_reason"?}, ...]
    examples, counts = tokenize_conversations(tokenizer, records, max_length=2048, min_supervised_tokens=16)
    examples[0]["input_ids"], examples[0]["loss_mask"]       # lists of ints, the same length

This module owns everything between a conversation file and lists of token ids: no tensors, no
Lightning, no feature store, so data/regenerate.py reads prompts and renders them with the very
functions training uses without loading the training stack. Tensors, batches, the tokenized cache
and the DataModule are training/data.py.

Pieces, top to bottom:
  - read_messages_jsonl / load_conversations: JSONL or Parquet files, saved `datasets` folders or
    Hub names -> a list of {"id", "messages", "where"} records (where: "file:line" or "source row i"), with
    errors naming the file and line.
  - render_with_loss_mask: render with the tokenizer's chat template; loss_mask = 1 on what the target
    writes in each assistant turn: from the end of the prompt decoding feeds it (the role header and what
    comes before are not) up to and including the end-of-turn token (not what the template adds after it).
    Spans are found by rendering growing prefixes of the conversation (the prompt up to each assistant
    turn, with the generation prompt) and diffing against the full render; the render is then tokenized
    span by span.
  - render_generated / render_unfinished: a last reply from the ids its target generated, or one cut short
    (finish_reason "length") from its text: the prompt decoding feeds the target, then that reply's tokens.
    Regenerated data trains that last reply alone (its earlier turns are the user's text); text data every one.
  - tokenize_conversations: many conversations, with counts of what was dropped, skipped or cut.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ddtree.bench import chat_prompt_ids, check_chat_template, iter_json_lines
from ddtree.errors import DDTreeError, check_text
from ddtree.files import not_a_file
from ddtree.targets import has_hub_id_shape, is_int

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
# The files of conversations training reads by their suffix (any case): JSONL (a .json of JSON lines too), Parquet
JSONL_SUFFIXES = (".jsonl", ".json")
DATA_FILE_SUFFIXES = (*JSONL_SUFFIXES, ".parquet")


# ----------------------------------------------------------------------------- reading files

def check_messages(messages, where: str) -> list[dict]:
    """Raise a DDTreeError naming `where` unless messages is a non-empty list of {role, content: str}, the content
    valid UTF-8 (check_text: JSON's "\\ud83d", UTF-16 text cut mid-pair, reads as a lone surrogate, which the
    tokenizer refuses with a TypeError naming neither the file nor the line)."""
    if not isinstance(messages, list) or not messages:
        raise DDTreeError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DDTreeError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        if message["role"] not in ROLES:
            raise DDTreeError(f"{where}: messages[{i}].role is {message['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DDTreeError(f"{where}: messages[{i}].content must be a string, got {type(message['content']).__name__}")
        check_text(message["content"], f"{where}: messages[{i}].content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def finish_reason_of(row) -> dict:
    """{"finish_reason": ...} when the row says why its last answer ended (regenerated data does)."""
    reason = row.get("finish_reason")
    return {"finish_reason": reason} if reason else {}


def response_ids_of(row, where: str) -> dict:
    """{"response_ids": [...]} when the row carries the ids its target generated (data/regenerate.py writes them;
    training supervises exactly those, render_generated), else {}. A table whose other rows have them reads None."""
    ids = row.get("response_ids")
    if ids is None:
        return {}
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise DDTreeError(f"{where}: 'response_ids' must be a list of token ids, got {type(ids).__name__}")
    ids = list(ids)
    if not all(is_int(i) and i >= 0 for i in ids):
        raise DDTreeError(f"{where}: 'response_ids' must hold non-negative integer token ids; drop the field or "
                          "regenerate the data")
    return {"response_ids": ids}


def read_messages_jsonl(path: str | Path) -> list[dict]:
    """Read a JSONL file of {"id"?, "messages": [...]} records (prompts or whole conversations).

    Records without an id (or with "id": null) get "<file stem>-<line number>"; "where" is "<file>:<line>", for what
    later finds fault with the record (tokenize_conversations). Errors name the file and line.
    """
    path = Path(path)
    problem = not_a_file(path)
    if problem:
        raise DDTreeError(f"{path}: {problem}; give a JSONL file of {{\"id\", \"messages\"}} records")
    records, seen_ids = [], {}  # id -> where it was first
    for line_number, where, record in iter_json_lines(path):
        if not isinstance(record, dict) or "messages" not in record:
            raise DDTreeError(f"{where}: each line must be an object with a 'messages' list")
        messages = check_messages(record["messages"], where)
        # "id": null is no id, as in a Parquet table (not "None", which the next null id repeated); valid UTF-8 too:
        # regenerate.py hashes the id into the prompt's seed and writes it into its dataset
        given = record.get("id")
        record_id = check_text(str(given) if given is not None else f"{path.stem}-{line_number}", f"{where}: id")
        if record_id in seen_ids:  # (one of the two may be a line without an id, named after its file and line)
            unnamed = "" if given is not None else " (its line has no id)"
            raise DDTreeError(f"{where}: duplicate id {record_id!r}{unnamed}, as at {seen_ids[record_id]}; ids must be "
                              "unique: give the line an id of its own")
        seen_ids[record_id] = where if given is not None else f"{where} (a line without an id, named so)"
        records.append({"id": record_id, "messages": messages, "where": where, **finish_reason_of(record),
                        **response_ids_of(record, where)})
    if not records:
        raise DDTreeError(f"{path}: the file is empty; it needs one JSON object per line")
    return records


def rows_to_records(rows, source: str) -> list[dict]:
    """Validate rows of a datasets/Parquet table ({"messages", "id"?}) into records."""
    records = []
    for i, row in enumerate(rows):
        if "messages" not in row:
            raise DDTreeError(f"{source}: row {i} has no 'messages' column (columns: {', '.join(row)})")
        where = f"{source} row {i}"
        messages = check_messages(row["messages"], where)
        given = row.get("id")  # an integer 0 is an id, as in JSONL: only a missing one (None) is not
        records.append({"id": str(given) if given is not None else f"row-{i}", "messages": messages, "where": where,
                        **finish_reason_of(row), **response_ids_of(row, where)})
    return records


def load_conversations(source: str | Path, messages_only: bool = False) -> list[dict]:
    """Load {"id", "messages"} records from a JSONL/Parquet file, a saved `datasets` folder or a Hub name (a
    DatasetDict's, and a Hub dataset's, "train" split; a DatasetDict without one is refused, naming its splits).

    Prompt files load too (no assistant turn): tokenizing them then says that responses are
    missing. Hub names need internet; everything else is local. messages_only: a table's other columns
    (the response_ids regenerated data carries) are not read, ten times faster where only the text is wanted.
    """
    path = Path(source)

    def table_records(table, where: str) -> list[dict]:
        if messages_only and "messages" in table.column_names:
            table = table.select_columns([name for name in ("id", "messages") if name in table.column_names])
        return rows_to_records(table, where)

    if path.is_file():
        suffix = path.suffix.lower()  # DATA.JSONL is a JSONL file (it was "unknown file type '.JSONL'")
        if suffix in JSONL_SUFFIXES:
            records = read_messages_jsonl(path)
        elif suffix == ".parquet":
            import pyarrow.parquet as pq
            from datasets import Dataset

            if pq.read_metadata(path).num_rows == 0:  # datasets cannot build a table of no rows: one line, as below
                raise DDTreeError(f"{source}: no conversations in it")
            records = table_records(Dataset.from_parquet(str(path)), str(path))
        else:
            raise DDTreeError(f"{path}: unknown file type {path.suffix!r}; give a .jsonl or .parquet file or a saved datasets folder")
    elif path.is_dir():
        from datasets import DatasetDict, load_from_disk

        if not ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
            # (a folder of JSONL or Parquet files was told only what it is not)
            raise DDTreeError(f"{path}: not a saved `datasets` folder (no state.json or dataset_dict.json); give one "
                              ".jsonl or .parquet file (the files of a folder joined into one) or a folder saved "
                              "with datasets' save_to_disk")
        state = path / "state.json"
        if state.exists() and not json.loads(state.read_text()).get("_data_files"):
            raise DDTreeError(f"{source}: no conversations in it")  # a dataset of no rows: load_from_disk's IndexError
        loaded = load_from_disk(str(path))
        if isinstance(loaded, DatasetDict):  # trained on its "train" split, as a Hub name is (split="train")
            if "train" not in loaded:
                raise DDTreeError(f"{path}: a saved DatasetDict without a 'train' split (its splits: "
                                  f"{', '.join(loaded)}); save the split to train on as 'train', or on its own "
                                  "(dataset_dict['<split>'].save_to_disk(...))")
            loaded = loaded["train"]
        records = table_records(loaded, str(path))
    elif has_hub_id_shape(str(source)):
        from datasets import load_dataset

        try:
            records = table_records(load_dataset(str(source), split="train"), str(source))
        except DDTreeError:
            raise
        except Exception as error:  # network, auth or format problems all end up here
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise DDTreeError(f"could not load Hub dataset {source!r}: {first_line}; without internet give a local file") from error
    else:
        raise DDTreeError(f"{source}: no such file or folder (and not a Hub dataset name owner/name)")
    if not records:
        raise DDTreeError(f"{source}: no conversations in it")
    return records


# ----------------------------------------------------------------------------- chat template + loss mask

# Bump when render_with_loss_mask changes, to invalidate cached tokenizations. Not bumped for leading whitespace
# kept in the reply (none of the 2048 shipped replies has any, so their tokenization and feature stores are the same).
# 3: the file readers keep response_ids, so regenerated data is tokenized from the ids its target generated (version
# 2 read it from the reply's text: 275 of the 2048 shipped replies re-tokenize to another length).
# Not bumped either for special-token text inside a text-only reply, now tokenized as plain text: all 2048 shipped
# conversations render to the same ids (checked one by one), and a bump would rebuild every feature store.
# 4: the masks of four fixes made under version 3 (an opening assistant turn, a Llama-3 trimmed reply found in a later
# user turn, Qwen3's think block, an unfinished Llama-2 reply's space before eos) and the special-token text above, each
# left unbumped since the shipped data renders the same: data tokenized before them kept its wrong mask (or ids), and
# with it the draft vocabulary and model.corpus. A feature store keyed by an earlier version still serves where that
# version's cached tokenization holds the same input ids (DistillDataModule.tokenization_keys), so the shipped data's
# stores are not rebuilt.
# Bump it for every change to what this module or render_generated makes of a conversation, whatever the shipped data.
# 5: an earlier reply the template renders only the end of (Qwen3 drops its reasoning) is not supervised, and a reply
# cut short (finish_reason "length") is decoding's prompt then its own tokens (render_unfinished), not the template's
# render (Qwen3's empty think block in front of a reply cut inside its thinking); the shipped data is the same.
# 6: regenerated data (response_ids or a finish_reason) supervises its last reply only, whichever render: a row without
# its ids supervised its earlier replies too, the user's text; the shipped data is single-turn, its masks the same.
# 7: a last reply that a template renders after other text than decoding's prompt (Mistral-7B-Instruct-v0.3's system
# prompt, in the last user turn only) is trained after that prompt, its space joined to its first token, the earlier
# replies context only (it was the render, without the system prompt, and "Ġ" + "Une"); the shipped data is the same.
# 8: response_ids past the tokenizer's vocabulary (another tokenizer's) are refused as unaligned: they decoded to the
# reply's text all the same (decode drops them), and a cache holding them stopped every training at the embedding.
TOKENIZATION_VERSION = 8


# What to give instead of a target whose tokenizer has no chat template (a base model's) or whose template refuses a
# conversation: the words after check_chat_template's and chat_prompt_ids' one line, in training and data/regenerate.py.
CHAT_TARGET = "give a chat (instruct) model as the target: training renders every conversation with its chat template"


def end_of_turn_text(tokenizer) -> str:
    """The special token the chat template writes right after an assistant's content.

    Found by rendering a probe conversation: SmolLM2 and Qwen3 close a turn with "<|im_end|>\\n",
    Llama-3 with "<|eot_id|>", Llama-2-chat with " </s>". Whitespace before the token belongs to the reply
    (render_with_loss_mask supervises it as the template renders it), the token is supervised (the model stops
    there), and what the template writes after it is not (it is never generated).
    """
    check_chat_template(tokenizer, tokenizer.name_or_path, CHAT_TARGET)
    probe = "PROBE-ANSWER-7f3a"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "probe"}, {"role": "assistant", "content": probe}], tokenize=False
    )
    suffix = text[text.rindex(probe) + len(probe):]
    special = sorted(
        (t for t in tokenizer.all_special_tokens + list(tokenizer.get_added_vocab())
         if t and suffix.lstrip().startswith(t)),
        key=len, reverse=True,
    )
    if not special:
        raise DDTreeError(
            f"the chat template of {tokenizer.name_or_path!r} ends an assistant turn with {suffix[:30]!r}, "
            "not with a special token; the loss mask needs an end-of-turn token"
        )
    return special[0]


def assistant_header(tokenizer) -> str:
    """What the chat template writes before an assistant reply in a conversation's history ("<|im_start|>assistant\\n"
    in ChatML; no Qwen3 think block, which only the last turn gets), found by rendering a probe; "" if it cannot be."""
    question, reply = {"role": "user", "content": "PROBE-QUESTION-7f3a"}, "PROBE-ANSWER-7f3a"
    try:
        before = tokenizer.apply_chat_template([question], tokenize=False)
        whole = tokenizer.apply_chat_template([question, {"role": "assistant", "content": reply}, question], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: no header to anchor on
        return ""
    # Between the question's turn, closed as a one-turn render closes it, and the reply; not by comparing the two
    # renders' beginnings, which a template that writes something of the whole conversation first makes differ.
    if question["content"] not in before:
        return ""
    closed = question["content"] + before[before.index(question["content"]) + len(question["content"]):]
    opened = whole.find(closed) + len(closed)
    if opened < len(closed) or reply not in whole[opened:]:
        return ""
    return whole[opened:whole.index(reply, opened)]


def find_reply(text: str, content: str, eot: str, turn_from: int) -> tuple[int, int, bool] | None:
    """(where the reply's text starts, where its end-of-turn token starts, whether the render holds the whole reply)
    in a render, for the assistant turn that begins at turn_from; None where the render holds no such reply.

    The reply is the message content as it ends right before an end-of-turn token, with only whitespace between
    (Llama-2-chat's ' ' before eos): as written, trimmed (Llama-3 trims it), or, where the template keeps only its
    end (Qwen3 drops an earlier reply's <think> reasoning from the history), the turn's text if the content ends
    with it: not the whole reply. It must begin before the first end-of-turn token after turn_from, so it is never
    found in a later turn (a user's "... a plain Yes."), nor in the template's own text before it (Qwen3's
    "<think>\n\n</think>" holds "in"); it can hold that token's text itself (a reply about chat templates).
    """
    written = content.rstrip()
    candidates = [written, written.lstrip()]  # with its leading whitespace first: ChatML keeps it, the target wrote it
    first_eot = eot_at = text.find(eot, turn_from)
    while eot_at >= 0:
        reply_end = turn_from + len(text[turn_from:eot_at].rstrip())
        if reply_end - len(candidates[1]) > first_eot:  # it could only begin in a later turn
            break
        for candidate in candidates:
            begins = reply_end - len(candidate)
            if turn_from <= begins <= first_eot and text.startswith(candidate, begins):
                return begins, eot_at, True
        eot_at = text.find(eot, eot_at + len(eot))
    kept = text[turn_from:first_eot].strip() if first_eot >= 0 else None
    if kept is not None and written.endswith(kept):
        return first_eot - len(text[turn_from:first_eot].lstrip()), first_eot, False
    return None


# The chat templates render_with_loss_mask has warned of rendering the turns before a last reply otherwise than
# decoding's prompt: once a template (in a process), not once a conversation.
OTHER_CONTEXT_WARNED: set[str] = set()


def common_ending(text: str, end: int, prompt: str) -> int:
    """How many characters text[:end] ends with alike with prompt."""
    n = 0
    while n < min(end, len(prompt)) and text[end - 1 - n] == prompt[-1 - n]:
        n += 1
    return n


def prompt_end(text: str, prompt: str, turn_start: int, reply_at: int) -> int | None:
    """Where, between a turn's start and its reply, the render ends as decoding's prompt ends ("...[/INST]"), found
    by the longest common ending (the last such place on a tie); None where no place ends alike. What follows it is
    what the target writes after that prompt (Llama-2's space before the reply, Qwen3's think block)."""
    end = max(range(reply_at, turn_start - 1, -1), key=lambda j: common_ending(text, j, prompt))
    return end if common_ending(text, end, prompt) else None


def render_with_loss_mask(tokenizer, messages: list[dict], eot: str | None = None,
                          last_only: bool = False) -> tuple[list[int], list[int]]:
    """Chat-template token ids of a whole conversation and the 0/1 mask of assistant tokens (untruncated); with
    last_only, of the last message's reply alone, the earlier ones being context (regenerated data, where only the
    last reply is the target's).

    For assistant turn i the render of messages[:i] with the generation prompt, the prompt decoding feeds the
    target, is a prefix of the full render: everything from its end to the turn's end-of-turn token, included, is
    what the target writes, and is supervised (Qwen3's "<think>\n\n</think>\n\n" before the reply as well), and
    find_reply places that token. Where that render is refused or is no prefix (a template that writes something
    of the whole conversation first), the turn starts after the next assistant header instead, and is supervised
    from its content on, or from where the render ends as that prompt does if only whitespace follows (the space
    Mistral-v0.3's target writes before a reply, which its header " " does not place). Where it is no prefix for the
    last reply (Mistral-7B-Instruct-v0.3 writes the system prompt into the last user turn only, so a render ending
    with the reply has none), the sequence is decoding's prompt and what the target writes after it (as
    render_generated's), the earlier replies context only, with one warning a template. A turn the template renders
    only the end of (Qwen3 drops an earlier reply's reasoning) is not supervised at all: after decoding's prompt the
    target wrote its "<think>", not the answer that follows.
    """
    check_chat_template(tokenizer, tokenizer.name_or_path, CHAT_TARGET)
    eot = eot or end_of_turn_text(tokenizer)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    header = None  # the assistant header, found only where a prefix render cannot place the turn
    spans, cursor = [], 0  # (supervised from, reply text from, end-of-turn token from, turn end) in characters
    last_turn = None  # (its decoding prompt, where the render ends as it does) for a last reply after other text
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        turn_start = cursor
        # An opening assistant turn has no turns before it to render: the template's own beginning (a default
        # system prompt) comes first, so it is found after the assistant header, not from position 0.
        try:
            prefix = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False) if i else None
        except Exception:  # some templates reject a conversation that does not start with a user turn
            prefix = None
        decoding_prompt = prefix is not None and text.startswith(prefix)
        if decoding_prompt:
            turn_from = max(cursor, len(prefix))
        else:  # the render of the turns before is no prefix (or was refused): start after the next assistant header,
            # not at the previous turn's end, where a user turn that ends with this reply's text would be found first
            header = assistant_header(tokenizer) if header is None else header
            at = text.find(header, cursor) if header else -1
            turn_from = at + len(header) if at >= 0 else cursor
        found = find_reply(text, message["content"], eot, turn_from)
        if found is None:
            raise DDTreeError(
                f"assistant turn {i} ({message['content'][:40]!r}...) does not end its turn, right before {eot!r}, "
                "in the chat template's render: the template rewrites this reply in a way the loss mask cannot follow"
            )
        reply_at, eot_at, whole = found
        if not whole or (last_only and i < len(messages) - 1):  # (its text joins the unsupervised text around it,
            # tokenized as decoding's prompts tokenize it; found all the same, so the next turn is searched after it)
            cursor = eot_at + len(eot)
            continue
        # Past the prompt decoding feeds, the template's text is the target's (it writes it after that prompt), and
        # so is whitespace (Llama-2-chat's ' ' after [/INST], written with the reply's first token).
        start = turn_from if decoding_prompt or not text[turn_from:reply_at].strip() else reply_at
        ends_as_prompt = None if decoding_prompt or prefix is None else prompt_end(text, prefix, turn_start, reply_at)
        if ends_as_prompt is not None and not text[ends_as_prompt:reply_at].strip():  # a header found by search
            # (Mistral-v0.3's " ") can be the first of its text anywhere: where the render ends as decoding's prompt
            # does, with only whitespace after it, the turn starts there, and the target's space trains with the reply
            start = ends_as_prompt
        spans.append((start, reply_at, eot_at, eot_at + len(eot)))
        if ends_as_prompt is not None and i == len(messages) - 1:
            last_turn = (prefix, ends_as_prompt)
        cursor = eot_at + len(eot)
    if last_turn is not None:
        # The reply is trained after decoding's prompt itself, from where the render ends as that prompt does.
        prompt, ends_as_prompt = last_turn
        _, reply_at, eot_at, end = spans[-1]
        shift = len(prompt) - ends_as_prompt
        text = prompt + text[ends_as_prompt:end]
        spans = [(len(prompt), reply_at + shift, eot_at + shift, end + shift)]
        if str(tokenizer.chat_template) not in OTHER_CONTEXT_WARNED:
            OTHER_CONTEXT_WARNED.add(str(tokenizer.chat_template))
            log.warning("the chat template of %r renders the turns before a conversation's last reply otherwise "
                        "than the prompt decoding feeds the target (a system prompt written into the last user "
                        "turn only, as Mistral-7B-Instruct-v0.3's is): that reply is trained after decoding's "
                        "prompt, and the replies before it as context only; for each reply to train, give it a "
                        "conversation of its own, ending with it", tokenizer.name_or_path)
    # Tokenize piece by piece (unsupervised text, supervised reply, its end-of-turn token, ...): the prompt part then
    # has exactly the ids decoding feeds the target, and the answer the ids of its own text, with no BPE merge across
    # the boundary (which tokenizing the whole render at once can produce). In the reply, text that reads like a
    # special token ("<|im_end|>" in a reply about chat templates) is plain text: the target can only have written it
    # as such, since its special token would have ended the turn (split_special_tokens). The template's own text
    # before the reply (Qwen3's think block) is tokenized as the template's; whitespace alone joins the reply.
    input_ids, loss_mask, cursor = [], [], 0
    for start, reply_at, eot_at, end in spans + [(len(text),) * 4]:
        if not text[start:reply_at].strip():
            reply_at = start
        for piece, bit, literal in ((text[cursor:start], 0, False), (text[start:reply_at], 1, False),
                                    (text[reply_at:eot_at], 1, True), (text[eot_at:end], 1, False)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False, split_special_tokens=literal)["input_ids"]
                input_ids += piece_ids
                loss_mask += [bit] * len(piece_ids)
        cursor = end
    return input_ids, loss_mask


def render_generated(tokenizer, record: dict, eot: str) -> tuple[list[int], list[int]]:
    """A regenerated conversation from the ids its target generated (data/regenerate.py records them as
    response_ids): the prompt as decoding renders it (chat_prompt_ids), then exactly those ids and the end-of-turn
    token, which alone are supervised. Tokenizing the reply's text again gives the tokenizer's own split wherever the
    target chose another (`read` `line` against `readline`), and the drafter would learn tokens the target never
    emits."""
    messages, reply = record["messages"], list(record["response_ids"])
    if not messages or messages[-1]["role"] != "assistant":
        raise DDTreeError("it has response_ids but does not end with an assistant turn for them to answer; drop the "
                          "field, or regenerate the data")
    past = [i for i in reply if i >= len(tokenizer)]  # decode drops them without a word: the reply's text matched,
    # and the target's embedding lookup stopped training with an IndexError traceback
    if past:
        raise DDTreeError(f"its response_ids hold id {past[0]}, past the {len(tokenizer)} tokens of the target's "
                          "tokenizer (ids another tokenizer wrote?); drop the response_ids field or regenerate the "
                          "data with this target")
    if tokenizer.decode(reply, skip_special_tokens=True) != messages[-1]["content"]:
        raise DDTreeError("its response_ids do not decode to its last assistant turn (edited text?); drop the "
                          "response_ids field or regenerate it")
    prompt = chat_prompt_ids(tokenizer, messages[:-1], tokenizer.name_or_path, CHAT_TARGET)
    reply += tokenizer.convert_tokens_to_ids([eot])
    return prompt + reply, [0] * len(prompt) + [1] * len(reply)


def render_unfinished(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """A conversation whose last reply the target did not finish (finish_reason "length": it hit max_new_tokens),
    from its text: the prompt as decoding renders it (chat_prompt_ids), unsupervised as render_generated's (in
    regenerated data the earlier replies are the user's text, not the target's), then the tokens of the reply's own
    text, all supervised, and no end-of-turn token, which the target never chose. As render_generated, not the
    template's render of the whole: a template writes what it expects before a finished reply, and a reply cut short
    is not one (Qwen3 puts an empty think block in front of a reply cut inside its own "<think>"), nor are the spaces
    a template writes around a reply (Llama-2-chat's ' ' after [/INST] and before eos) the target's."""
    if not messages or messages[-1]["role"] != "assistant":
        raise DDTreeError("its finish_reason is 'length' but it does not end with an assistant turn, the reply cut "
                          "short; drop the field, or regenerate the data")
    prompt = chat_prompt_ids(tokenizer, messages[:-1], tokenizer.name_or_path, CHAT_TARGET)
    # The reply's text as the reply pieces of render_with_loss_mask: special-token text in it is plain text.
    reply = tokenizer(messages[-1]["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return prompt + reply, [0] * len(prompt) + [1] * len(reply)


def tokenize_conversations(tokenizer, records: list[dict], max_length: int, min_supervised_tokens: int,
                           source: str = "the data") -> tuple[list[dict], dict]:
    """Tokenize many conversations; skip (and count) those without enough supervised tokens.

    A record with finish_reason "length" has a last answer that the target did not finish (it
    hit max_new_tokens): the end-of-turn token the template writes after it was never the
    target's choice, so that token and everything after it are cut instead of supervised.
    A record with response_ids (regenerated data) supervises exactly those ids (render_generated);
    one without is rendered from its text (render_with_loss_mask; a last answer cut short, render_unfinished).
    Text data trains every assistant turn; regenerated data (a record with response_ids or a finish_reason, which
    data/regenerate.py writes on every row) the target's last reply only, the earlier turns, the user's own text,
    being context, whichever of the three renders it. One
    the loss mask cannot follow (the template rewrote a reply, or its response_ids do not decode to its reply: an
    edited text, or a "length" record without an assistant turn last) is skipped and counted as
    "unaligned"; if every one is, the template or the data as a whole is the problem, and the first one's error is
    raised. What was dropped or cut is one warning, with the counts by reason and the first unaligned one (its id,
    file and line or row): a run shows warnings only, and a long prompt's reply cut away by max_length went unsaid.
    """
    eot = end_of_turn_text(tokenizer)
    # reply_truncated: of too_few_supervised, those that had enough before max_length cut them (truncation keeps the
    # beginning, so a prompt longer than max_length loses its reply)
    kept, counts = [], {"conversations": len(records), "no_assistant": 0, "unaligned": 0, "too_few_supervised": 0,
                        "reply_truncated": 0, "truncated": 0}
    first_unaligned = None  # (the record's id and where it is, its error)
    cut_kept = 0  # kept, shortened to max_length
    for record in records:
        try:
            if record.get("response_ids") is not None:
                input_ids, loss_mask = render_generated(tokenizer, record, eot)
            elif record.get("finish_reason") == "length":
                input_ids, loss_mask = render_unfinished(tokenizer, record["messages"])
            else:  # a finish_reason ("stop") without ids: regenerated all the same, its last reply alone trained
                input_ids, loss_mask = render_with_loss_mask(tokenizer, record["messages"], eot,
                                                             last_only=bool(record.get("finish_reason")))
        except DDTreeError as error:  # one odd reply (or one edited by hand) should not stop all the others
            counts["unaligned"] += 1
            named = repr(record.get("id")) + (f" ({record['where']})" if record.get("where") else "")
            first_unaligned = first_unaligned or (named, error)
            continue
        if not any(loss_mask):
            counts["no_assistant"] += 1
            continue
        if record.get("finish_reason") == "length" and record.get("response_ids") is not None:
            input_ids, loss_mask = input_ids[:-1], loss_mask[:-1]  # the end-of-turn token render_generated appends
        enough_whole, cut = sum(loss_mask) >= min_supervised_tokens, len(input_ids) > max_length
        if cut:
            counts["truncated"] += 1
            input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if sum(loss_mask) < min_supervised_tokens:
            counts["too_few_supervised"] += 1
            counts["reply_truncated"] += enough_whole
            continue
        cut_kept += cut
        kept.append({"input_ids": input_ids, "loss_mask": loss_mask})
    counts["kept"] = len(kept)
    log.info("tokenized %s: %s", source, counts)
    if first_unaligned and counts["unaligned"] == len(records):
        named, error = first_unaligned
        raise DDTreeError(f"{source}: no conversation could be rendered with its loss mask; the first, "
                          f"{named}: {error}") from None
    too_few = (f"fewer than {min_supervised_tokens} supervised tokens within max_length {max_length}"
               + (f" ({counts['reply_truncated']} of them because truncation cut their reply)"
                  if counts["reply_truncated"] else ""))
    if not kept:
        hint = (" (no assistant turns at all: this looks like a prompt file; generate responses with "
                "data/regenerate.py first)") if counts["no_assistant"] == len(records) else ""
        # what would keep some, as the warning says it when some are kept: the error named neither setting
        settings = [name for name, count in (("raise data.max_length", counts["reply_truncated"]),
                                             ("lower data.min_supervised_tokens", counts["too_few_supervised"]))
                    if count]
        hint += f"; {' or '.join(settings)} to keep them" if settings else ""
        raise DDTreeError(
            f"{source}: none of {len(records)} conversations is usable: {counts['no_assistant']} have no assistant "
            f"tokens, {counts['unaligned']} a render the loss mask cannot follow, {counts['too_few_supervised']} "
            f"{too_few}{hint}"
        )
    reasons = [f"{counts['no_assistant']} with no assistant turn" if counts["no_assistant"] else "",
               f"{counts['too_few_supervised']} with {too_few}" if counts["too_few_supervised"] else "",
               f"{counts['unaligned']} whose render the loss mask cannot follow (the first, {first_unaligned[0]}: "
               f"{first_unaligned[1]})" if first_unaligned else ""]
    if any(reasons) or cut_kept:
        settings = [name for name, count in (("raise data.max_length", counts["truncated"]),
                                             ("lower data.min_supervised_tokens", counts["too_few_supervised"]))
                    if count]
        log.warning("%s: kept %d of %d conversations%s%s%s", source, len(kept), len(records),
                    "; dropped " + ", ".join(reason for reason in reasons if reason) if any(reasons) else "",
                    f"; {cut_kept} kept were cut to max_length {max_length}" if cut_kept else "",
                    f"; {' or '.join(settings)} to keep more" if settings else "")
    return kept, counts
