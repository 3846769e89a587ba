"""The model card (README.md) of an exported drafter, built only from what the run folder recorded.

    evaluation = read_evaluation(run_dir, step)      # <run>/eval/step-000200.json, or None
    card = render_model_card(CardFacts(...))         # Hub metadata + evaluation + recipe + usage + serving

Every number in the card is read, never typed: the acceptance table comes from the evaluation the
training-time callback (training/callbacks.py, AcceptanceEvaluation) wrote for the exported
checkpoint's step, the recipe from the checkpoint's hyper-parameters and the run's config.yaml.

The evaluation file read here, one per evaluated step (written by AcceptanceEvaluation._write),
or for a checkpoint measured after training, <run>/eval/checkpoint-<name>.json (training/evaluate.py,
`make eval`, same fields plus "checkpoint"):
    <run>/eval/step-<step, 6 digits>.json = {
        "step": int,
        "settings": {"prompts": str, "num_prompts": int, "prompts_sha256": str (optional: what the file held,
                     ddtree.bench.prompts_fingerprint), "max_new_tokens": int, "budgets": [int],
                     "primary_budget": int, "block_size": int, "temperature": float (optional),
                     "redraft": int, "lookup": int, "corpus": bool (optional: what the decoder ran with),
                     "dtype": str (optional: the target's, as "bfloat16")},
        "summary": {"dflash" | "ddtree@<B>": {"tau": float, "expected_tau": float, "rounds": int,
                                              "new_tokens": int, ...}},
        "prompts": [per-prompt rows]}
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from huggingface_hub import ModelCardData

from ddtree.bench import CHAIN, budget_of, read_prompts, tree_key
from ddtree.calibration import MEASURED_SECTION
from ddtree.corpus import CORPUS_FILE
from ddtree.errors import DDTreeError, error_line
from ddtree.files import read_yaml_mapping
from ddtree.names import REPO_MARK
from ddtree.targets import is_number

from .checkpoint_paths import ABANDONED_PREFIX
from .conversations import load_conversations
from .data import DATA_RECORD
from .engines import SGLANG, VLLM, serve_commands
from .hub_config import builtin_conversion
from .recipe_data import AUTO_DATA
from .report import data_notes, objective_description, tau_bound, training_end
from .target import dtype_for_precision

TAGS = ["dflash", "ddtree", "speculative-decoding", "draft-model", "block-diffusion"]
# What a card says where its figures were measured grafting the training replies (model.corpus): that the folder ships
# them. --push-only refuses a folder that no longer holds them (training/hub.py, check_export_folder), as it refuses one
# holding them under a card whose figures (MEASURED_TABLE) were measured without them.
CORPUS_SHIPPED = f"{CORPUS_FILE}, shipped in this folder"
MEASURED_TABLE = "| decoding | tau | expected tau | rounds | new tokens |"
# The folder the card's merge step writes (a target trained with model.target_adapter), which its commands then name
MERGED_TARGET = "merged-target"
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def card_repo(card: str) -> str | None:
    """The repo a card was written for (its REPO_MARK line); None for a local export. Cards exported before the mark
    name their repo in the usage section's download line only, and a local export's has none."""
    for line in reversed(card.splitlines()):
        if line.startswith(REPO_MARK) and line.endswith(" -->"):
            repo = line[len(REPO_MARK):-len(" -->")].strip()
            return None if repo == "none" else repo
    download = re.search(r"^hf download (\S+) --local-dir drafter$", card, re.MULTILINE)
    return download.group(1) if download else None


def shown_path(path: str | None) -> str | None:
    """A path as a published card shows it: relative to the project when inside it, so that the card names the
    repository's file (data/eval_prompts.jsonl), not the layout of the machine that trained."""
    if not path or not Path(path).is_absolute():
        return path
    for candidate in (Path(path), Path(path).resolve()):  # as given first: a link inside the project may lead out
        for root in (Path(__file__).parents[1], PROJECT_ROOT):
            if candidate.is_relative_to(root):
                return candidate.relative_to(root).as_posix()
    return path


# ----------------------------------------------------------------------------- reading the run folder


def eval_folder(run_dir: Path, branch: str | None = None) -> Path:
    """<run>/eval, or its <branch>/ folder: the evaluations past step N of a branch a resume from step N abandoned
    (checkpoint_paths.abandoned_branch)."""
    folder = Path(run_dir) / "eval"
    return folder / branch if branch else folder


def evaluation_path(run_dir: Path, step: int, branch: str | None = None) -> Path:
    return eval_folder(run_dir, branch) / f"step-{step:06d}.json"


def evaluated_steps(run_dir: Path, branch: str | None = None) -> list[int]:
    """Steps that have an evaluation file, ascending; a branch's own past step N and the run's up to N, shared."""
    steps = []
    for path in eval_folder(run_dir, branch).glob("step-*.json"):
        suffix = path.stem.removeprefix("step-")
        if suffix.isdigit():
            steps.append(int(suffix))
    if branch:
        shared = int(branch.removeprefix(ABANDONED_PREFIX).split("-")[0])
        steps += [step for step in evaluated_steps(run_dir) if step <= shared]
    return sorted(steps)


def read_evaluation(run_dir: Path, step: int, checkpoint_name: str | None = None,
                    branch: str | None = None) -> dict | None:
    """The evaluation of `step`, checked field by field; None if that step was not evaluated.

    The training-time evaluation of the step first; else `make eval`'s measurement of the checkpoint
    file named `checkpoint_name` (its stem), if it is of the same step. `branch`: of an abandoned branch's checkpoint.
    """
    path = evaluation_path(run_dir, step, branch)
    after_training = not path.is_file() and checkpoint_name is not None
    if after_training:
        path = eval_folder(run_dir, branch) / f"checkpoint-{checkpoint_name}.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError as error:  # not JSON, or not even UTF-8 text (UnicodeDecodeError)
        raise DDTreeError(f"{path}: not valid JSON ({error_line(error)}); re-run the evaluation of step {step}") from None
    if after_training and isinstance(record, dict) and record.get("step") != step:
        return None  # a measurement of an earlier file under the same name (last.ckpt moves on)
    if not isinstance(record, dict) or record.get("step") != step:
        raise DDTreeError(f"{path}: expected an object with \"step\": {step}")
    settings, summary = record.get("settings"), record.get("summary")
    for name in ("prompts", "num_prompts", "max_new_tokens"):
        if not isinstance(settings, dict) or name not in settings:
            raise DDTreeError(f"{path}: settings.{name} is missing")
    if not isinstance(summary, dict) or CHAIN not in summary:
        raise DDTreeError(f"{path}: summary.{CHAIN} (the chain's acceptance) is missing")
    for key, stats in summary.items():
        if key != CHAIN and not re.fullmatch(r"ddtree@[1-9][0-9]*", key):
            raise DDTreeError(f"{path}: summary.{key} is not a decoding the card knows ({CHAIN} or ddtree@<node budget>); "
                              f"re-run the evaluation of step {step}")
        # tau null: NaN, as write_json_atomic writes it, where no round ran (callbacks.measured_summary), shown "-"
        if not isinstance(stats, dict) or "tau" not in stats or not (stats["tau"] is None or is_number(stats["tau"])):
            raise DDTreeError(f"{path}: summary.{key}.tau is missing or not a number")
        for name in ("expected_tau", "rounds", "new_tokens"):  # null: a NaN as write_json_atomic writes it, shown "-"
            if not (stats.get(name) is None or is_number(stats[name])):
                raise DDTreeError(f"{path}: summary.{key}.{name} is {stats[name]!r}, not a number; "
                                  f"re-run the evaluation of step {step}")
    if not (settings.get("dtype") is None or isinstance(settings["dtype"], str)):
        raise DDTreeError(f"{path}: settings.dtype is {settings['dtype']!r}, not a dtype's name; "
                          f"re-run the evaluation of step {step}")
    if not isinstance(settings["prompts"], str):
        raise DDTreeError(f"{path}: settings.prompts is {settings['prompts']!r}, not a file name; "
                          f"re-run the evaluation of step {step}")
    for name in ("num_prompts", "max_new_tokens", "primary_budget", "block_size", "temperature", "lookup", "redraft"):
        if not (settings.get(name) is None or is_number(settings[name])):
            raise DDTreeError(f"{path}: settings.{name} is {settings[name]!r}, not a number; "
                              f"re-run the evaluation of step {step}")
    return record


def project_path(path: str) -> Path:
    """A file a run names, read from here, else from the project (runs started by `make` name its files so)."""
    return Path(path) if Path(path).exists() else PROJECT_ROOT / path


def count_training_prompts(prompts_file: str, num_prompts: int, data_path: str | None) -> int:
    """How many of the first `num_prompts` prompts of `prompts_file` (an evaluation's settings) are, message for
    message (role and text, outer whitespace aside), the prompt of an assistant turn of the conversations in
    `data_path`: the drafter was trained on the target's replies to those, so its tau on them is no held-out figure.

    Text only: no tokenizer, no model. A relative path is read from here, else from the project (runs started by
    `make` name its files so). DDTreeError when either cannot be read here (a run trained on another machine, a Hub
    dataset) or a prompt is raw text, which no conversation's messages can be compared with."""
    if not data_path:
        raise DDTreeError("the run folder has no config.yaml naming its data.data_path")
    prompts_path, data = project_path(prompts_file), project_path(data_path)
    if not data.exists():
        raise DDTreeError(f"the training data {data_path} is not a file or folder here")

    def key(messages: list[dict]) -> tuple:
        return tuple((message["role"], message["content"].strip()) for message in messages)

    evaluated = []
    for _, where, record in read_prompts(prompts_path, num_prompts):
        if "messages" not in record:
            raise DDTreeError(f"{where}: a raw-text prompt, which no conversation's messages can be compared with")
        evaluated.append(key(record["messages"]))
    trained = {key(record["messages"][:i]) for record in load_conversations(data, messages_only=True)
               for i, message in enumerate(record["messages"]) if message["role"] == "assistant"}
    return sum(prompt in trained for prompt in evaluated)


def read_data_record(run_dir: Path) -> dict | None:
    """The run's data.json (DistillDataModule.record, written as training ends), or None if absent or unreadable:
    the card then says nothing of the share of the split it drew from."""
    try:
        record = json.loads((Path(run_dir) / DATA_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def timer_seconds(callbacks: dict) -> float | None:
    """The training time a checkpoint's Timer had counted (Lightning's Timer state, the key StepTimer keeps too);
    None for a run without trainer.max_time."""
    elapsed = (callbacks.get("Timer") or {}).get("time_elapsed") or {}
    return float(elapsed["train"]) if is_number(elapsed.get("train")) else None


def max_time_seconds(max_time) -> float | None:
    """trainer.max_time as config.yaml holds it (DD:HH:MM:SS, or a mapping of timedelta's fields) in seconds; None
    for none, or one this does not read."""
    if isinstance(max_time, str) and re.fullmatch(r"\d+:\d+:\d+:\d+", max_time.strip()):
        days, hours, minutes, seconds = map(int, max_time.strip().split(":"))
        return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)
    if isinstance(max_time, dict):
        try:
            return timedelta(**max_time).total_seconds()
        except TypeError:
            return None
    return None


def read_run_config(run_dir: Path) -> dict:
    """The run's resolved configuration (config.yaml written by training/train.py), or {} if absent."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return {}
    return read_yaml_mapping(path)


# ----------------------------------------------------------------------------- the card


@dataclass
class CardFacts:
    """Everything the card says, gathered by training/publish.py from the checkpoint and the run folder."""

    name: str  # the card's title: the repo's or the folder's name
    repo: str | None  # the Hub repo id, if it is to be pushed (the usage snippets name it)
    target: str  # the target as the run named it (built-in name, folder or Hub id)
    base_model: str | None  # the target's Hub id (card metadata); None when it has none
    license: str
    drafter_config: dict  # the exported config.json (DFlash fields + Qwen3 fields)
    num_parameters: int
    dtype: str  # dtype of the exported weights
    step: int  # global step of the exported checkpoint
    checkpoint: str  # which checkpoint, as chosen ("best -> step-step=200.ckpt", a path, ...)
    hyper_parameters: dict  # DistillModule hyper-parameters stored in the checkpoint
    run_config: dict  # the run's config.yaml ({} if absent)
    evaluation: dict | None  # read_evaluation(run_dir, step)
    # How many of the evaluated prompts are prompts of the training data (count_training_prompts); None: not counted,
    # and the card then does not call them held out.
    training_prompts: int | None = None
    # The run's data.data_path as training read it (publish.training_data_path: `auto` resolved, a relative path found);
    # None: not known. The card reads whose replies the data holds from it.
    data_path: str | None = None
    other_evaluated_steps: list[int] = field(default_factory=list)
    # The run's data.json (training/train.py: how many of the training split's sequences it drew from); None: none
    data_record: dict | None = None
    # The training time the checkpoint's Timer (trainer.max_time's) had counted when it was saved; None: no max_time
    trained_seconds: float | None = None
    # The checkpoint lies outside the run folder and did not record the run's evaluation of its step: not known to be
    # the run's, so the run's records (evaluation, steps, checkpoints, corpus) are not this drafter's.
    outside_run: bool = False
    kept_checkpoints: list[str] = field(default_factory=list)  # the run's checkpoint files, by name
    best_kept: bool = False  # the run has a checkpoints/best.ckpt (`--ckpt best` exports it)
    exported_best: bool = False  # the checkpoint is the one best.ckpt is: the run evaluated it and ranked it best
    speculators: bool = False  # the config also carries vLLM's speculators fields
    engine_problems: list[str] = field(default_factory=list)  # engine rules it breaks (--allow-engine-mismatch)
    rejected_by: list[str] = field(default_factory=list)  # the engines (VLLM, SGLANG) whose rules those are
    engine_target: str = "the target's config.json"  # what the engine rules compared the drafter with


def _format_tau(value: float | None) -> str:
    """A tau to three places, or "-" where none was measured (null: no round ran)."""
    return "-" if value is None else f"{value:.3f}"


def decoded_with(settings: dict) -> list[str]:
    """What the evaluation's decoder added to the published chain and tree (the drafter's `ddtree` defaults)."""
    extras = []
    if settings.get("redraft"):
        extras.append(f"re-drafting behind the {settings['redraft']} most likely first tokens, the chain behind its "
                      "first (`--redraft`)")
    if settings.get("lookup"):
        extras.append(f"{settings['lookup']} tokens of context lookup grafted into every tree (`--lookup`)")
    if settings.get("corpus"):
        extras.append(f"the training replies' majority continuation grafted into every tree ({CORPUS_SHIPPED}; "
                      "`--corpus none` leaves it out)")
    return extras


def evaluation_section(facts: CardFacts) -> list[str]:
    record = facts.evaluation
    lines = [MEASURED_SECTION, ""]  # `ddtree calibrate` closes it with a note (ddtree.calibration.note_in_card)
    if record is None and facts.outside_run:
        return lines + [
            f"This checkpoint (step {facts.step}) was exported from outside its run folder and did not record the "
            "evaluation of the run folder it was exported with, so no acceptance is reported here. The precision, "
            "hardware, batch and data below are read from that run folder's config.yaml, not from this checkpoint. "
            "Export it from the run it was trained in, or measure it with `make eval CKPT=<the checkpoint>`.",
            "",
        ]
    # Records moved or deleted since the run ranked its checkpoints by them (its best.ckpt): not a run stopped before
    # its first evaluation, nor a step it never evaluated
    gone = None
    if record is None and facts.best_kept and not facts.other_evaluated_steps:
        gone = ("the run's eval/ holds none, though it ranked its checkpoints by them (its checkpoints/best.ckpt), so "
                "they were moved or deleted since. Put the run's eval/ back")
    elif record is None and facts.exported_best:
        gone = (f"the run ranked it best (its checkpoints/best.ckpt) by an evaluation whose record, eval/step-"
                f"{facts.step:06d}.json, was moved or deleted since. Put that record back")
    if gone is not None:
        return lines + [f"No evaluation of this checkpoint (step {facts.step}) is in its run folder, so no acceptance "
                        f"is reported here: {gone}, or measure this checkpoint with `make eval`, and export it again.",
                        ""]
    if record is None:
        # Only the best evaluated checkpoints are kept (checkpoint.save_top_k), so an evaluated step may have none.
        kept = ", ".join(facts.kept_checkpoints) or "none"
        evaluated = (f"Steps the run evaluated: {', '.join(str(s) for s in facts.other_evaluated_steps)}"
                     if facts.other_evaluated_steps else "The run evaluated no step: it stopped before its first "
                     "evaluation (its report.md says at which step), so it ranked no checkpoint")
        measure = ("Export `--ckpt best` (the best evaluated step kept), or measure" if facts.best_kept else "Measure")
        return lines + [
            f"This checkpoint (step {facts.step}) was not evaluated during training, so no acceptance is reported "
            f"here. {evaluated}; checkpoints it kept: {kept}. {measure} this checkpoint with `make eval` and export it "
            "again.",
            "",
        ]
    settings, summary = record["settings"], record["summary"]
    # AcceptanceEvaluation decodes greedily (Sampling(temperature=0.0)); records written before it stored
    # the temperature in settings have no field for it.
    temperature = settings.get("temperature", 0.0)
    block = facts.drafter_config["block_size"]
    lookup = settings.get("lookup") or 0
    bound = tau_bound(block, lookup)
    when = ("after training by `make eval` (training/evaluate.py, the training-time evaluation's code and "
            "settings)" if "checkpoint" in record else "by the training-time evaluation")
    if facts.training_prompts is None:
        held_out = "not compared with the training data"
    elif facts.training_prompts == 0:
        held_out = "held-out prompts, not in the training data"
    else:  # its tau is partly a measure of replies the drafter learnt
        held_out = (f"not held out: {facts.training_prompts} of these {settings['num_prompts']} prompts are prompts of "
                    "the training data")
    lines += [
        f"Measured at training step {record['step']} (the step of this checkpoint) {when}, which runs the same "
        "code as `ddtree bench`: lossless decoding with the frozen target on "
        f"the first {settings['num_prompts']} prompts of `{shown_path(settings['prompts'])}` ({held_out}), up to "
        f"{settings['max_new_tokens']} new tokens each, temperature {temperature:g}.",
        "",
        "tau = tokens committed per target verification (accepted draft tokens + 1 bonus token), averaged over "
        f"all decoding rounds; {bound}. The expected tau is the drafter's own "
        "prediction for the trees it built (1 + the sum of their path probabilities).",
        "",
        MEASURED_TABLE,
        "|---|---:|---:|---:|---:|",
    ]
    budgets = sorted(budget for budget in map(budget_of, summary) if budget is not None)
    rows = [(f"chain (one DFlash block, {block - 1} drafted tokens)", summary[CHAIN])]
    for budget in budgets:
        label = f"DDTree, node budget {budget}"
        if settings.get("primary_budget") == budget and "checkpoint" not in record:  # `make eval`'s ranks nothing
            label += " (checkpoints ranked by this)"
        rows.append((label, summary[tree_key(budget)]))
    for label, stats in rows:
        # expected_tau is absent in older evaluations, and null where it was NaN
        expected = "-" if stats.get("expected_tau") is None else f"{stats['expected_tau']:.3f}"
        rounds, new_tokens = ("-" if stats.get(name) is None else stats[name] for name in ("rounds", "new_tokens"))
        lines.append(f"| {label} | {_format_tau(stats['tau'])} | {expected} | {rounds} | {new_tokens} |")
    if any(stats["tau"] is None for _, stats in rows):
        lines += ["", "A tau shown as `-` was not measured: no verification round ran (every prompt ended on the "
                      "target's first token)."]
    extras = decoded_with(settings)
    defaults = facts.drafter_config.get("dflash_config") or {}  # where the drafter keeps its decoding defaults
    overridden = [f"--{name} {settings.get(name) or 0}" for name in ("lookup", "redraft")
                  if (settings.get(name) or 0) != (defaults.get(name) or 0)]  # the run's eval.lookup / eval.redraft
    if overridden:
        lines += ["", f"Decoded with settings that are not this drafter's defaults ({'; '.join(extras) or 'none added'}): "
                      f"decode with `{' '.join(overridden)}` to reproduce these figures."]
    elif extras:
        lines += ["", f"Decoded as `ddtree` decodes this drafter unless told otherwise (its config and files): {'; '.join(extras)}."]
    measured = measured_dtype(facts)
    if measured is not None:
        dtype, source = measured
        lines += ["", f"The target, and the drafter with it, ran in `{dtype}` ({source}) during this evaluation."]
        if dtype != facts.dtype:
            lines[-1] += (f" These weights are stored in `{facts.dtype}` (the export's `--dtype`), not the `{dtype}` "
                          "the figures were measured in: `ddtree` casts them to its target's dtype, as measured; an engine that "
                          "keeps them as stored may accept slightly differently.")
    return lines + [""]


def measured_dtype(facts: CardFacts) -> tuple[str, str] | None:
    """(dtype, where it comes from) of the evaluation's target: as the evaluation recorded it (settings.dtype: `make
    eval`'s, and training's since 2026-12-03), else model.target_dtype or the one trainer.precision gives
    (DistillModule.configure_model), read from the run's config as it is now. None if not known."""
    recorded = facts.evaluation["settings"].get("dtype")
    if recorded is not None:
        who = "`make eval`" if "checkpoint" in facts.evaluation else "the training-time evaluation"
        return str(recorded).removeprefix("torch."), f"as {who} recorded it"
    return training_dtype(facts)


def training_dtype(facts: CardFacts) -> tuple[str, str] | None:
    """(dtype, where it comes from) of the target in training: model.target_dtype, else the one trainer.precision
    gives (DistillModule.configure_model). None if not known (no config.yaml)."""
    target_dtype = facts.hyper_parameters.get("target_dtype") or "auto"
    precision = (facts.run_config.get("trainer") or {}).get("precision")
    if target_dtype == "auto" and precision is None:
        return None  # no config.yaml: the training precision is not known
    try:
        dtype = dtype_for_precision(precision, target_dtype)
    except DDTreeError:
        return None
    source = f"`model.target_dtype: {target_dtype}`" if target_dtype != "auto" else f"the training precision `{precision}`"
    return str(dtype).removeprefix("torch."), source


def data_provenance(data_path: str | None, target: str, adapter: tuple[str, str | None] | None = None) -> str:
    """Whose replies the data holds, as far as the data itself says (data/regenerate.py's regeneration.json).
    adapter: (path, sha256 of its files) of the PEFT adapter training merged into the target (target_adapter)."""
    meta = Path(data_path) / "regeneration.json" if data_path else None
    try:
        record = json.loads(meta.read_text()) if meta is not None and meta.is_file() else None
    except (OSError, ValueError):  # a damaged record says nothing: the card says so rather than failing the export
        record = None
    written_by = record.get("target") if isinstance(record, dict) else None
    merged = record.get("target_adapter") if isinstance(record, dict) else None
    if written_by == target and adapter is None and merged:
        return (f"responses written by `{written_by}` with the PEFT adapter `{shown_path(merged)}` merged (its "
                "regeneration.json), not by this target, which had no adapter")
    if written_by == target and adapter is not None and not merged:
        return (f"responses written by `{written_by}` without the PEFT adapter this drafter was trained with (its "
                "regeneration.json): the base model's, not the fine-tuned target's")
    if written_by == target and adapter is not None and None not in (adapter[1], record.get("target_adapter_sha256")) \
            and record["target_adapter_sha256"] != adapter[1]:
        return (f"responses written by `{written_by}` with another version of its adapter (the sha256 of its files "
                "in the data's regeneration.json is not the one training recorded)")
    if written_by == target:
        return ("responses written by the target itself (its regeneration.json; the DFlash recipe distils the "
                "target's own outputs)" if adapter is None else "responses written by the target itself, its adapter "
                "merged (its regeneration.json; the DFlash recipe distils the target's own outputs)")
    if written_by:
        return f"responses written by `{written_by}` (its regeneration.json), not by this target"
    return "responses as the data holds them: no regeneration.json says the target wrote them"


def shown_data_path(configured: str | None, read: str | None) -> str:
    """The run's data.data_path as the card names it: `auto` with the cache folder it stands for (not this machine's)."""
    if configured == AUTO_DATA and read:
        return f"`{AUTO_DATA}` (`<ddtree cache>/data/{Path(read).name}`, written by data/regenerate.py)"
    return f"`{shown_path(read or configured)}`"


def planned_length(facts: CardFacts, trainer: dict) -> str:
    """The run's limits, and which of them ended training where that was at this checkpoint's step (its own Timer
    says whether max_time was spent): a stop well short of max_steps reads as one."""
    max_steps, max_time = trainer.get("max_steps"), trainer.get("max_time")
    text = f"max_steps {max_steps}, max_epochs {trainer.get('max_epochs')}" + (f", max_time {max_time}" if max_time else "")
    limit = max_time_seconds(max_time)
    spent = limit is not None and facts.trained_seconds is not None and facts.trained_seconds >= limit
    ended = training_end(facts.step, max_steps if isinstance(max_steps, int) else None, spent)
    return text + (f"; {ended}, this checkpoint's" if ended else "")


def recipe_section(facts: CardFacts) -> list[str]:
    hp, cfg = facts.hyper_parameters, facts.drafter_config
    trainer = facts.run_config.get("trainer", {}) or {}
    data = facts.run_config.get("data", {}) or {}
    rows = [
        ("target (frozen)", f"`{facts.target}`" + (f" (`{facts.base_model}`)" if facts.base_model else "")),
        *([("target adapter", f"{adapter_named(facts)}, merged into the target's weights at load")]
          if target_adapter(facts) else []),
        ("drafter", f"Qwen3-style decoder layers: {cfg['num_hidden_layers']}, hidden size {cfg['hidden_size']}, "
                    f"{facts.num_parameters:,} parameters ({facts.dtype})"),
        ("block size", cfg["block_size"]),
        ("target layers read", cfg["dflash_config"]["target_layer_ids"]),
        ("MASK token id", cfg["dflash_config"]["mask_token_id"]),
        ("draft vocabulary", f"{len(cfg['dflash_config']['draft_vocab']):,} tokens: the training replies' by frequency, then the "
                             "lowest ids (dflash_config.draft_vocab; engines that ignore it draft from the whole vocabulary)"
         if cfg["dflash_config"].get("draft_vocab") else "the target's whole vocabulary"),
        ("anchors per sequence", hp.get("num_anchors")),
        ("loss decay gamma", hp.get("gamma")),
        ("training loss", objective_description(hp)),
        *([("re-drafting in training", f"{hp['redraft_prob']:g} of the blocks are given their first token (for "
                                        "`--redraft` decoding)")] if hp.get("redraft_prob") else []),
        *([("dropout", hp["dropout"])] if hp.get("dropout") else []),
        ("optimizer", f"AdamW, lr {hp.get('lr')}, betas {hp.get('betas')}, weight decay {hp.get('weight_decay')}, "
                      f"warmup {hp.get('warmup_ratio')}, cosine to {hp.get('min_lr_ratio')} x lr"),
        ("LoRA", f"rank {hp['lora_rank']} (merged into these weights)" if hp.get("lora_rank") else "no"),
        ("warm start", shown_path(hp.get("init_from")) or "no"),  # not the training machine's layout
        ("steps trained", f"{facts.step} (checkpoint: {facts.checkpoint})"),
    ]
    if trainer:
        rows += [
            ("precision", trainer.get("precision")),
            ("hardware", f"{trainer.get('devices')} x {trainer.get('accelerator')}, {trainer.get('num_nodes')} "
                         f"node(s), strategy {trainer.get('strategy')}"),
            ("batch", f"{data.get('batch_size')} sequences x {trainer.get('accumulate_grad_batches', 1)} "
                      "accumulation steps per device"),
            ("planned length", planned_length(facts, trainer)),
        ]
    lines = ["## Training recipe", "", "| setting | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += ["", "### Data", ""]
    if data:
        lines += [
            f"- conversations: {shown_data_path(data.get('data_path'), facts.data_path)}; "
            f"{data_provenance(facts.data_path, facts.target, target_adapter(facts))}",
            f"- max length {data.get('max_length')} tokens, loss on assistant tokens only, "
            f"{data.get('val_fraction')} held out for validation",
        ]
        lines += [f"- {note} (the run's data.json)" for note in data_notes(facts.data_record)]
    else:
        lines.append("- the run folder has no config.yaml, so the data settings are not known")
    return lines + [""]


def target_adapter(facts: CardFacts) -> tuple[str, str | None] | None:
    """(path, sha256 of its files) of the PEFT adapter training merged into the target (model.target_adapter); None
    without one. The sha256 is None for a checkpoint saved before it was recorded."""
    adapter = facts.hyper_parameters.get("target_adapter")
    return (str(adapter), facts.hyper_parameters.get("target_adapter_sha256")) if adapter else None


def adapter_named(facts: CardFacts) -> str:
    """The target's adapter as the card names it: its path on the training machine and the sha256 of its files."""
    path, files = target_adapter(facts)
    return f"the PEFT adapter `{shown_path(path)}` (" + (f"sha256 of its `adapter_*` files `{files}`)" if files else
                                                        "the checkpoint recorded no sha256 of its files)")


def decoding_target(facts: CardFacts) -> str:
    """The target the card's commands name: the folder its merge step writes where training merged an adapter into
    the target (the base model alone decodes the base model's text, at an acceptance nobody measured); else the
    target's Hub id, else its name."""
    return MERGED_TARGET if target_adapter(facts) else facts.base_model or facts.target


def verifier_name(facts: CardFacts) -> str:
    """The verifier a --speculators export's config.json names (speculators_config.verifier): what `vllm serve` of
    the drafter alone loads as the target."""
    return facts.drafter_config["speculators_config"]["verifier"]["name_or_path"]


def merge_step(facts: CardFacts) -> list[str]:
    """The adapter merged into the target as training merged it (training/target.py: ddtree's load_target in the
    training dtype, then peft's merge), saved with the tokenizer as a folder every command below loads."""
    path, _ = target_adapter(facts)
    known = training_dtype(facts)
    return [
        "```python",
        "import torch",
        "from peft import PeftModel",
        "from ddtree.targets import load_target",
        "",
        f"base, tokenizer = load_target({json.dumps(facts.target)}, dtype=torch.{known[0] if known else 'float32'})",
        f"PeftModel.from_pretrained(base, {json.dumps(shown_path(path))}).merge_and_unload().save_pretrained("
        f"{json.dumps(MERGED_TARGET)})",
        f"tokenizer.save_pretrained({json.dumps(MERGED_TARGET)})",
        "```",
    ]


def usage_section(facts: CardFacts) -> list[str]:
    cfg = facts.drafter_config
    target = decoding_target(facts)
    where = facts.repo or "path/to/this/folder"
    drafter = "drafter" if facts.repo else where  # the folder the download line writes
    # a target folder of the training machine may hold a space: quoted for a POSIX shell, as the serve commands are
    quoted = shlex.quote(target)
    merge = [] if not target_adapter(facts) else [
        f"The target is `{facts.target}` with {adapter_named(facts)} merged into its weights. The adapter is not "
        f"in this folder and neither `ddtree` nor the engines merge one: merge it first, once, into `{MERGED_TARGET}` "
        "(what training merged; peft needed here only), and give that folder as the target everywhere below:",
        "",
        *merge_step(facts),
        "",
    ]
    return [
        "## Usage",
        "",
        "The drafter owns no embedding and no LM head: it embeds its block with the target's input embedding "
        "and reads logits through the target's LM head. It reads the target's hidden states at layers "
        f"{cfg['dflash_config']['target_layer_ids']} (id l = the output of decoder layer l).",
        "",
        *merge,
        "With `ddtree` (the training repository's decoding CLI):",
        "",
        "```bash",
        *([f"hf download {facts.repo} --local-dir drafter"] if facts.repo else []),
        f"ddtree generate --target {quoted} --drafter {drafter} --method ddtree --budget 32 "
        "--prompt \"Hello\"",
        f"ddtree bench --target {quoted} --drafter {drafter} --prompts prompts.jsonl "
        "--methods ar,dflash,ddtree --budgets 16,32,64",
        "```",
        "",
        *([f"`--target {facts.target}` (`ddtree`'s built-in: the dequantized GGUF weights named at the top) decodes "
           f"as the figures of this card were measured; `--target {target}` loads the original weights, whose "
           "acceptance was not measured.", ""]
          if builtin_conversion(facts.target) and target != facts.target and not target_adapter(facts) else []),
        "With transformers (the model code ships beside the weights):",
        "",
        "```python",
        "from transformers import AutoModel",
        f"drafter = AutoModel.from_pretrained(\"{where}\", trust_remote_code=True)",
        "# drafter(noise_embedding, target_hidden, position_ids) -> hidden states; see modeling_dflash.py",
        "```",
        "",
        "The reference `dflash` package (`dflash.DFlashDraftModel.from_pretrained`) loads the same folder.",
        "",
    ]


def serving_engines(facts: CardFacts) -> list[str]:
    """The engines the card gives commands for and counts among what serves the drafter: those that would load it (an
    export with --allow-engine-mismatch names the others as rejecting it, and nothing more)."""
    return [engine for engine in (VLLM, SGLANG) if engine not in facts.rejected_by]


def serving_section(facts: CardFacts) -> list[str]:
    """The vLLM and SGLang commands, and what tau each engine gives: the chain's, measured above."""
    cfg = facts.drafter_config
    block = cfg["block_size"]
    where = facts.repo or "path/to/this/folder"
    commands = serve_commands(cfg, decoding_target(facts), where)
    served = serving_engines(facts)
    lines = ["## Serving with vLLM and SGLang", ""]
    if facts.engine_problems:
        lines += ["**Exported with `--allow-engine-mismatch`: an engine would reject this drafter.**", "",
                  *[f"- {problem}" for problem in facts.engine_problems], ""]
        if facts.rejected_by:
            lines += [f"So this card gives no command for {' or '.join(facts.rejected_by)}, and does not count "
                      f"{'it' if len(facts.rejected_by) == 1 else 'them'} among what serves the drafter.", ""]
    else:
        lines += ["This folder meets the rules vLLM and SGLang apply when they load a DFlash drafter (checked at "
                  "export, from their source; not run here): `architectures: [\"DFlashDraftModel\"]`, "
                  f"`model_type: {cfg.get('model_type', 'none (speculators format)')}`, the DFlash fields, the "
                  f"weight names and shapes, the MASK id and the target's hidden size and layers (read from "
                  f"{facts.engine_target}).", ""]
    block_sizes = {VLLM: f"vLLM drafts `num_speculative_tokens` = {block - 1} tokens after the anchor",
                   SGLANG: f"SGLang counts the anchor, `--speculative-num-draft-tokens` = {block}"}
    engine_commands = {
        VLLM: ["# vLLM", commands[VLLM],
               # `vllm serve <drafter>` serves the verifier config.json names: for an adapted target, the base
               # model alone
               *(["# vLLM, speculators format (config.json names the verifier)", f"vllm serve {where}"]
                 if facts.speculators and not target_adapter(facts) else [])],
        SGLANG: ["# SGLang", commands[SGLANG]],
    }
    if served:
        lines += [f"Block size {block}: {'; '.join(block_sizes[engine] for engine in served)}.", "",
                  "```bash", *[line for engine in served for line in engine_commands[engine]], "```", ""]
    if served and target_adapter(facts):
        lines += [f"`{MERGED_TARGET}` is the folder the merge step under Usage writes: an engine loads the target "
                  "from its files and would serve the base model without the adapter."
                  + (f" For that reason this card gives no `vllm serve {where}` (speculators format): it serves the "
                     f"verifier `config.json` names, `{verifier_name(facts)}` without the adapter; the verifier must "
                     "be the merged folder, as in the vLLM command above." if facts.speculators and VLLM in served
                     else ""), ""]
    lines += [
        "Both engines verify the DFlash block as one chain: neither verifies a draft tree on its main branch "
        "(open pull requests: vLLM #42910 for DDTree, SGLang #31069 and #36196 for tree verification of DFlash). "
        "DDTree's extra acceptance comes from the `ddtree` decoder, or from those branches once merged.",
        "",
    ]
    if facts.evaluation is None:
        return lines + ["No acceptance was measured for this checkpoint, so the tau an engine gives is not known.", ""]
    summary = facts.evaluation["summary"]
    # The chain row is what an engine gives: the same greedy chain verification, measured by ddtree, unless the
    # chain was re-drafted behind its first token, which no engine does.
    redrafted = bool(facts.evaluation["settings"].get("redraft"))
    # ...or unless the chain was drafted over a draft vocabulary, which the engines do not read: theirs is the whole one.
    narrowed = bool((facts.drafter_config.get("dflash_config") or {}).get("draft_vocab"))
    # ...or unless the target was a built-in's dequantized GGUF weights: the engines serve the original ones (not where
    # they serve the merge step's folder, which load_target made from those very weights).
    quantized = builtin_conversion(facts.target) is not None and not target_adapter(facts)
    engines = "" if redrafted or narrowed or quantized else "".join(f"{engine}, " for engine in served)
    lines += ["| what serves it | verification | measured tau |", "|---|---|---:|",
              f"| {engines}`ddtree --method dflash` | chain of {block - 1} drafted tokens "
              f"| {_format_tau(summary[CHAIN]['tau'])} |"]
    for budget in sorted(budget for budget in map(budget_of, summary) if budget is not None):
        lines.append(f"| `ddtree --method ddtree --budget {budget}` | draft tree of {budget} nodes "
                     f"| {_format_tau(summary[tree_key(budget)]['tau'])} |")
    lines += ["", "Same prompts and settings as the acceptance table above."]
    if redrafted:
        lines += ["", "That chain was re-drafted behind its first token, which the engines do not do: they verify the "
                  "block's own chain, which accepts less. Measure it with `ddtree bench --methods dflash --redraft 0`."]
    if quantized and served:
        lines += ["", f"That chain was measured with `{facts.target}`, the dequantized GGUF weights named at the top; "
                  "the commands above serve the original weights, with which the engines' tau was not measured."]
    if narrowed:
        lines += ["", "That chain was drafted over this drafter's draft vocabulary (`dflash_config.draft_vocab`), which "
                  "the engines do not read: they draft over the target's whole vocabulary, so their chain differs and "
                  "its tau was not measured."]
    return lines + [""]


def render_model_card(facts: CardFacts) -> str:
    """README.md text: YAML metadata for the Hub, then the evaluation, the recipe and usage."""
    tags = TAGS + (["speculators"] if facts.speculators else [])
    metadata = ModelCardData(
        base_model=facts.base_model, library_name="transformers", license=facts.license, tags=tags
    ).to_yaml()
    cfg = facts.drafter_config
    adapted = " fine-tuned with a PEFT adapter" if target_adapter(facts) else ""
    intro = [
        f"# {facts.name.split('/')[-1]}",
        "",
        f"A block-diffusion (DFlash) drafter for speculative decoding with `{facts.base_model or facts.target}`"
        f"{adapted}. "
        f"One forward pass drafts a block of {cfg['block_size'] - 1} tokens after an anchor; the target verifies "
        "them losslessly, either as one chain or as a draft tree under a node budget (DDTree), so the output is "
        "exactly the target's. Trained by distilling the frozen target into the drafter.",
        "",
    ]
    if target_adapter(facts):
        intro += [
            "**Fine-tuned target.** The drafter was trained, and every figure below measured, against "
            f"`{facts.target}` with {adapter_named(facts)} merged into its weights. Merge the adapter the same way "
            "before decoding or serving (Usage below) and give the merged folder as the target: with "
            f"`{facts.base_model or facts.target}` alone the output is still lossless, but it is the base model's, not "
            "the fine-tuned model's, and its acceptance was not measured.",
            "",
        ]
    conversion = builtin_conversion(facts.target)
    if conversion is not None:
        original = f"`{facts.base_model}`'s" if facts.base_model else "the model's"
        intro += [
            f"**Quantized target.** The drafter was trained, and every figure below measured, against `ddtree`'s "
            f"built-in target `{facts.target}`: {original} weights {conversion}, not its original full-precision "
            "weights. How it accepts with the original weights, which vLLM and SGLang load from the Hub id, was not "
            "measured.",
            "",
        ]
    lines = ["---", metadata.strip(), "---", "", *intro, *evaluation_section(facts), *recipe_section(facts),
             *usage_section(facts), *serving_section(facts), f"{REPO_MARK}{facts.repo or 'none'} -->", ""]
    return "\n".join(lines)
