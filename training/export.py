"""Export a trained drafter as a Hugging Face folder that `ddtree bench --drafter <folder>` loads.

    python -m training.export outputs/smollm2-135m/<run>/checkpoints/last.ckpt outputs/my-drafter [--overwrite]
    export_drafter(module_or_checkpoint_path, out_dir, overwrite=False)

A checkpoint holds the drafter only (never the target) plus its config, so exporting needs no
target. LoRA adapters, if the run trained them, are merged into the weights first. The folder is
written beside its destination and renamed into place, so a failed export leaves nothing behind.
It replaces an earlier export only when told (--overwrite, overwrite=True), and never a folder
holding anything else.
A run whose recipe set model.corpus holds <run>/corpus.safetensors; the export of a checkpoint trained with it
carries it (for a run's checkpoints/x.ckpt or hpc_ckpt_N.ckpt, found there).
For the Hub (remote code, model card, push) see training/publish.py. Bad input prints one line and
exits with status 2.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from ddtree.corpus import CORPUS_FILE
from ddtree.errors import CommandParser, DDTreeError, command
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.files import check_output_folder, staged_folder

from .checkpoint_paths import run_folder_of
from .checkpoints import load_checkpoint
from .engines import target_facts
from .hub_config import drop_hub_fields
from .peft_utils import merged_drafter


def run_corpus(run_dir: Path) -> Path | None:
    """The run's corpus.safetensors (written where its recipe set model.corpus), or None."""
    corpus = Path(run_dir) / CORPUS_FILE
    return corpus if corpus.is_file() else None


def checkpoint_corpus(checkpoint: Path, run_dir: Path | None, trained_with_corpus: bool) -> Path | None:
    """The corpus an export of `checkpoint` carries: its run's (run_corpus) where it was trained with model.corpus, or
    None. A resume may set or drop model.corpus, so a run can hold one beside checkpoints trained and measured without
    it: theirs would decode otherwise, grafting it by default. A checkpoint trained with model.corpus whose run lacks
    it is refused, and one outside its run folder is noted: its tau was measured grafting from the corpus."""
    corpus = run_corpus(run_dir) if run_dir is not None else None
    if not trained_with_corpus:
        if corpus is not None:
            print(f"note: {checkpoint} was trained without model.corpus: the export leaves out {corpus}",
                  file=sys.stderr)
        return None
    if corpus is None:
        if run_dir is not None:
            raise DDTreeError(f"{checkpoint} was trained with model.corpus, but {run_dir / CORPUS_FILE} is missing: the "
                              "export would decode differently from what the run measured; put the run's corpus back")
        print(f"note: {checkpoint} was trained with model.corpus and is outside its run folder: the export carries no "
              "corpus, so it decodes without the replies its run grafted from", file=sys.stderr)
    return corpus


def record_trained_target(drafter: DFlashDraftModel, target: str | None, path: Path) -> None:
    """Make the drafter's config name the target the run trained it against (its hyper-parameters' model.target).

    A drafter warm-started (model.init_from) before the warm start took the run's target kept the folder's target name
    and depth; it fitted the run's target (check_drafter_fits), so the name and depth are taken from the run's target.
    One that does not fit it (read here; when it cannot be, nothing is compared) is not that run's drafter.
    """
    recorded = drafter.config.target_name_or_path
    if target is None or recorded == target:
        return
    facts = target_facts(target, drafter.config.to_dict())
    if facts.hidden_size is not None:
        layers = facts.num_hidden_layers
        if drafter.config.hidden_size != facts.hidden_size or max(drafter.config.target_layer_ids) >= layers:
            raise DDTreeError(
                f"CKPT {path}: its drafter (hidden size {drafter.config.hidden_size}, target layers "
                f"{drafter.config.target_layer_ids}, built for {recorded!r}) does not fit the run's model.target "
                f"{target!r} (hidden size {facts.hidden_size}, {layers} layers): give a checkpoint of a run trained "
                f"against {target!r}")
        drafter.config.num_target_layers = layers
    drafter.config.target_name_or_path = target


def export_drafter(source, out_dir: str | Path, corpus: Path | None = None, overwrite: bool = False) -> Path:
    """Write `source` (a DistillModule, a drafter nn.Module or a checkpoint path) to out_dir; return out_dir.

    corpus: a run's corpus.safetensors, copied in beside the weights (decoders graft from it by default); a checkpoint
    path inside a run folder carries its run's (checkpoint_corpus).
    overwrite: replace an earlier export in out_dir. A folder holding anything an export does not write, the working
    folder, or the checkpoint's run is refused even then (check_output_folder), as `python -m training.export` does:
    this function replaced whatever out_dir was, a mistyped `exports` with every export in it.
    """
    out_dir = Path(out_dir)
    if isinstance(source, (str, Path)):
        checkpoint = Path(source)
        run_dir = run_folder_of(checkpoint)  # checkpoints/x.ckpt or a SLURM requeue's hpc_ckpt_N.ckpt
        check_output_folder(out_dir, overwrite, keep=(run_dir or checkpoint,), name="out_dir")
        loaded = load_checkpoint(checkpoint)
        drafter = loaded.drafter
        # a run warm-started by an earlier version kept the starting drafter's target and depth: decoding refuses those
        record_trained_target(drafter, loaded.hyper_parameters.get("target"), checkpoint)
        if corpus is None:
            corpus = checkpoint_corpus(checkpoint, run_dir, bool(loaded.hyper_parameters.get("corpus")))
    else:
        check_output_folder(out_dir, overwrite, name="out_dir")
        drafter = merged_drafter(getattr(source, "drafter", source))
    # A checkpoint of a run warm-started from a Hub export before warm starts dropped its Hub fields still holds them:
    # an auto_map pointing at remote code this folder lacks, speculators fields naming the old verifier.
    drop_hub_fields(drafter.config)
    with staged_folder(out_dir) as staging:
        drafter.save_pretrained(staging)
        if corpus is not None:
            shutil.copyfile(corpus, staging / CORPUS_FILE)
    return out_dir


@command
def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .ckpt file (or DeepSpeed checkpoint folder) written by training/train.py")
    parser.add_argument("out_dir", help="folder to write (an earlier export in it only with --overwrite; refused "
                        "if it holds anything else)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in out_dir")
    args = parser.parse_args(argv)
    out = export_drafter(args.checkpoint, args.out_dir, overwrite=args.overwrite)
    print(f"drafter written to {out}" + (f", with the run's {CORPUS_FILE}" if (out / CORPUS_FILE).is_file() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
