"""Export a trained drafter as a Hugging Face Hub folder, ready for the serving engines, and push it.

    make export RUN=outputs/smollm2-135m/<run> OUT=exports/smollm2-drafter [CKPT=best|last|path]
                [SPECULATORS=1] [OVERWRITE=1] [ALLOW_ENGINE_MISMATCH=1] [REPO=user/name PUSH=1 [PRIVATE=1]]
    python -m training.publish outputs/smollm2-135m/<run> --out exports/smollm2-drafter --ckpt best \
        [--speculators] [--overwrite] [--allow-engine-mismatch] [--repo user/name --push [--private]]
    python -m training.publish --push-only exports/smollm2-drafter --repo user/name   # push a finished export

The output folder (one flat folder, as the Hub serves it):
    model.safetensors        the drafter's weights only (never the target's); LoRA merged in
    config.json              model_type "qwen3" and the published DFlash fields (architectures,
                             block_size, num_target_layers, dflash_config.{mask_token_id,target_layer_ids}),
                             as the published DFlash drafters: AutoConfig, vLLM and SGLang read it without
                             remote code; the target it was trained for, auto_map -> the two files below;
                             with --speculators also vLLM's speculators fields (speculators_config with the
                             verifier and the number of speculative tokens)
    configuration_dflash.py  ddtree's model files, copied as remote code:
    modeling_dflash.py       AutoModel.from_pretrained(folder, trust_remote_code=True) loads the drafter
    corpus.safetensors       where the recipe set model.corpus: the training replies' token ids, which
                             `ddtree` grafts from by default (ddtree/corpus.py); the engines ignore it
    README.md                model card: Hub metadata, the acceptance measured for this checkpoint during
                             training (read from <run>/eval/), the recipe and data, usage, and the vLLM
                             and SGLang commands with the chain tau those engines give (for the built-in
                             target, dequantized from a 4-bit GGUF, the card says the original weights the
                             engines load were not measured)

Checkpoints: `best` is checkpoints/best.ckpt (the step with the highest measured tau), `last` is
checkpoints/last.ckpt, anything else a path (a .ckpt file or a DeepSpeed checkpoint folder, which is
consolidated to fp32 first). It must have been trained as RUN's config.yaml says (model.target; model.corpus too
outside RUN, as a resume may set or drop it);
one kept outside any run folder carries RUN's measurement and corpus only if it recorded that measurement itself.
Bad input (an earlier export as OUT without --overwrite, an OUT that holds anything but an earlier export, a
checkpoint that is not a drafter of this project, an invalid repo name, no token or no network for --push, a card
whose metadata (--license, --base-model) the Hub refuses with --push, a drafter that vLLM or SGLang would reject:
training/engines.py) stops with one line (exit status 2) before anything is written; --allow-engine-mismatch exports a
drafter the engines would reject anyway, and says so. The folder is built beside OUT and renamed into place after it
has been loaded back and checked, so a failure leaves nothing half-written; a failed push leaves the exported folder
intact and prints the --push-only command that retries it (with the push's --private and --replace-repo), except for
a card the Hub refuses, which --push-only refuses before creating the repo: that one is exported again.

This file is the command and the folder's assembly; training/checkpoint_paths.py finds the checkpoint and
training/checkpoints.py reads it, training/hub_config.py writes config.json, training/engines.py holds the engines'
rules and commands, training/hub.py talks to the Hub and training/model_card.py writes README.md.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from .arguments import answer_early, check_publish_args, publish_parser

# python -m: --help, a bad flag, RUN or --ckpt before torch and transformers load
answer_early(__name__, publish_parser, check_publish_args)

import torch
from huggingface_hub import HfApi
from transformers import AutoModel
from transformers.utils import HF_MODULES_CACHE

from ddtree.corpus import CORPUS_FILE
from ddtree.errors import DDTreeError, command, error_line
from ddtree.files import check_output_folder, finite_json, staged_folder
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import parse_dtype

from .checkpoint_paths import (abandoned_branch, check_run_folder, find_run_checkpoint, is_checkpoint, run_checkpoints,
                               run_folder_of)
from .checkpoints import Checkpoint, load_checkpoint, recorded_evaluation
from .engines import Export, engine_problems, refusal, serve_commands, target_facts, weight_shapes
from .export import checkpoint_corpus, record_trained_target, run_corpus
from .hub import check_card_fields, check_card_metadata, check_export_folder, check_repo_id, preflight_hub, push
from .hub_config import LIBRARY_DIR, REMOTE_CODE, hub_config, target_hub_id, verifier_for
from .model_card import (CardFacts, count_training_prompts, decoding_target, eval_folder, evaluated_steps,
                         evaluation_path, project_path, read_data_record, read_evaluation, read_run_config,
                         render_model_card, target_adapter, timer_seconds)
from .recipe_data import AUTO_DATA, default_data_path


def check_loads_back(folder: Path, drafter: DFlashDraftModel) -> None:
    """AutoModel with the shipped remote code, offline, must give back exactly the exported weights."""
    from ddtree.files import why_unwritable

    # AutoModel copies the remote code into the modules cache first: where it cannot (HF_HOME a shared read-only model
    # store, a read-only home on compute nodes), the load below failed as if the export did not load. transformers
    # reads HF_MODULES_CACHE once, at import, so the check cannot point it at a folder of its own.
    unwritable = why_unwritable(Path(HF_MODULES_CACHE))
    if unwritable is not None:
        raise DDTreeError(f"cannot check that the export loads: the Hugging Face modules cache {HF_MODULES_CACHE}, "
                          f"where AutoModel copies its remote code, cannot be written ({unwritable}); set "
                          "HF_MODULES_CACHE to a writable folder")
    try:
        loaded = AutoModel.from_pretrained(folder, trust_remote_code=True, local_files_only=True, dtype=drafter.dtype)
    except Exception as error:  # noqa: BLE001 - any failure means the folder is not usable as shipped
        raise DDTreeError(f"the export does not load with AutoModel(trust_remote_code=True): {error_line(error)}") from None
    finally:
        # transformers copied the remote code into its modules cache, under the (random) staging folder's
        # name, sanitised as in transformers.dynamic_module_utils: no later load can reuse that copy.
        copy = folder.name.replace(".", "_dot_").replace("-", "_hyphen_")
        shutil.rmtree(Path(HF_MODULES_CACHE) / "transformers_modules" / copy, ignore_errors=True)
    expected, found = drafter.state_dict(), loaded.state_dict()
    if expected.keys() != found.keys() or any(not torch.equal(expected[k], found[k]) for k in expected):
        raise DDTreeError("the export loads with AutoModel but its weights differ from the checkpoint's")


def check_trained_as_run(checkpoint: Checkpoint, run_dir: Path, run_config: dict) -> None:
    """A checkpoint exported with RUN's card and corpus was trained as RUN's config.yaml says: against its
    model.target, and, kept outside RUN, with (or without) its model.corpus. Where RUN has no config.yaml, nothing is
    compared."""
    if "model" not in run_config:
        return
    model, trained, path = run_config["model"] or {}, checkpoint.hyper_parameters, checkpoint.path
    fix = "give as RUN the run folder it was trained in (or export it alone: python -m training.export CKPT OUT)"
    # A checkpoint saved before the target was a hyper-parameter is left to record_trained_target's fit check.
    if trained.get("target") is not None and str(trained["target"]) != str(model.get("target")):
        if run_folder_of(path) is not None:  # RUN's own (find_run_checkpoint refused another run's): RUN is the one
            # it was trained in, so its config.yaml was edited since
            fix = ("it is one of RUN's own checkpoints, so its config.yaml was edited since training: restore its "
                   "model.target (--base-model owner/name names the target's Hub id on the card)")
        raise DDTreeError(f"CKPT {path} was trained against target {trained['target']!r}, but RUN={run_dir} against "
                          f"{model.get('target')!r} (model.target in its config.yaml): {fix}")
    # One of RUN's own checkpoints may have been trained otherwise than its config.yaml says: a resume may set or drop
    # model.corpus, and checkpoint_corpus ships RUN's corpus with those trained with it.
    if run_folder_of(path) is not None:  # (find_run_checkpoint refused another run's)
        return
    with_corpus, run_with_corpus = bool(trained.get("corpus")), bool(model.get("corpus"))
    if with_corpus != run_with_corpus:
        raise DDTreeError(f"CKPT {path} was trained {'with' if with_corpus else 'without'} model.corpus, but "
                          f"RUN={run_dir} {'with' if run_with_corpus else 'without'} it (its config.yaml): {fix}")


def same_measurement(checkpoint: Checkpoint, evaluation: dict) -> bool:
    """Whether the checkpoint's own training-time record of its step holds the acceptance `evaluation` reports."""
    recorded = recorded_evaluation(checkpoint)
    return recorded is not None and json.loads(json.dumps(finite_json(recorded["summary"]))) == evaluation["summary"]


def branch_checkpoints(checkpoint: Path) -> list[str]:
    """The checkpoints kept beside one of a branch a resume abandoned, named from the run's checkpoints/ folder."""
    folder = checkpoint.resolve().parent
    return sorted(f"{folder.name}/{path.name}" for path in folder.glob("*.ckpt") if is_checkpoint(path))


def training_data_path(run_dir: Path, run_config: dict) -> str | None:
    """The run's data.data_path as training read it, or None where its config.yaml names none: `auto` is the recipe's
    regenerated data (the recipe is the folder the run is in), a relative path is found as count_training_prompts
    finds it. The card's provenance line and its held-out check both read this one."""
    data_path = (run_config.get("data") or {}).get("data_path")
    if not data_path:
        return None
    # resolved: RUN given from inside its recipe's folder (`.`, or the run's name) has no parent name of its own
    recipe = run_dir.resolve().parent.name
    return str(default_data_path(recipe) if data_path == AUTO_DATA else project_path(data_path))


def evaluated_training_prompts(data_path: str | None, evaluation: dict) -> int | None:
    """How many of the evaluation's prompts are prompts of the run's training data (the card calls them held out only
    when none is); None, with a note, where that cannot be told here."""
    settings = evaluation["settings"]
    try:
        count = count_training_prompts(settings["prompts"], settings["num_prompts"], data_path)
    except DDTreeError as error:
        print(f"[export] note: the evaluated prompts were not compared with the training data ({error}); the card "
              "does not call them held out", file=sys.stderr)
        return None
    if count:
        print(f"[export] note: {count} of the {settings['num_prompts']} evaluated prompts are prompts of the training "
              f"data {data_path}; the card says so", file=sys.stderr)
    return count


def export_folder(
    run_dir: Path, checkpoint_path: tuple[Path, str], out: Path, *, speculators: bool = False,
    base_model: str | None = None, license_id: str = "apache-2.0", dtype: str = "float32", repo: str | None = None,
    allow_engine_mismatch: bool = False, hub: tuple[HfApi, str] | None = None,
) -> Path:
    """Write the Hub folder for one checkpoint of a run (find_run_checkpoint's path and label) to `out` (replacing it);
    return `out`. hub: (api, endpoint) of the push to come (preflight_hub), which first has the Hub check the card's
    metadata, so that a card every push of would fail is not exported."""
    path, label = checkpoint_path
    run_config = read_run_config(run_dir)
    checkpoint = load_checkpoint(path)
    check_trained_as_run(checkpoint, run_dir, run_config)
    drafter = checkpoint.drafter.to(parse_dtype(dtype, "--dtype")).eval()
    target = ((run_config.get("model") or {}).get("target") or checkpoint.hyper_parameters.get("target")
              or drafter.config.target_name_or_path)
    record_trained_target(drafter, target, path)
    base_model = target_hub_id(target, base_model)
    # A branch a resume abandoned (checkpoints/abandoned-after-step-N/) has its evaluations past step N in eval/ under
    # that folder's name: eval/ holds the current branch's, other drafters of the same steps.
    branch = abandoned_branch(path)
    branch_name = branch[1] if branch else None
    evaluation = read_evaluation(run_dir, checkpoint.step, path.stem, branch_name)
    if branch and evaluation is not None and "checkpoint" not in evaluation and not same_measurement(checkpoint,
                                                                                                     evaluation):
        # two resumes from one step number their eval/ and checkpoints/ folders apart where only one moved files
        print(f"[export] note: {evaluation_path(run_dir, checkpoint.step, branch_name)} is not the evaluation {path} "
              "recorded of its step; the card carries no measurement", file=sys.stderr)
        evaluation = None
    # A checkpoint inside a run folder is RUN's (find_run_checkpoint refused another run's). One kept outside any run
    # is taken as RUN's only where it recorded RUN's evaluation of its step itself: else that record, and RUN's
    # corpus, are another drafter's.
    runs_own = run_folder_of(path) is not None or (evaluation is not None and same_measurement(checkpoint, evaluation))
    if not runs_own:
        left_out = checkpoint.hyper_parameters.get("corpus") and run_corpus(run_dir) is not None
        print(f"[export] note: {path} is outside RUN={run_dir} and did not record RUN's evaluation of step "
              f"{checkpoint.step}, so it is not known to be RUN's: the card carries no measurement"
              + (f", and the export not RUN's {CORPUS_FILE}" if left_out else ""), file=sys.stderr)
        evaluation = None
    data_path = training_data_path(run_dir, run_config)
    training_prompts = evaluated_training_prompts(data_path, evaluation) if evaluation is not None else None
    # RUN's corpus where this checkpoint was trained with it (a resume that dropped model.corpus leaves the file), as
    # the plain export decides; one trained with it whose run lacks it is refused: its tau was measured grafting it
    corpus = checkpoint_corpus(path, run_dir, bool(checkpoint.hyper_parameters.get("corpus"))) if runs_own else None

    best = run_dir / "checkpoints" / "best.ckpt"
    with staged_folder(out) as staging:
        drafter.save_pretrained(staging)  # model.safetensors + config.json
        saved = json.loads((staging / "config.json").read_text())
        config = hub_config(saved, verifier_for(target, base_model) if speculators else None)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in REMOTE_CODE:
            shutil.copyfile(LIBRARY_DIR / name, staging / name)
        if corpus is not None:  # model.corpus: `ddtree` grafts from it by default
            shutil.copyfile(corpus, staging / CORPUS_FILE)
        served_target = target_facts(target, config)
        problems = engine_problems(Export(config, weight_shapes(staging), served_target))
        if problems and not allow_engine_mismatch:
            raise DDTreeError(refusal(problems))
        facts = CardFacts(
            name=(repo or out.name).split("/")[-1], repo=repo, target=target, base_model=base_model,
            license=license_id, drafter_config=config, num_parameters=sum(p.numel() for p in drafter.parameters()),
            dtype=dtype, step=checkpoint.step, checkpoint=label, hyper_parameters=checkpoint.hyper_parameters,
            run_config=run_config, evaluation=evaluation, training_prompts=training_prompts, data_path=data_path,
            other_evaluated_steps=evaluated_steps(run_dir, branch_name), outside_run=not runs_own,
            data_record=read_data_record(run_dir) if runs_own else None,
            trained_seconds=timer_seconds(checkpoint.callbacks),
            kept_checkpoints=branch_checkpoints(path) if branch else
            [path.name for path in sorted(run_checkpoints(run_dir), key=lambda p: p.name)],
            best_kept=best.exists(), exported_best=best.exists() and best.resolve() == path.resolve(),
            speculators=speculators, engine_problems=[problem.line() for problem in problems],
            rejected_by=list(dict.fromkeys(problem.rule.engine for problem in problems)),
            engine_target=served_target.source,
        )
        card = render_model_card(facts)
        if hub is not None:
            check_card_metadata(*hub, card, repo, refused="give a --license (LICENSE=) or --base-model (BASE_MODEL=) "
                                "the Hub takes (its reason names the field); nothing was exported or pushed",
                                unasked="check the network and HF_TOKEN; nothing was exported or pushed")
        (staging / "README.md").write_text(card)
        check_loads_back(staging, drafter)
    for problem in problems:
        print(f"[export] warning (--allow-engine-mismatch): {problem.line()}", file=sys.stderr)
    if served_target.hidden_size is None:
        print(f"[export] note: the engine rules were checked against {served_target.source}", file=sys.stderr)
    served = decoding_target(facts)  # the merge step's folder where training merged an adapter into the target
    for engine, line in serve_commands(config, served, repo or str(out)).items():
        if engine not in facts.rejected_by:  # the warning above says why there is no command for it
            print(f"[export] serve with {engine} (it verifies the chain): {line}")
    if target_adapter(facts):
        print(f"[export] note: {served} is {target} with the run's model.target_adapter merged, written by the merge "
              "step of the card's Usage"
              + ("; config.json's verifier (--speculators) is the base model alone, which `vllm serve` of the drafter "
                 "would serve: name the merged folder as above" if speculators else ""), file=sys.stderr)
    if evaluation is None:
        print(f"[export] note: step {checkpoint.step} has no evaluation in {eval_folder(run_dir, branch_name)}; the "
              "card says so",
              file=sys.stderr)
    if base_model is None:
        print(f"[export] note: target {target!r} has no Hub id; give --base-model owner/name so the card links it"
              + (" and vLLM can find the verifier" if speculators else ""), file=sys.stderr)
    return out


# ----------------------------------------------------------------------------- CLI


# The flags that shape the exported folder, which --push-only sends as it is.
EXPORT_FLAGS = ("ckpt", "speculators", "dtype", "base_model", "license", "overwrite", "allow_engine_mismatch")


@command
def main(argv: list[str] | None = None) -> int:
    parser = publish_parser()
    args = parser.parse_args(argv)
    if args.repo is not None:
        check_repo_id(args.repo)
    if args.push_only:
        if args.run or args.out:
            raise DDTreeError("--push-only takes the export folder only; drop RUN and --out")
        # they shape an export, and the folder goes up as it was exported: taken silently, the push would seem to
        # have sent (say) a bfloat16 or speculators export it did not
        given = [f"--{name.replace('_', '-')}" for name in EXPORT_FLAGS
                 if getattr(args, name) != parser.get_default(name)]
        if given:
            raise DDTreeError(f"--push-only pushes {args.push_only} as it was exported; drop {', '.join(given)}, or "
                              "export again with them (and --repo --push)")
        if not args.repo:
            raise DDTreeError("--push-only needs --repo user/name")
        folder = Path(args.push_only)
        check_export_folder(folder, args.repo)
        api, endpoint = preflight_hub(args.repo, args.private, args.replace_repo)
        print(f"[export] pushed {folder} to {push(api, endpoint, folder, args.repo, args.private, args.replace_repo)}")
        return 0
    if not args.run or not args.out:
        raise DDTreeError("give the run folder and --out (make export RUN=... OUT=...)")
    run_dir, out = Path(args.run), Path(args.out)
    check_run_folder(run_dir)
    checkpoint = find_run_checkpoint(run_dir, args.ckpt)  # (path, label): a copy kept outside the run too
    check_output_folder(out, args.overwrite, keep=(run_dir, checkpoint[0]))
    check_card_fields(args.base_model, args.license)
    if args.push and not args.repo:
        raise DDTreeError("--push needs --repo user/name (REPO=user/name)")
    if args.private and not args.push:
        raise DDTreeError("--private sets the visibility of a pushed repo; add --push (PUSH=1) or drop it")
    if args.replace_repo and not args.push:
        raise DDTreeError("--replace-repo lets a push replace another repo's files; add --push (PUSH=1) or drop it")
    hub = preflight_hub(args.repo, args.private, args.replace_repo) if args.push else None
    export_folder(
        run_dir, checkpoint, out, speculators=args.speculators, base_model=args.base_model,
        license_id=args.license, dtype=args.dtype, repo=args.repo, allow_engine_mismatch=args.allow_engine_mismatch,
        hub=hub,
    )
    print(f"[export] {out} written (load it with AutoModel.from_pretrained(..., trust_remote_code=True))")
    if hub is not None:
        print(f"[export] pushed to {push(*hub, out, args.repo, args.private, args.replace_repo)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
