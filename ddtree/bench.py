"""Benchmark runner behind `ddtree bench` (and the training-time evaluation, which calls it as is).

    prompts = load_prompts("data/eval_prompts.jsonl", tokenizer)
    results = run_benchmark(target, drafter, prompts, methods=["ar", "ddtree"], budgets=[32],
                            max_new_tokens=128, stop_ids=[2])
    print(format_summary(results["summary"]))
    acceptance_summary(results["prompts"], tree_key(32))   # tau etc. over any subset of the rows

Method keys, the same in results.json, the training-time evaluation and every report: "ar", CHAIN
("dflash", the single chain) and tree_key(B) ("ddtree@B"); format and parse them only through
CHAIN, tree_key and budget_of. A summary is always computed from the per-prompt rows, so the
evaluation of a training run (which gathers rows from every rank) and `ddtree bench` agree exactly.

Prompts file: one JSON object per line, {"prompt": "..."} (raw text, tokenized as is) or
{"messages": [{"role": ..., "content": ...}]} (the target's chat template with the generation
prompt, after trailing assistant turns are cut: prompt_messages); optional "id" (default, and for null: the line
number), each prompt's its own.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .calibration import learning_from
from .decoding import (
    METHODS, DrafterRunner, OnlineCalibration, Sampling, check_corpus, check_drafter_runner, check_lookup, check_redraft,
    check_sizer, context_limit, drafter_defaults, generate, prompt_token_ids, static_cache,
)
from .corpus import CorpusLookup
from .errors import DDTreeError, check_text
from .files import iter_json_lines
from .inputs import check_prompts_file, prompt_messages
from .sizing import TreeSizer


def read_prompts(path: str | Path, limit: int | None = None) -> list[tuple[str, str, dict]]:
    """The first `limit` prompts of a file (or all), checked but not tokenized: [(id, where, record)], where names
    the file and line; "messages" end where prompt_messages cuts them (said once on stderr). The CLI reads them before
    the target loads, so a wrong file costs no load."""
    path = check_prompts_file(path)
    if limit is not None and limit < 1:
        raise DDTreeError(f"limit {limit} must be at least 1, or None for every prompt")
    prompts, lines = [], {}  # lines: the line of each id so far
    answered = 0  # prompts that ended with an assistant turn
    for number, where, record in iter_json_lines(path):
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise DDTreeError(f'{where}: expected an object with exactly one of "prompt" or "messages"')
        if "prompt" in record and not isinstance(record["prompt"], str):
            raise DDTreeError(f'{where}: "prompt" must be a string')
        if record.get("prompt") == "":  # else refused by tokenize_prompts, once the target had loaded
            raise DDTreeError(f'{where}: "prompt" is empty: give the text the target continues from (a raw prompt '
                              "gets no chat template)")
        messages = record.get("messages")
        if "messages" in record and not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and {"role", "content"} <= m.keys() and isinstance(m["role"], str)
                    and isinstance(m["content"], str) for m in messages)
        ):
            raise DDTreeError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects '
                              "whose role and content are strings")
        texts = {"prompt": record["prompt"]} if "prompt" in record else {
            f"messages[{i}].{key}": message[key] for i, message in enumerate(messages) for key in ("role", "content")}
        for field, text in texts.items():  # else the tokenizer's TypeError, once the target had loaded
            check_text(text, f'{where}: "{field}"')
        if messages is not None and messages[-1]["role"] == "assistant":
            if not prompt_messages(messages):
                raise DDTreeError(f"{where}: only assistant turns: a prompt needs a turn for the target to answer")
            record = {**record, "messages": prompt_messages(messages)}
            answered += 1
        # null is no id, as in training's data (it was the string "None", shared by every such line); rows of two
        # results files are paired by id, so one id twice would pair the wrong prompts
        prompt_id = str(number if record.get("id") is None else record["id"])
        if prompt_id in lines:
            raise DDTreeError(f"{path}: lines {lines[prompt_id]} and {number} both have id {prompt_id!r} (a prompt "
                              "without an id has its line number); give each prompt its own id")
        lines[prompt_id] = number
        prompts.append((prompt_id, where, record))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise DDTreeError(f"prompts file {path} holds no prompts")
    if answered:
        print(f"{path}: {answered} prompt{'s' if answered != 1 else ''} ended with an assistant turn: decoded from the "
              "turn before it", file=sys.stderr)
    return prompts


def check_chat_template(tokenizer: PreTrainedTokenizerBase, where: str, instead: str) -> None:
    """One line naming `where` and what to give `instead` when the tokenizer has no chat template (a base model's):
    transformers' ValueError was a traceback."""
    if tokenizer.chat_template is None:
        raise DDTreeError(f"{where}: the target's tokenizer has no chat template to apply; {instead}")


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], where: str, instead: str) -> list[int]:
    """`messages` under the target's chat template, with the generation prompt, as token ids: the prompt decoding
    feeds the target, and training's prompts too (training/conversations.py). One line naming `where` and what to
    give `instead` when the tokenizer has no template (check_chat_template) or its template refuses the messages
    (Llama-2's, Mistral's and Gemma's raise_exception on roles that do not alternate)."""
    from jinja2 import TemplateError  # what a template raises; transformers needs jinja2 to apply one

    check_chat_template(tokenizer, where, instead)
    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (ValueError, TemplateError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise DDTreeError(f"{where}: the target's chat template refused the messages ({reason}); fix them, or "
                          f"{instead}") from None
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def load_prompts(path: str | Path, tokenizer: PreTrainedTokenizerBase, limit: int | None = None) -> list[dict]:
    """Read and tokenize a prompts file (the first `limit` prompts, or all). Returns [{"id", "prompt_ids"}]; errors name file and line."""
    return tokenize_prompts(read_prompts(path, limit), tokenizer)


def tokenize_prompts(records: list[tuple[str, str, dict]], tokenizer: PreTrainedTokenizerBase) -> list[dict]:
    """The prompts `read_prompts` read, tokenized: [{"id", "prompt_ids"}] (the CLI reads them before the target loads,
    and a pipe can be read only once)."""
    prompts = []
    for prompt_id, where, record in records:
        if "prompt" in record:
            ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        else:
            ids = chat_prompt_ids(tokenizer, record["messages"], where,
                                  'give {"prompt": ...} records, used as raw text')
        if not ids:
            raise DDTreeError(f"{where}: the prompt is empty")
        prompts.append({"id": prompt_id, "prompt_ids": list(ids)})
    return prompts


def prompts_fingerprint(prompts: list[dict]) -> str:
    """The sha256 of tokenized prompts ([{"id", "prompt_ids"}], as tokenize_prompts gives them), in order: what bench
    records of what it decoded, so that two results files over other prompt text (a file edited in place, or another
    fed through the same pipe) differ."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(json.dumps([prompt["id"], [int(token) for token in prompt["prompt_ids"]]]).encode() + b"\n")
    return digest.hexdigest()


CHAIN = "dflash"  # the single-chain method's key in results; a tree at budget B is tree_key(B)


def tree_key(budget: int) -> str:
    """The results key of DDTree at a node budget: "ddtree@32"."""
    return f"ddtree@{budget}"


def budget_of(key: str) -> int | None:
    """The node budget of a tree key ("ddtree@32" -> 32); None for "ar" and the chain."""
    return int(key.split("@", 1)[1]) if key.startswith("ddtree@") else None


def method_keys(methods: list[str], budgets: list[int]) -> list[tuple[str, str, int]]:
    """[(key, method, budget)]: "ar", "dflash", and one "ddtree@B" per budget."""
    keys = []
    for method in methods:
        if method not in METHODS:
            raise DDTreeError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
        if method == "ddtree":
            for budget in budgets:
                if budget < 1:
                    raise DDTreeError(f"budget {budget} must be at least 1")
                keys.append((tree_key(budget), method, budget))
        else:
            keys.append((method, method, 0))
    return keys


def acceptance_summary(rows: list[dict], key: str) -> dict:
    """How far method `key` got per verification round, over per-prompt rows (run_benchmark's "prompts").

    tau = tokens committed per round (accepted drafts + the bonus token), expected_tau = what the
    drafter predicted for its own trees (1.0 for rounds without a tree), both None when no round ran (every prompt
    ended on the prefill's token), rounds, new_tokens, and accepted_depth_counts {depth: rounds}. The training-time
    evaluation logs exactly these.
    """
    rounds = [r for row in rows for r in row["methods"][key]["rounds"]]
    depth_counts = Counter(r["accepted_depth"] for r in rounds)
    return {
        "tau": sum(r["committed"] for r in rounds) / len(rounds) if rounds else None,
        "expected_tau": sum(r["expected"] for r in rounds) / len(rounds) if rounds else None,
        "rounds": len(rounds),
        "tree_nodes": sum(r["tree_size"] for r in rounds) / max(len(rounds), 1),  # verified per round
        "new_tokens": sum(len(row["methods"][key]["new_tokens"]) for row in rows),
        "accepted_depth_counts": dict(sorted(depth_counts.items())),
    }


def summarize(rows: list[dict], key: str) -> dict:
    """acceptance_summary plus wall time: seconds, tokens_per_s, and per-round draft/verify/other ms."""
    acceptance = acceptance_summary(rows, key)
    rounds = [r for row in rows for r in row["methods"][key]["rounds"]]
    seconds = sum(row["methods"][key]["seconds"] for row in rows)
    per_round = lambda name: 1000 * sum(r[name] for r in rounds) / max(len(rounds), 1)  # noqa: E731
    timing = {
        "seconds": seconds,
        "tokens_per_s": acceptance["new_tokens"] / seconds if seconds > 0 else 0.0,
        "round_ms": per_round("draft_s") + per_round("verify_s") + per_round("other_s"),
        "draft_ms": per_round("draft_s"),
        "verify_ms": per_round("verify_s"),
        "other_ms": per_round("other_s"),
    }
    depth_counts = acceptance.pop("accepted_depth_counts")  # kept last, as results.json has always listed it
    return {**acceptance, **timing, "accepted_depth_counts": depth_counts}


def method_options(method: str, lookup: int | None, redraft: int | None,
                   corpus: CorpusLookup | bool | None) -> tuple[int | None, int | None, CorpusLookup | bool | None]:
    """run_benchmark's lookup, redraft and corpus as it hands them to generate for `method` (None: the drafter's own):
    the lookups graft into ddtree's trees only, and `ar` drafts nothing."""
    return (lookup if method == "ddtree" else 0, redraft if method != "ar" else 0,
            corpus if method == "ddtree" else None)


def resolved_options(method: str, drafter: DrafterRunner | None, lookup: int | None, redraft: int | None, sized: bool,
                     corpus: CorpusLookup | bool | None) -> tuple[int, int, CorpusLookup | None]:
    """The lookup, redraft and corpus `method` decodes with in run_benchmark, given its lookup, redraft and corpus and
    whether it had a sizer (sized: it sizes ddtree's trees only): generate's drafter_defaults over what run_benchmark
    hands it. Under sizing they differ by method: the chain keeps the drafter's re-drafting, sized trees leave it off."""
    lookup, redraft, corpus = method_options(method, lookup, redraft, corpus)
    return drafter_defaults(method, drafter, lookup, redraft, sized and method == "ddtree", corpus)


def warm_up(keys: list[tuple[str, str, int]], decode: Callable[[str, str, int], object]) -> None:
    """One untimed generation per method, so that no method's figures absorb one-off costs.

    The first calls at a new shape pay for allocations, kernel selection (and, on a GPU, clock
    ramp-up); without this, whichever method is timed first (the chain) reports them as its own.
    A 4-token warm-up was too short: it never drafted a full block nor verified a full-size tree; a 32-token one
    built static runners too small for longer generations, which were then rebuilt inside the timed runs.
    `decode(key, method, budget)` is the timed runs' own call (the same lookup, corpus, re-drafts and sizing), on the
    longest prompt at the full length.
    """
    for key, method, budget in keys:
        decode(key, method, budget)


def checked_prompts(prompts: list[dict]) -> list[dict]:
    """run_benchmark's prompts, checked before anything decodes, their prompt_ids as lists of ints (what generate
    takes: a tensor, (1, T) too, or a tokenizer's encoding); each a dict with "id" and "prompt_ids" (load_prompts)."""
    if not prompts:
        raise DDTreeError('no prompts to benchmark: give a list of {"id": ..., "prompt_ids": [...]} (load_prompts reads '
                          "them from a file)")
    checked = []
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, Mapping) or not {"id", "prompt_ids"} <= prompt.keys():
            held = f"keys {sorted(map(str, prompt))}" if isinstance(prompt, Mapping) else f"a {type(prompt).__name__}"
            raise DDTreeError(f'prompts[{index}] must be a dict with "id" and "prompt_ids" (as load_prompts gives), '
                              f"got {held}")
        ids = prompt_token_ids(prompt["prompt_ids"], f"prompt {prompt['id']!r}'s prompt_ids")
        checked.append({**prompt, "prompt_ids": ids})
    return checked


def run_benchmark(
    target: PreTrainedModel,
    drafter: DrafterRunner | None,
    prompts: list[dict],
    methods: list[str],
    budgets: list[int],
    max_new_tokens: int,
    stop_ids: list[int],
    sampling: Sampling = Sampling(),
    seed: int = 0,
    progress: bool = True,
    static: bool | str | None = None,
    online: bool | OnlineCalibration = False,
    lookup: int | None = None,
    sizer: TreeSizer | None = None,
    redraft: int | None = None,
    corpus: CorpusLookup | bool | None = None,
    warm: bool = True,
) -> dict:
    """Run every method on every prompt. Returns {"summary": {key: summarize(...)}, "prompts": [per-prompt rows]}.

    A row is {"id", "prompt_tokens", "methods": {key: {"tau", "new_tokens", "seconds", "rounds": [Round as a dict]}}}.
    Every method is warmed up first (warm_up, on the longest prompt, untimed); only the runs after that are timed.
    warm False skips that, for a caller that wants the acceptance and not the timings (training's evaluation).
    static: the target's cache (ddtree.decoding.generate; None = static with CUDA graphs on a GPU only; "auto", "on"
    and "off" as --static-cache).
    online: learn draft temperatures from the timed rounds, prompt after prompt (OnlineCalibration), starting from the
    drafter's default calibration if it has one (DrafterRunner.default_calibration: the one it was built with, else its
    config's; or given, the caller's OnlineCalibration); otherwise that default is used as it is.
    lookup: graft that many tokens of context lookup into every ddtree tree (generate; None = the drafter's default);
    the chain stays the drafter's.
    sizer: size every ddtree round's tree to this machine's verify cost (ddtree/sizing.py); the chain stays whole.
    redraft: re-draft behind that many depth-1 candidates in every ddtree round, behind its first in the chain (generate;
    None = the drafter's default).
    corpus: graft the corpus's continuation into every ddtree tree (generate, ddtree/corpus.py; False = none, None =
    the drafter's default); the chain has none.
    """
    keys = method_keys(methods, budgets)
    # A prompt without "id" was a KeyError after the warm-up had decoded; a (1, T) tensor was measured with len() as
    # 1 token (its prompt_tokens, the warm-up's longest prompt and the context check below all wrong).
    prompts = checked_prompts(prompts)
    if drafter is None and any(method != "ar" for _, method, _ in keys):
        raise DDTreeError("methods dflash and ddtree need a drafter")
    if lookup is not None:
        check_lookup("ddtree", lookup)
    if redraft is not None:
        check_redraft("ddtree", redraft)
    if drafter is not None:  # before the warm-up decodes, not in its first generate
        redrafts = getattr(drafter, "default_redraft", 0) if redraft is None else redraft  # generate's None
        check_drafter_runner(drafter, target, redrafts if any(method != "ar" for _, method, _ in keys) else 0)
    static = static_cache(static, target.device)  # before the warm-up decodes, like the checks above
    check_sizer("ddtree", sizer is not None, static)
    check_corpus("ddtree", corpus)
    limit = context_limit(target)
    for prompt in prompts:
        if len(prompt["prompt_ids"]) >= limit:
            raise DDTreeError(
                f"prompt {prompt['id']!r} has {len(prompt['prompt_ids'])} tokens; the target's context is {limit}"
            )
    calibration = None  # generate then uses the drafter's default calibration, if it has one, as it is
    if isinstance(online, OnlineCalibration):  # the caller's, to read what it learned (`ddtree calibrate`)
        calibration = online
    elif online:  # learning from the timed rounds, from what the drafter's default holds if it has one
        calibration = learning_from(getattr(drafter, "default_calibration", None))
    # Each budget's rounds teach their own copy of the sizer its overhead: one budget's rounds cost another's.
    sizers = {key: dataclasses.replace(sizer) for key, method, _ in keys if method == "ddtree" and sizer is not None}

    def decode(key: str, method: str, budget: int, prompt_ids: list[int], calibration, sizers: dict):
        generator = torch.Generator(device=target.device).manual_seed(seed)
        method_lookup, method_redraft, method_corpus = method_options(method, lookup, redraft, corpus)
        return generate(
            target, prompt_ids, method, drafter, budget or 1, max_new_tokens, stop_ids, sampling, generator, static,
            calibration, method_lookup, sizers.get(key), method_redraft, method_corpus,
        )

    # The longest prompt at the full length: the static runners it builds then fit every timed generation, so none
    # is rebuilt (and its CUDA graphs captured again) inside the timed prefill. Its rounds teach neither the timed
    # runs' calibration nor their sizers (copies of them decode it).
    if warm:
        longest = max(prompts, key=lambda prompt: len(prompt["prompt_ids"]))["prompt_ids"]
        untaught = {key: dataclasses.replace(sized) for key, sized in sizers.items()}
        warm_up(keys, lambda key, method, budget: decode(key, method, budget, longest, copy.deepcopy(calibration),
                                                         untaught))

    per_prompt = []
    # closed however the loop ends: a stop's one line (run_cli's "stopped by SIGTERM", "interrupted") was glued to the
    # end of the open bar, which was then drawn again after it
    with tqdm(total=len(prompts) * len(keys), desc="bench", disable=not progress, unit="run") as bar:
        for prompt in prompts:
            row = {"id": prompt["id"], "prompt_tokens": len(prompt["prompt_ids"]), "methods": {}}
            for key, method, budget in keys:
                result = decode(key, method, budget, prompt["prompt_ids"], calibration, sizers)
                row["methods"][key] = {
                    "tau": result.tau,
                    "new_tokens": result.new_tokens,
                    "seconds": result.prefill_s + result.decode_s,
                    "rounds": [asdict(r) for r in result.rounds],
                }
                bar.set_postfix_str(f"{key} tau={format_tau(result.tau)}")
                bar.update()
            per_prompt.append(row)

    summary = {key: summarize(per_prompt, key) for key, _, _ in keys}
    if calibration is not None:
        for key, method, budget in keys:
            if method != "ar":
                summary[key]["online_temperature"] = calibration.temperature(OnlineCalibration.shape(method, budget))
    if "ar" in summary:
        baseline = summary["ar"]["tokens_per_s"]
        for key, stats in summary.items():
            stats["speedup"] = stats["tokens_per_s"] / baseline if baseline > 0 else 0.0
            if key != "ar":  # losslessness, prompt by prompt: exact in fp32; bf16 can flip near-ties (docs/benchmarks.md)
                stats["same_as_ar"] = sum(row["methods"][key]["new_tokens"] == row["methods"]["ar"]["new_tokens"]
                                          for row in per_prompt)
                stats["prompts"] = len(per_prompt)
    return {"summary": summary, "prompts": per_prompt}


def format_tau(tau: float | None, width: int = 0) -> str:
    """A tau to two places, or "-" where no round ran."""
    return f"{'-' if tau is None else f'{tau:.2f}':>{width}}"


def format_summary(summary: dict, dtype: torch.dtype | None = None) -> str:
    """The results table; given the target's dtype, the line of prompts equal to ar's says what a difference means
    there (the table alone read as a losslessness failure: 4/6 in bf16 on an H200, 2026-12-04). At T > 0 too: each
    method draws its tokens from the target's rows with a generator seeded alike (docs/decoding.md)."""
    header = f"{'method':<12} {'tau':>6} {'exp.tau':>7} {'tokens':>7} {'tok/s':>8} {'speedup':>7} " \
             f"{'round ms':>9} {'draft':>7} {'verify':>7} {'other':>7} {'nodes':>6}"
    lines = [header, "-" * len(header)]
    for key, s in summary.items():
        speedup = f"{s['speedup']:.2f}x" if "speedup" in s else "-"
        lines.append(
            f"{key:<12} {format_tau(s['tau'], 6)} {format_tau(s['expected_tau'], 7)} {s['new_tokens']:>7d} "
            f"{s['tokens_per_s']:>8.1f} {speedup:>7} {s['round_ms']:>9.1f} {s['draft_ms']:>7.1f} "
            f"{s['verify_ms']:>7.1f} {s['other_ms']:>7.2f} {s['tree_nodes']:>6.1f}"
        )
    same = {key: f"{s['same_as_ar']}/{s['prompts']}" for key, s in summary.items() if "same_as_ar" in s}
    if same:
        line = "prompts whose committed tokens equal ar's: " + ", ".join(f"{k} {v}" for k, v in same.items())
        if dtype is not None and any(s["same_as_ar"] < s["prompts"] for s in summary.values() if "same_as_ar" in s):
            line += (" (fp32 decoding is exact, so a difference there is a bug: please report it)"
                     if dtype == torch.float32 else
                     f" ({str(dtype).removeprefix('torch.')} rounds a many-row verify and a one-token step differently, "
                     "so a token chosen at a near tie can go the other way; fp32 is exact: "
                     "docs/decoding.md)")
        lines.append(line)
    learned = {key: s["online_temperature"] for key, s in summary.items() if "online_temperature" in s}
    if learned:
        lines.append("online calibration's draft temperature at the end: "
                     + ", ".join(f"{key} {t:.2f}" for key, t in learned.items()))
    return "\n".join(lines)


@torch.no_grad()
def measure_verify_cost(
    target: PreTrainedModel, sizes: list[int], context: int = 300, repeats: int = 5, seed: int = 0
) -> list[dict]:
    """Cost of verifying a draft tree of n nodes against a `context`-token cache, relative to one AR step.

    For each size: the target forward over [root + n nodes] under the tree mask, and the tree's own
    overhead (best-first build from random per-depth logits, mask, a walk, cache compaction), each the
    median of `repeats` runs. Returns rows {nodes, verify_ms, ar_step_ms, ratio, overhead_ms}.
    """
    import statistics
    import time

    from .sizing import probe_runner, verify_seconds
    from .tree import ancestor_matrix, build_tree, tree_positions, walk

    device = target.device
    generator = torch.Generator().manual_seed(seed)
    vocab = target.get_output_embeddings().weight.shape[0]
    runner = probe_runner(target, context, seed)  # the decoding loop's own forwards, over a random context
    cache = runner.cache

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    ar_step = verify_seconds(runner, build_tree(torch.zeros(0, vocab), 1), context, repeats)
    rows = []
    for size in sizes:
        logits = torch.randn(15, vocab, generator=generator).to(device) * 4  # (depth, V), block size 16
        tree = build_tree(logits, size)
        verify_s = verify_seconds(runner, tree, context, repeats)
        overheads = []
        for _ in range(repeats):
            start = clock()
            tree = build_tree(logits, size)
            positions, visible = tree_positions(tree, context), ancestor_matrix(tree)
            first_child = {}
            for row, parent in enumerate(tree.parents, start=1):
                first_child.setdefault(parent, tree.tokens[row - 1])
            accepted, _ = walk(tree, lambda row: first_child.get(row, -1))  # the most likely path, all accepted
            built = clock() - start
            runner.verify([7] + tree.tokens, positions, visible, context)  # untimed: fills rows to compact
            start = clock()
            runner.keep(context, [0] + accepted)
            compacted = clock() - start
            cache.crop(-(cache.get_seq_length() - context))
            overheads.append(built + compacted)
        rows.append(
            {
                "nodes": len(tree),
                "verify_ms": 1000 * verify_s,
                "ar_step_ms": 1000 * ar_step,
                "ratio": verify_s / ar_step,
                "overhead_ms": 1000 * statistics.median(overheads),
            }
        )
    return rows


def compare_packed_verify_cost(
    target: PreTrainedModel, sizes: list[int], context: int = 300, repeats: int = 5, seed: int = 0
) -> list[dict]:
    """The verify's time over [root + n nodes] with the target's plain linear layers and with packed ones
    (ddtree/packed_linear.py), each the median of `repeats`, the two measured alternately, size by size, in one
    process, so that a noisy machine moves both alike. target: a plain model (a packed one is refused); the packed one is
    a copy of it.
    Returns rows {nodes, plain_ms, packed_ms, ratio (plain / packed)}; nodes 0 is one AR step."""
    import copy
    import statistics

    from .packed_linear import is_packed, pack_linears
    from .sizing import probe_runner, probe_tree, verify_seconds
    from .tree import build_tree

    if is_packed(target):  # its packed copies are opaque oneDNN tensors, which copy.deepcopy cannot copy
        raise DDTreeError("compare_packed_verify_cost: the target's linear layers are already packed (pack_linears); "
                          "give it the plain model, unpack_linears(target) first, and it packs a copy to compare")
    packed = copy.deepcopy(target)
    pack_linears(packed)
    runners = {"plain": probe_runner(target, context, seed), "packed": probe_runner(packed, context, seed)}
    vocab = target.get_output_embeddings().weight.shape[0]
    rows = []
    for size in [0, *sizes]:
        tree = probe_tree(vocab, size, seed) if size else build_tree(torch.zeros(0, vocab), 1)
        times = {name: [] for name in runners}
        for _ in range(repeats):
            for name, runner in runners.items():
                times[name].append(verify_seconds(runner, tree, context, repeats=1))
        plain, fast = (1000 * statistics.median(times[name]) for name in ("plain", "packed"))
        rows.append({"nodes": size, "plain_ms": plain, "packed_ms": fast, "ratio": plain / fast})
    return rows
