"""The training system: distil a frozen target LLM into a block-diffusion (DFlash) drafter.

    module = DistillModule(target="tiny-random", num_layers=1, num_anchors=8)
    trainer = lightning.Trainer(max_steps=10); trainer.fit(module, datamodule)

One step (online features):
  1. the frozen target (eval mode, no grad) runs only up to its deepest chosen layer and returns
     those layers' hidden states, concatenated: (S, T, K*H);
  2. up to `num_anchors` anchors per sequence are drawn among reply tokens (fresh each step, from a
     generator seeded by (seed, epoch, batch, rank) so a resumed run draws the same ones);
  3. ONE drafter forward runs every block of every sequence under the sparse block mask
     (training/masks.py);
  4. the target's frozen LM head turns the counted block outputs into logits and the
     position-decayed cross-entropy trains the drafter (training/loss.py, block_loss_sums).

Offline features: when the batch carries `features` (the data module's feature store, built by
training/features.py with this same target_layer_features), step 1 is skipped; the target is
still loaded, for its embedding and LM head.

One option beyond the published recipe, off by default: distill_weight > 0 runs the target to the
end (or reads its final hidden states from the store), and its LM head gives, for every label, the
distribution it predicted that token from; the loss mixes in a loss against it (distill_loss: kl or
lk, training/loss.py). With distill_top_k k, against the target's k likeliest tokens only, which the
store keeps instead of the final hidden states (the teacher's LM head then leaves the step). It does
not change the exported drafter.

The target lives outside the module tree: it is never in `parameters()`, the optimizer or a
checkpoint, and `configure_model` reloads it from its source (name or folder, plus an optional
PEFT adapter merged at load). The drafter is the only nn.Module attribute that trains.

The class reads in the order of a run: setup, the step, training, validation, checkpoints.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

import lightning as L
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from ddtree.calibration import OnlineCalibration
from ddtree.corpus import CorpusLookup
from ddtree.decoding import DEFAULT_REDRAFT, DrafterRunner, drafter_defaults
from ddtree.drafters import load_drafter_folder
from ddtree.configuration_dflash import DFlashDrafterConfig
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.errors import DDTreeError
from ddtree.targets import build_drafter_config, check_drafter_fits

from .data import reply_vocabulary
from .feature_store import target_fingerprint
from .hub_config import drop_hub_fields
from .loss import (
    DISTILL_LOSSES, OBJECTIVES, RECALL_K, block_loss_sums, block_position_weights, chain_acceptance, draft_vocab_labels,
    given_positions, next_token_top_k, published_gamma, teacher_states,
)
from .masks import (
    IGNORE_INDEX, block_input_ids, block_labels, block_position_ids, dense_block_mask, flex_block_mask, given_labels,
    pad_for_flex, sample_anchors, sample_given,
)
from .peft_utils import DEFAULT_LORA_MODULES, adapter_fingerprint, add_drafter_lora
from .replay import RoundNLL, learn_calibration, replay_reply, reply_span
from .strategies import is_deepspeed
from .target import dtype_for_precision, load_frozen_target, logit_transform, target_layer_features


class NonFiniteError(RuntimeError):
    """The loss, the gradient norm or the weights stopped being finite; train.py prints it as one line, naming the
    run's newest checkpoint whose weights are finite."""


@dataclass
class FrozenTarget:
    """The target model kept OUT of the module tree (a plain object, not an nn.Module attribute)."""

    model: PreTrainedModel
    layer_ids: list[int]


class ForwardClock:
    """Times a forward (or a training step) without waiting for it: CUDA events on a GPU, read by the function `stop`
    returns (call it after the step, when the events are done or nearly); the host's clock elsewhere. The latest
    `stop` ends the span."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        if self.events:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> Callable[[], float]:
        if not self.events:
            elapsed = time.perf_counter() - self.started
            return lambda: elapsed
        start, end = self.start, torch.cuda.Event(enable_timing=True)
        end.record()

        def seconds() -> float:
            end.synchronize()
            return start.elapsed_time(end) / 1000

        return seconds


class StepResult(NamedTuple):
    loss: torch.Tensor  # scalar, the decayed cross-entropy of the batch
    weighted_ce: torch.Tensor  # its numerator and denominator, for exact sums over many batches
    weight_total: torch.Tensor
    hits: torch.Tensor  # (B,) top-1 hits per block position
    tokens: torch.Tensor  # (B,) counted tokens per block position
    top_hits: torch.Tensor  # (B,) labels within the drafter's top RECALL_K per block position
    target_seconds: Callable[[], float]  # the frozen target's forward time (0 with offline features), read after the step


def as_compared(value):
    """A config value as two configs are compared: a tuple and a list of the same items are equal."""
    return list(value) if isinstance(value, (list, tuple)) else value


def check_store_fields(target_layer_ids: list[int] | None, distill_weight: float, distill_loss: str,
                       distill_top_k: int) -> None:
    """The model fields that shape a feature store (its layers, its teacher), checked as DistillModule checks them:
    `make features` reads a recipe without building the module, and built stores for values training then refused."""
    # each named alone: one line for both once told a user of distill_weight 1.5 that distill_loss='kl' was wrong
    if distill_loss not in DISTILL_LOSSES:
        raise DDTreeError(f"model.distill_loss={distill_loss!r} must be one of {', '.join(DISTILL_LOSSES)}")
    if not 0 <= distill_weight <= 1:
        raise DDTreeError(f"model.distill_weight={distill_weight} must be in [0, 1]: the share of the loss against the "
                          "target's distribution (0 = none; the label's cross-entropy has the rest)")
    if target_layer_ids is not None and not target_layer_ids:  # `x or default` once took [] for the default layers
        raise DDTreeError(f"model.target_layer_ids={target_layer_ids} must be at least one layer, or unset")
    if distill_top_k < 0:
        raise DDTreeError(f"model.distill_top_k={distill_top_k} must be at least 0 (0 = the whole distribution)")


# What to do about trainer.max_steps=-1 with no epoch limit (training.recipe.check_values says it first)
NO_SCHEDULE_END = ("no trainer.max_epochs either leaves the learning-rate schedule no end; give a step count, "
                   "trainer.max_epochs, or trainer.max_time with model.anneal_by_max_time=true (the schedule then "
                   "follows the clock alone)")


def _grad_scaler(trainer):
    """fp16 mixed precision's GradScaler; None for bf16 and full precision."""
    return getattr(trainer.precision_plugin, "scaler", None)


class DistillModule(L.LightningModule):
    def __init__(
        self,
        # --- target
        target: str = "smollm2-135m",  # built-in name, local HF folder or Hub id of the frozen target
        target_adapter: str | None = None,  # PEFT adapter folder merged into the target at load
        target_dtype: str = "auto",  # "auto" follows the Trainer precision (bf16-mixed -> bfloat16)
        # --- drafter (None = 5 layers / block 16 / published layer ids / target's MASK, or init_from's)
        num_layers: int | None = None,
        block_size: int | None = None,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        draft_vocab_size: int | None = None,  # the drafter proposes only the N reply tokens seen most in training
        init_from: str | None = None,  # warm start from a drafter folder (save_pretrained format)
        lora_rank: int = 0,  # > 0: train LoRA adapters on init_from's layers instead of all weights
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        lora_target_modules: list[str] | None = None,  # default: every attention and MLP projection
        gradient_checkpointing: bool = False,  # recompute drafter layers in backward (long sequences)
        dropout: float = 0.0,  # training only: share of the fused context and residual branches zeroed (0 = published)
        compile: bool = False,  # the training forward of the drafter through torch.compile (docs/benchmarks.md, On a GPU)
        # --- objective
        num_anchors: int = 512,  # blocks per sequence (published: up to 512)
        gamma: float | None = None,  # loss decay over block positions; None = the published one for the block size
        #                              (7 for B=16, 5 for B=10, 4 for B=8; loss.published_gamma)
        distill_weight: float = 0.0,  # > 0: mix in a loss against the target's full distribution (loss.py)
        distill_loss: str = "kl",  # that loss: kl (cross-entropy to the target's softmax) or lk (-log acceptance rate)
        distill_top_k: int = 0,  # > 0: against the target's k likeliest tokens only, kept in the store (loss.py)
        objective: str = "decayed_ce",  # loss weights: decayed_ce (published), dpace, tree, frontier, intree (loss.py)
        objective_smoothing: float = 0.5,  # dpace/tree/intree: survival s -> (1 - a) s + a (D-PACE's a); frontier: the
        #                                    share of the decayed weights mixed in
        objective_top_k: int = 4,  # tree: a label within the drafter's top k at a depth keeps the path alive
        objective_budget: int = 32,  # frontier/intree: the nodes of the drafter's own tree the weights follow
        redraft_prob: float = 0.0,  # share of training blocks given their first draft token (for --redraft decoding)
        lookup: int = 0,  # decoders graft this many context-lookup tokens into every tree by default (`--lookup`)
        corpus: bool = False,  # ship the training replies with the drafter: decoders graft from them (`--corpus`)
        loss_chunk_size: int | None = None,  # LM head + loss over this many block tokens at a time
        calibrate: bool = False,  # fit per-position draft temperatures on replayed validation decoding (replay.py);
        #                           it takes the replies for the target's greedy ones: data whose regeneration.json
        #                           says sampled is refused, another target's noted (recipe.check_replay_data)
        replay_calibration: bool = False,  # learn decoding's calibration (lookups' acceptance, a draft temperature)
        #                                    on replayed validation decoding; decoders use it by default (replay.py);
        #                                    greedy replies only, as for calibrate
        seed: int = 0,  # seeds the anchor draws
        # --- optimisation (AdamW + linear warmup + cosine decay, stepped every optimizer step)
        lr: float = 6e-4,
        weight_decay: float = 0.0,  # not published; 0 keeps the recipe's stated settings
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_ratio: float = 0.04,
        min_lr_ratio: float = 0.0,  # cosine floor as a fraction of lr
        anneal_by_max_time: bool = False,  # the cosine ends when trainer.max_time stops the run, if that comes first
    ):
        super().__init__()
        self.save_hyperparameters()
        # The adapter's files as this launch merges them, kept in every checkpoint: its path alone let a resume, or
        # `make eval`, go on against an adapter retrained in place since, or dropped, without a word.
        self.hparams.target_adapter_sha256 = adapter_fingerprint(target_adapter)
        if objective not in OBJECTIVES:
            raise DDTreeError(f"model.objective={objective!r}: choose one of {', '.join(OBJECTIVES)}")
        check_store_fields(target_layer_ids, distill_weight, distill_loss, distill_top_k)
        if not 0 <= redraft_prob < 1:
            raise DDTreeError(f"model.redraft_prob={redraft_prob} must be in [0, 1): the share of training blocks "
                              "given their first draft token (0 = the published training)")
        if lookup < 0:
            raise DDTreeError(f"model.lookup={lookup} must be at least 0: the context-lookup tokens decoders graft "
                              "into every tree by default (0 = none)")
        if not 0 <= dropout < 1:
            raise DDTreeError(f"model.dropout={dropout} must be in [0, 1): the share of the drafter's activations "
                              "zeroed in training (0 = none)")
        # Values no drafter can have stop here, by name; before, `x or default` silently replaced some (0, []) and
        # lora_rank -1 trained without LoRA. None (unset) takes the default.
        unset_or = lambda value, fits: value is None or fits(value)  # noqa: E731
        for name, value, fits, rule in [
            ("num_layers", num_layers, unset_or(num_layers, lambda v: v >= 1), "at least 1, or unset"),
            ("block_size", block_size, unset_or(block_size, lambda v: v >= 2),
             "at least 2 (an anchor and a drafted token), or unset"),
            ("draft_vocab_size", draft_vocab_size, unset_or(draft_vocab_size, lambda v: v >= 1), "at least 1, or unset"),
            ("loss_chunk_size", loss_chunk_size, unset_or(loss_chunk_size, lambda v: v >= 1), "at least 1, or unset"),
            ("num_anchors", num_anchors, num_anchors >= 1, "at least 1"),
            ("lora_rank", lora_rank, lora_rank >= 0, "at least 0 (0 = no LoRA)"),
            # the adapters' settings, where there are adapters: a recipe without LoRA is not refused for them.
            # peft scales the adapters by alpha/rank, so alpha 0 trained nothing (every gradient 0)
            ("lora_alpha", lora_alpha, lora_rank <= 0 or lora_alpha > 0, "above 0"),
            ("lora_dropout", lora_dropout, lora_rank <= 0 or 0 <= lora_dropout < 1, "in [0, 1)"),
            ("lora_target_modules", lora_target_modules, lora_rank <= 0 or unset_or(lora_target_modules, lambda v: len(v) >= 1),
             "at least one module name, or unset (every attention and MLP projection)"),
            ("gamma", gamma, unset_or(gamma, lambda v: v > 0), "above 0, or unset (the published one for the block size)"),
            ("weight_decay", weight_decay, weight_decay >= 0, "at least 0"),
            ("warmup_ratio", warmup_ratio, 0 <= warmup_ratio < 1, "in [0, 1)"),
            # the cosine's floor, a share of lr: below 0 the lr went negative (AdamW ascended), above 1 past the peak
            ("min_lr_ratio", min_lr_ratio, 0 <= min_lr_ratio <= 1, "in [0, 1]"),
            # each named alone: one line for the three named the two that were fine as if they were not
            ("objective_smoothing", objective_smoothing, 0 <= objective_smoothing <= 1, "in [0, 1]"),
            ("objective_top_k", objective_top_k, objective_top_k >= 1, "at least 1"),
            ("objective_budget", objective_budget, objective_budget >= 1, "at least 1"),
        ]:
            if not fits:
                raise DDTreeError(f"model.{name}={value} must be {rule}")
        if lora_rank > 0 and not init_from:
            # Only the adapters train: without a warm start every other weight (fc, the norms, the projections
            # under the adapters) stayed at its random init for the whole run, which exported without a word.
            raise DDTreeError(f"model.lora_rank={lora_rank} adapts a trained drafter and model.init_from is unset, so "
                              "the rest of a new, random drafter would never train: give model.init_from=<drafter "
                              "folder>, or set model.lora_rank=0")
        self._gamma_given = gamma is not None  # else configure_model sets the published one for the block size
        self.drafter: nn.Module | None = None  # built in configure_model
        # A warm start's --resume: the checkpoint's drafter config (training/train.py sets it), built from instead of
        # model.init_from's folder, since the checkpoint restores every weight
        self.resumed_drafter_config: dict | None = None
        self._compiled_drafter = None  # compile=True: torch.compile's wrapper of it (see training_drafter)
        self._target: FrozenTarget | None = None
        self._step_clock: ForwardClock | None = None  # from on_train_batch_start
        self._step_seconds: Callable[[], float] | None = None  # to the end of backward or the optimizer step
        self._step_loss: torch.Tensor | None = None  # the last training step's loss, checked before the optimizer
        self._target_seconds: Callable[[], float] | None = None  # its target forward's time
        self._batch_tokens = 0
        self._step_lr = 0.0  # the learning rate this batch's optimizer step takes, from on_train_batch_start
        self._val_sums: dict[str, torch.Tensor] = {}
        # anneal_by_max_time: how far along trainer.max_time's warm-up share and its cosine are (update_time_progress)
        self._time_warmup = self._time_progress = 0.0

    # ------------------------------------------------------------------ setup

    def frozen_target_dtype(self) -> torch.dtype:
        """The dtype the frozen target is loaded in, and decoded in by the evaluation: model.target_dtype, else the
        trainer precision's."""
        return dtype_for_precision(self._trainer.precision if self._trainer else None, self.hparams.target_dtype)

    def configure_model(self) -> None:
        """Load the frozen target and build (or warm-start) the drafter; runs once per process."""
        if self.drafter is not None:
            return
        hp = self.hparams
        model, tokenizer = load_frozen_target(hp.target, self.frozen_target_dtype(), hp.target_adapter)

        if hp.init_from:
            if self.resumed_drafter_config is not None:
                # A resume: the checkpoint restores every weight (LoRA's frozen base too) into the drafter its run
                # built, as load_checkpoint does, so the folder, which may have moved or gone since, is not read again.
                config = DFlashDrafterConfig.from_dict(self.resumed_drafter_config)
                check_drafter_fits(config, model, "of the checkpoint resumed")  # resumed under another target
                drafter = DFlashDraftModel(config).float()
            else:
                # checked, one-line errors; built for a target of another depth too, as it is trained against this one
                drafter = load_drafter_folder(Path(hp.init_from), torch.float32, target=model, retarget=True)
            # from_pretrained returns it in eval mode, and Lightning 2.6 no longer calls .train() as fit starts (nor
            # do the evaluations, which put back the flags they found): model.dropout and gradient_checkpointing,
            # which act in training mode only, did nothing in every warm start. LoRA freezes the base by requires_grad.
            drafter.train()
            self._check_matches_folder(drafter.config)
            drop_hub_fields(drafter.config)  # an export's: its old verifier, its remote code (hub_config adds them anew)
            # replayed, or fitted, for the folder's weights, not for these once trained
            drafter.config.calibration = drafter.config.draft_temperatures = None
            # trained from here against this run's target (check_drafter_fits checked it fits): the folder's own
            # record named the target it was trained for, which export, card and engine checks would then read
            drafter.config.target_name_or_path = hp.target
            drafter.config.num_target_layers = model.config.get_text_config().num_hidden_layers
        else:
            config = build_drafter_config(
                model, tokenizer, hp.target,
                num_layers=hp.num_layers or 5,
                block_size=hp.block_size or 16,
                target_layer_ids=hp.target_layer_ids,
                mask_token_id=hp.mask_token_id,
            )
            if hp.draft_vocab_size:
                config.draft_vocab = self._training_reply_vocabulary(config.vocab_size)
            drafter = DFlashDraftModel(config)
        # Decoding defaults only, training never reads them (docs/decoding.md): this run's, a warm start's too. Set
        # only where on, a warm start kept the folder's, which model.lookup=0 and model.redraft_prob=0 could not turn off.
        drafter.config.redraft = DEFAULT_REDRAFT if hp.redraft_prob > 0 else 0  # decoders re-draft behind that many
        drafter.config.lookup = hp.lookup
        if hp.gradient_checkpointing:
            drafter.gradient_checkpointing = True
        drafter.dropout = hp.dropout
        if hp.gamma is None:  # the block size is known now (init_from's, if it gave one): kept in the checkpoint
            hp.gamma = published_gamma(drafter.config.block_size)
        if hp.lora_rank > 0:
            drafter = add_drafter_lora(
                drafter, hp.lora_rank, hp.lora_alpha, hp.lora_dropout, hp.lora_target_modules or DEFAULT_LORA_MODULES
            )
        self.drafter = drafter
        self._target = FrozenTarget(model, list(self.drafter_config.target_layer_ids))

    def _check_matches_folder(self, config) -> None:
        """A warm start takes its shape from the folder; an explicit, different setting is a user error."""
        hp = self.hparams
        for field, wanted, found in [
            ("num_layers", hp.num_layers, config.num_hidden_layers),
            ("block_size", hp.block_size, config.block_size),
            ("target_layer_ids", hp.target_layer_ids, config.target_layer_ids),
            ("mask_token_id", hp.mask_token_id, config.mask_token_id),
        ]:
            if wanted is not None and (list(wanted) if field == "target_layer_ids" else wanted) != found:
                raise DDTreeError(
                    f"model.{field}={wanted} but init_from {hp.init_from} has {found}; "
                    f"drop model.{field} or set it to {found}"
                )
        if hp.draft_vocab_size and not config.draft_vocab:
            raise DDTreeError(f"model.draft_vocab_size={hp.draft_vocab_size} but init_from {hp.init_from} drafts from the "
                              "whole vocabulary (its own vocabulary is kept when it has one): drop model.draft_vocab_size")
        # kept, so another size went unused, while config.yaml (read by make ablate, the step estimates) recorded it
        if hp.draft_vocab_size and config.draft_vocab and hp.draft_vocab_size != len(config.draft_vocab):
            raise DDTreeError(f"model.draft_vocab_size={hp.draft_vocab_size} but init_from {hp.init_from} drafts from "
                              f"its own {len(config.draft_vocab)} tokens, which a warm start keeps; drop "
                              f"model.draft_vocab_size or set it to {len(config.draft_vocab)}")

    def _training_reply_vocabulary(self, vocab_size: int) -> list[int]:
        """model.draft_vocab_size's vocabulary, from the training split (the same on every rank and on resume)."""
        size = self.hparams.draft_vocab_size
        if size >= vocab_size:  # it would restrict nothing, yet every decode would scatter into -inf logits
            raise DDTreeError(f"model.draft_vocab_size={size} is not below the target's vocabulary of {vocab_size} "
                              "tokens: leave it unset to draft from the whole vocabulary, or give fewer")
        datamodule = self._trainer.datamodule if self._trainer else None
        if getattr(datamodule, "train_split", None) is None:
            raise DDTreeError(f"model.draft_vocab_size={self.hparams.draft_vocab_size} is chosen from the training data: "
                              "fit with a DistillDataModule (training.train does), or leave it unset")
        return reply_vocabulary(datamodule.train_split, self.hparams.draft_vocab_size, vocab_size)

    @property
    def drafter_config(self):
        return self.drafter.config

    def base_drafter(self) -> DFlashDraftModel:
        """The DFlashDraftModel under a LoRA wrapper, or the drafter itself."""
        return self.drafter.get_base_model() if hasattr(self.drafter, "get_base_model") else self.drafter

    @property
    def target_layer_ids(self) -> list[int]:
        """The target layers whose features the drafter reads (its config's target_layer_ids)."""
        return self._target.layer_ids

    @property
    def block_size(self) -> int:
        return self.drafter_config.block_size

    @property
    def target(self) -> PreTrainedModel:
        """The frozen target, moved lazily to this module's device (it is not a submodule, so Lightning won't)."""
        model = self._target.model
        if model.get_input_embeddings().weight.device != self.device:
            model.to(self.device)
        return model

    def configure_optimizers(self):
        hp = self.hparams
        trainable = [p for p in self.drafter.parameters() if p.requires_grad]
        # Fused: one kernel per step instead of a dozen per tensor (a drafter step 10-13% shorter on a 2-core EPYC).
        # Not under DeepSpeed, which steps the optimizer itself, nor with fp16's GradScaler, whose unscaling
        # a fused step would do itself (configure_gradient_clipping).
        fused = not is_deepspeed(self.trainer.strategy) and _grad_scaler(self.trainer) is None
        optimizer = torch.optim.AdamW(trainable, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay,
                                      fused=fused)
        total_steps = self.trainer.estimated_stepping_batches
        if math.isinf(total_steps):  # trainer.max_steps=-1 and no epoch limit: only max_time can end the schedule
            if not (hp.get("anneal_by_max_time") and self._timer() is not None):
                raise DDTreeError(f"trainer.max_steps=-1: {NO_SCHEDULE_END}")
            warmup_steps = math.inf if hp.warmup_ratio else 0  # the steps never get anywhere: the clock alone
        else:
            total_steps = max(1, int(total_steps))
            warmup_steps = math.ceil(hp.warmup_ratio * total_steps)

        def lr_factor(step: int) -> float:
            # anneal_by_max_time: whichever is further along, the steps or the clock, in the warm-up as in the
            # cosine (the clock's are 0 without it)
            if step < warmup_steps and self._time_warmup < 1:
                return max((step + 1) / warmup_steps, self._time_warmup)
            progress = 0.0 if math.isinf(total_steps) else (step - warmup_steps) / max(1, total_steps - warmup_steps)
            progress = min(1.0, max(progress, self._time_progress))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def update_time_progress(self, every_rank_now: bool = False) -> None:
        """model.anneal_by_max_time: set how far along trainer.max_time is, which the cosine follows where it is
        further along than the steps. A machine too slow for max_steps is stopped by max_time; without this, at
        whatever learning rate the step schedule had reached there (about half the peak where the steps would take
        twice max_time). With it, such a run anneals by its stop.

        The clock's first warmup_ratio share of max_time is its warm-up, the rest its cosine: where max_time would
        cut inside the warm-up steps (max_steps far past the budget), the rate still reaches its peak and anneals by
        the stop. Where the steps end well before max_time (the recipe's 5600 steps take 16 of its 20 minutes on the
        Xeon), the steps stay ahead and nothing changes.
        The clock is Lightning's Timer (the one max_time adds), which a checkpoint carries, so a resumed run goes on
        from the time already spent. Called before each optimizer step (once per step under gradient accumulation),
        whose scheduler step then reads it. With several ranks every rank takes rank 0's value, broadcast every 10
        steps and at the start of training (every_rank_now), so their learning rates agree.
        """
        hp = self.hparams
        if not hp.get("anneal_by_max_time"):
            return
        timer = self._timer()
        remaining = timer.time_remaining() if timer is not None else None
        if remaining is None:  # no max_time: the steps alone
            return
        elapsed = timer.time_elapsed()
        share = elapsed / max(elapsed + remaining, 1e-9)
        if self.trainer.world_size > 1:
            if self.global_step % 10 and not every_rank_now:
                return
            share = self.trainer.strategy.broadcast(share)
        self._time_warmup = min(1.0, share / hp.warmup_ratio) if hp.warmup_ratio else 1.0
        self._time_progress = min(1.0, max(0.0, (share - hp.warmup_ratio) / (1 - hp.warmup_ratio)))

    def _timer(self) -> Timer | None:
        """The Timer trainer.max_time adds; None without max_time."""
        return next((c for c in self.trainer.callbacks if isinstance(c, Timer)), None)

    def on_train_start(self) -> None:
        self.update_time_progress(every_rank_now=True)  # a resumed run's clock, before its first step

    def on_fit_start(self) -> None:
        self.check_ranks_precision()
        store = getattr(self.trainer.datamodule, "store", None)
        if store is not None:
            self.check_feature_store(store)

    def check_ranks_precision(self) -> None:
        """Every rank trains in one precision, its target in one dtype. Under trainer.precision auto on CPUs, a rank
        that srun or torchrun starts times its own matmuls (the ranks Lightning starts inherit rank 0's choice), and on
        a machine near the margin two ranks chose bf16-mixed and 32-true: each trained, decoded and measured tau
        otherwise, with no error. Refused in one line on every rank, before the first step."""
        if self.trainer.world_size <= 1 or not torch.distributed.is_initialized():
            return
        mine = f"{self.trainer.precision}, target in {str(self.frozen_target_dtype()).removeprefix('torch.')}"
        every = [None] * self.trainer.world_size
        torch.distributed.all_gather_object(every, mine)
        if len(set(every)) > 1:
            ranks = "; ".join(f"rank {rank} {value}" for rank, value in enumerate(every))
            raise DDTreeError(f"the ranks would train in different precisions ({ranks}): trainer.precision auto "
                              "measured each rank's CPU on its own; give every rank one, --trainer.precision=32-true "
                              "(or bf16-mixed)")

    def check_feature_store(self, store) -> None:
        """Offline features must be what this drafter reads online; a mismatch would train on the wrong layers."""
        hp = self.hparams
        if hp.distill_weight > 0 and hp.distill_top_k and store.teacher_top_k != hp.distill_top_k:
            raise DDTreeError(f"model.distill_top_k={hp.distill_top_k} needs the target's top {hp.distill_top_k} next "
                              f"tokens, and feature store {store.path} holds its top {store.teacher_top_k}: rebuild it with "
                              "`make features RECIPE=<recipe>` (a recipe that distils builds them) and --force (FORCE=1), "
                              "or train online (no data.feature_store)")
        if hp.distill_weight > 0 and not hp.distill_top_k and not store.final_hidden:
            raise DDTreeError(f"model.distill_weight={hp.distill_weight} needs the target's final hidden states, which "
                              f"feature store {store.path} does not hold: rebuild it with `make features RECIPE=<recipe>` "
                              "(a recipe that distils builds them) and --force (FORCE=1), or train online (no data.feature_store)")
        weights = target_fingerprint(hp.target)
        adapter = adapter_fingerprint(hp.target_adapter)
        # A target or adapter folder copied elsewhere (a node's local disk) is the same one where its files are
        same_target = store.target == hp.target or (weights is not None and store.target_weights == weights)
        same_adapter = (store.target_adapter == hp.target_adapter
                        or (adapter is not None and store.target_adapter_sha256 == adapter))
        if not (same_target and same_adapter):
            raise DDTreeError(f"feature store {store.path} holds features of target {store.target} (adapter "
                              f"{store.target_adapter}), this run's is {hp.target} (adapter {hp.target_adapter}): "
                              "rebuild it with `make features RECIPE=<recipe>` and --force (FORCE=1)")
        if hp.target_adapter and store.target_adapter_sha256 != adapter:
            raise DDTreeError(f"feature store {store.path} was built with adapter {hp.target_adapter} as its files were "
                              "then, and they have changed since (retrained?) or were not recorded (an older store): "
                              "rebuild it with `make features RECIPE=<recipe>` and --force (FORCE=1)")
        if store.target_weights is not None and store.target_weights != weights:
            raise DDTreeError(f"feature store {store.path} was built from target {hp.target}'s weights as they were then, "
                              "and its weight files have changed since (fine-tuned and saved over?): rebuild it with "
                              "`make features RECIPE=<recipe>` and --force (FORCE=1)")
        transform = logit_transform(self.target.config)
        if hp.distill_weight > 0 and hp.distill_top_k and store.teacher_logits != transform:
            raise DDTreeError(f"feature store {store.path} holds the target's top {store.teacher_top_k} next tokens with "
                              f"logit transform {store.teacher_logits or 'none'}, and its forward applies "
                              f"{transform or 'none'} (stores built before the teacher applied it hold the softmax of the "
                              "LM head's raw output): rebuild it with `make features RECIPE=<recipe>` and --force "
                              "(FORCE=1), or train online (no data.feature_store)")
        layer_ids = list(self.drafter_config.target_layer_ids)
        text_config = self.target.config.get_text_config()
        last = text_config.num_hidden_layers - 1
        if last in store.layer_ids and not store.last_layer_normed:
            raise DDTreeError(f"feature store {store.path} holds target layer {last}, the last, as the layer's raw "
                              "output; decoding reads it normed (the decoder's final output), as training now does: "
                              "rebuild it with `make features RECIPE=<recipe>` and --force (FORCE=1)")
        width = len(layer_ids) * text_config.hidden_size
        target_dtype = self.target.dtype
        if store.dtype != target_dtype:  # usable (the batches are cast), but not what this run's target computes
            print(f"[features] {store.path} holds {str(store.dtype).removeprefix('torch.')} features and this run's "
                  f"target computes in {str(target_dtype).removeprefix('torch.')}: they are cast, so the drafter trains "
                  "on other roundings than it reads at inference (rebuild with `make features RECIPE=<recipe>` and "
                  "--force (FORCE=1) to match)", flush=True)
        if store.layer_ids != layer_ids or store.width != width:
            raise DDTreeError(f"feature store {store.path} holds target layers {store.layer_ids} ({store.width} features "
                              f"per token), the drafter reads layers {layer_ids} ({width}): set model.target_layer_ids="
                              f"{store.layer_ids} or rebuild the store with `make features RECIPE=<recipe>` and --force (FORCE=1)")

    # ------------------------------------------------------------------ the step

    def block_hidden_states(
        self,
        features: torch.Tensor,  # (S, T, K*H) target features of the whole sequence
        input_ids: torch.Tensor,  # (S, T)
        anchors: torch.Tensor,  # (S, n)
        given: torch.Tensor | None = None,  # (S, n) draft tokens each block is given after its anchor (block_input_ids)
    ) -> torch.Tensor:
        """Drafter outputs for every block of every sequence in one forward: (S, n*B, H)."""
        context_len, num_blocks = input_ids.shape[1], anchors.shape[1]
        if features.is_cuda:
            # Fixed shapes, so one compiled flex kernel serves every batch: (S, W, K*H), (S, num_anchors).
            features, anchors = pad_for_flex(features, anchors, self.hparams.num_anchors)
            if given is not None:  # the padding blocks are given nothing
                given = F.pad(given, (0, anchors.shape[1] - given.shape[1]))
            context_len = features.shape[1]
            mask = flex_block_mask(anchors, context_len, self.block_size)
        else:
            mask = dense_block_mask(anchors, context_len, self.block_size)  # (S, 1, n*B, T + n*B)
        block_ids = block_input_ids(input_ids, anchors, self.block_size, self.drafter_config.mask_token_id, given)
        with torch.no_grad():  # the target's embedding is frozen; no gradient needed at the input
            noise_embedding = self.target.get_input_embeddings()(block_ids)  # (S, n*B, H)
        position_ids = block_position_ids(context_len, anchors, self.block_size)  # (S, T + n*B)
        hidden = self.training_drafter()(
            noise_embedding=self.in_drafter_dtype(noise_embedding), target_hidden=self.in_drafter_dtype(features),
            position_ids=position_ids, attention_mask=mask,
        )
        return hidden[:, : num_blocks * self.block_size]  # the padding blocks, if any, cut off

    def in_drafter_dtype(self, target_output: torch.Tensor) -> torch.Tensor:
        """A target output (features, embeddings) as the drafter's weights take it. Under a mixed precision autocast
        meets the two; under a "true" one nothing does, and model.target_dtype may differ from the drafter's
        (bfloat16 beside trainer.precision 32 failed in the drafter's first matmul)."""
        if torch.is_autocast_enabled(target_output.device.type):
            return target_output
        return target_output.to(next(self.drafter.parameters()).dtype)

    def training_drafter(self):
        """The drafter as the training forward calls it: with model.compile, torch.compile's wrapper.

        On CUDA the batch is padded to fixed shapes (pad_for_flex), so one graph serves every step and fuses
        the drafter's many small kernels (on an H200 the step from stored features took 0.032 s compiled against
        0.047 s eager, for a 19M-parameter drafter). Decoding (the evaluation, export) keeps calling the plain
        module, whose shapes change every round. Kept out of the module tree, so checkpoints hold the drafter's
        own keys only. On the CPU the batch keeps its own length (the dense mask; padding would cost compute),
        so the graph is compiled shape-generic: compiled for each length, it would recompile every step until
        dynamo's limit of 8 and then run eager. There (the CPU default, 2-core EPYC, bf16, batches of 250-384
        tokens, a probe of 40 steps) a step took 0.135 s against 0.150 s eager, after 46 s of compiling: over
        5600 steps about 40 s saved, 4% of the launch, so the CPU recipe leaves it off.
        """
        if not self.hparams.get("compile"):
            return self.drafter
        if self._compiled_drafter is None:
            self.__dict__["_compiled_drafter"] = torch.compile(self.drafter, dynamic=self.device.type != "cuda")
        return self._compiled_drafter

    def _step_seed(self, batch_idx: int, stage: str, stream: int = 0) -> int:
        """A seed for this micro-batch on this rank: the same in an uninterrupted run and in a resumed one. `stream`
        keeps two consumers (0: the anchors, 1: dropout) off one random sequence."""
        # Validation reuses one draw per batch so its numbers compare across evaluations.
        # (hash of a tuple of ints is the same in every process; a str in it would not be.)
        epoch = self.current_epoch if stage == "train" else -1
        key = (self.hparams.seed, epoch, batch_idx, self.global_rank) + ((stream,) if stream else ())
        return hash(key) & 0x7FFF_FFFF_FFFF

    def _anchor_generator(self, batch_idx: int, stage: str) -> torch.Generator:
        return torch.Generator().manual_seed(self._step_seed(batch_idx, stage))

    def sequence_features(self, batch: dict, teacher: bool = False):
        """(target features (S, T, K*H), the teacher's source or None, a function giving the seconds the target's
        forward took: ForwardClock's, to call after the step, when reading them waits for nothing).

        From the batch when a feature store serves it (0 seconds), else from the frozen target's forward. The
        teacher's source (teacher=True) is the final hidden states (S, T, H), or, from a store with
        model.distill_top_k, the target's top k after each token, ((S, T, k) ids, (S, T, k) log-probabilities).
        """
        if "features" in batch:  # offline store: the dtype the target's own forward gives
            features = batch["features"].to(self.device, self.target.dtype)
            source = None
            if teacher and self.hparams.distill_top_k:
                source = batch["teacher_ids"].to(self.device), batch["teacher_log_probs"].to(self.device)
            elif teacher:
                source = batch["final_hidden"].to(self.device, self.target.dtype)
            return features, source, lambda: 0.0
        clock = ForwardClock(batch["input_ids"].device)
        # Without autocast, as the store is built and decoding runs the target: under a mixed precision Lightning's
        # autocast would run an fp32 target's (model.target_dtype float32) matmuls in bf16, other features than those.
        with torch.autocast(batch["input_ids"].device.type, enabled=False):
            features = target_layer_features(self.target, batch["input_ids"], self.target_layer_ids, final_hidden=teacher)
        features, final = features if teacher else (features, None)
        return features, final, clock.stop()

    def block_predictions(self, batch: dict, batch_idx: int, stage: str, distill: bool = False):
        """(drafter outputs (S, n*B, H), labels (S, n, B), the teacher per block token or None: states (S, n*B, H),
        or with model.distill_top_k ((S, n*B, k) ids, log-probabilities), the target forward's seconds as a function
        to call after the step).

        None if the batch has no block to learn from. The anchors are drawn as for `stage`.
        """
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        generator = self._anchor_generator(batch_idx, stage)
        # Anchors first: drawing them waits on the device once (their count), and after that nothing in the step
        # does until the optimizer, so on a GPU the drafter's launches queue up behind the target's forward.
        anchors, valid = sample_anchors(loss_mask, self.hparams.num_anchors, generator)
        if anchors.shape[1] == 0:
            return None  # no reply token with a successor anywhere in the batch: nothing to learn
        labels = block_labels(input_ids, loss_mask, anchors, valid, self.block_size)  # (S, n, B)
        # Validation measures the plain blocks alone, so runs with and without re-draft training compare.
        given = sample_given(anchors, self.hparams.redraft_prob, generator) if stage == "train" else None
        if given is not None:
            labels = given_labels(labels, given)
        if stage == "train" and self.trainer_world_size() == 1 and not self.has_learnable_label(labels):
            # Re-drafting gave away every label, or every one is outside the draft vocabulary: a zero loss would
            # still step AdamW (its momentum moves the weights) and log train/loss 0. With several
            # processes the zero loss stays: a rank that skipped its backward would leave the others waiting in
            # the gradient all-reduce.
            return None
        features, source, target_seconds = self.sequence_features(batch, distill)
        if stage == "train" and self.hparams.dropout:
            # Dropout draws from torch's global generator, which no checkpoint holds (a resumed run drew the first
            # launch's masks again) and which every rank seeds alike: seeded here per micro-batch and rank.
            torch.manual_seed(self._step_seed(batch_idx, stage, stream=1))
        hidden = self.block_hidden_states(features, input_ids, anchors, given)  # (S, n*B, H)
        teacher = None
        if isinstance(source, tuple):  # the store's top k
            teacher = tuple(teacher_states(t, anchors, self.block_size) for t in source)  # (S, n*B, k) each
        elif distill:
            teacher = teacher_states(source, anchors, self.block_size)  # (S, n*B, H)
            if self.hparams.distill_top_k:  # online: what the store would hold, at the block tokens only
                with torch.autocast(teacher.device.type, enabled=False):  # as the store computes it (sequence_features)
                    teacher = next_token_top_k(teacher, self.target.get_output_embeddings(), self.hparams.distill_top_k,
                                               target_config=self.target.config)
        return hidden, labels, teacher, target_seconds

    def trainer_world_size(self) -> int:
        return self._trainer.world_size if self._trainer is not None else 1

    def has_learnable_label(self, labels: torch.Tensor) -> bool:
        """Whether any label of (S, n, B) is one the drafter can propose. It waits on the device, as the anchor count
        does, before the target's forward is queued."""
        lm_head = self.target.get_output_embeddings()
        draft_head = self.base_drafter().draft_head(lm_head)
        if draft_head is not None:
            labels = draft_vocab_labels(labels, draft_head[0], lm_head.weight.shape[0])
        return bool((labels != IGNORE_INDEX).any())

    def shared_step(self, batch: dict, batch_idx: int, stage: str) -> StepResult | None:
        """Loss and counts of one batch (stage "train" or "val"); None if the batch has no block to learn from."""
        # Validation measures the label cross-entropy alone, so runs with and without distillation compare.
        distill = self.hparams.distill_weight > 0 and stage == "train"
        predictions = self.block_predictions(batch, batch_idx, stage, distill)
        if predictions is None:
            return None
        hidden, labels, teacher, target_seconds = predictions
        teacher_top = teacher if isinstance(teacher, tuple) else None
        hp = self.hparams
        # Validation always measures the published decayed CE, at the published decay for the block size, so runs of
        # different objectives and gammas compare (at the run's own gamma, a lower one read lower on the same weights).
        objective = hp.objective if stage == "train" else "decayed_ce"
        gamma = hp.gamma if stage == "train" else published_gamma(self.block_size)
        weights = block_position_weights(self.block_size, gamma, device=hidden.device)  # (B,)
        lm_head = self.target.get_output_embeddings()
        if not torch.is_autocast_enabled(hidden.device.type):  # into the head in its dtype (see in_drafter_dtype)
            hidden = hidden.to(lm_head.weight.dtype)
        draft_head = self.base_drafter().draft_head(lm_head)
        read = None  # the positions each block reads: block_loss_sums finds them from the labels, unless...
        unproposable = 0  # (B,) validation's labels outside the draft vocabulary: a miss at every decode
        if draft_head is not None:  # logits over the draft vocabulary only; labels outside it are not counted
            if objective != "decayed_ce":  # ...the vocabulary drops a first label, which ends the chain (not given)
                read = given_positions(labels != IGNORE_INDEX)
            token_ids, rows = draft_head
            in_draft_vocab = draft_vocab_labels(labels, token_ids, lm_head.weight.shape[0])
            if stage == "val":  # counted as tokens with no hit, so val/acc_k and val/recall4_k are decoding's rates
                unproposable = ((labels != IGNORE_INDEX) & (in_draft_vocab == IGNORE_INDEX)).sum(dim=(0, 1))
            labels = in_draft_vocab
            if teacher_top:  # the teacher's tokens as rows of the draft head too; the others get p = 0
                teacher_top = draft_vocab_labels(teacher_top[0], token_ids, lm_head.weight.shape[0]), teacher_top[1]
            lm_head = partial(F.linear, weight=rows)
        weighted, weight_total, hits, tokens, top_hits = block_loss_sums(
            hidden, labels, lm_head, weights, hp.loss_chunk_size,
            None if teacher_top else teacher, hp.distill_weight if distill else 0.0, objective, hp.objective_smoothing,
            hp.objective_top_k, hp.distill_loss, hp.objective_budget, read, teacher_top, self.target.config,
        )
        return StepResult(weighted / weight_total.clamp_min(1e-8), weighted, weight_total, hits, tokens + unproposable,
                          top_hits, target_seconds)

    # ------------------------------------------------------------------ training

    def on_train_batch_start(self, batch, batch_idx):
        self._step_clock, self._step_seconds = ForwardClock(batch["input_ids"].device), None
        self._step_loss = self._target_seconds = None  # set by training_step (not when a batch has no block)
        mask = batch.get("attention_mask")
        self._batch_tokens = int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        # Read here, not where it is logged: Lightning steps the scheduler before on_train_batch_end, where the rate
        # is the next step's (train/lr put the warm-up's second rate at step 0, and the floor at the last step).
        self._step_lr = self.trainer.optimizers[0].param_groups[0]["lr"]

    def training_step(self, batch: dict, batch_idx: int):
        result = self.shared_step(batch, batch_idx, "train")
        if result is None:
            return None
        loss, hits, tokens = result.loss, result.hits, result.tokens
        self._step_loss, self._target_seconds = loss.detach(), result.target_seconds  # checked, logged after backward
        accuracy = hits[1:].float() / tokens[1:].clamp_min(1).float()  # (B-1,)
        size = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        # An estimate from the blocks' top-1 accuracies (loss.chain_acceptance), named apart from the decoded
        # val/tau_dflash: on the tiny target the two once read 1.03 and 7.50 side by side.
        self.log("train/tau_chain_estimate", chain_acceptance(accuracy), prog_bar=True, batch_size=size)
        if self._logs_written():
            self.log_dict({f"train/acc_{k}": accuracy[k - 1] for k in range(1, self.block_size)}, batch_size=size)
        return loss

    def _logs_written(self) -> bool:
        """Whether this step's logs are written (every trainer.log_every_n_steps steps). The values a step logs
        are that step's own, so the details no progress bar shows are logged on those steps only: a self.log
        call costs about 0.27 ms of host time (2-core EPYC), and 17 of them were 4 ms of every step."""
        connector = getattr(self.trainer, "_logger_connector", None)  # Lightning's own test (2.6)
        return True if connector is None else connector.should_update_logs

    def on_after_backward(self):
        self._step_seconds = self._step_clock.stop()  # a micro-batch that accumulates ends here (no optimizer step)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)  # runs the closure (training_step, backward), then steps
        self._step_seconds = self._step_clock.stop()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # Step time spans forward, backward and (on the last micro-batch) the optimizer step, and nothing after it:
        # Lightning runs the callbacks' on_train_batch_end before this hook, and at an evaluation step they have
        # decoded every prompt and saved a checkpoint (seconds on the CPU recipe, minutes on the 8B ones), which a
        # clock read here counted. (A micro-batch with no block to learn runs no backward: timed to here.)
        seconds = (self._step_seconds or self._step_clock.stop())()
        if self._logs_written():
            if self._target_seconds is not None:
                self.log("perf/target_forward_s", self._target_seconds())
            self.log("perf/step_s", seconds)
        self.log("perf/target_tok_s", self._batch_tokens / seconds, prog_bar=True)
        self.log("train/lr", self._step_lr, prog_bar=True)
        if is_deepspeed(self.trainer.strategy):
            self._check_deepspeed_grad_norm()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if not (gradient_clip_val and optimizer.param_groups[0].get("fused")):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        # Lightning's mixed-precision plugin refuses to clip for any fused optimizer, guarding against a
        # GradScaler; the optimizer is fused only where there is none (configure_optimizers), so clip with
        # the plain precision plugin's clipping, which that guard wraps.
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
        Precision.clip_gradients(self.trainer.precision_plugin, optimizer, gradient_clip_val, algorithm)

    def on_before_optimizer_step(self, optimizer):
        self.update_time_progress()  # the scheduler steps after this optimizer step, from the clock read now
        # Checked here, after backward was queued, not in training_step: reading the loss waits for the GPU.
        if self._step_loss is not None and not torch.isfinite(self._step_loss):
            raise NonFiniteError(
                f"training stopped at step {self.global_step}: the loss is {self._step_loss.item()}"
            )
        # Lightning clips after this hook; a non-finite norm here would be clipped into NaN weights.
        grads = [p.grad for p in self.drafter.parameters() if p.grad is not None]
        if not grads:  # DeepSpeed keeps gradients in its own partitions: see _check_deepspeed_grad_norm
            return
        # One foreach kernel over all gradients, not two launches per parameter (a GPU step is launch-bound).
        self._check_grad_norm(torch.nn.utils.get_total_norm(grads).float())

    def _check_deepspeed_grad_norm(self) -> None:
        # DeepSpeed measures the norm in its step and skips a step whose gradient is not finite
        # (bf16 check_grad_overflow), so the weights are still good; training stops here all the same.
        norm = self.trainer.strategy.deepspeed_engine.get_global_grad_norm()  # None before the first step
        if norm is not None:
            self._check_grad_norm(torch.as_tensor(norm, dtype=torch.float32))

    def _check_grad_norm(self, norm: torch.Tensor) -> None:
        if not torch.isfinite(norm):
            raise NonFiniteError(
                f"training stopped at step {self.global_step}: the gradient norm is {norm.item()}"
            )
        self.log("train/grad_norm", norm)

    # ------------------------------------------------------------------ validation

    def on_validation_epoch_start(self):
        # Zeros, not nothing: every rank joins the sums at the end, also one whose batches held no block to count.
        # One tensor each: the reduce sums in place, so shared zeros would carry one sum into the next.
        shapes = {"weighted_ce": (), "weight_total": (), "hits": self.block_size, "tokens": self.block_size,
                  "top_hits": self.block_size}
        self._val_sums = {name: torch.zeros(shape, device=self.device) for name, shape in shapes.items()}

    def validation_step(self, batch: dict, batch_idx: int):
        result = self.shared_step(batch, batch_idx, "val")
        if result is None:
            return
        for name in self._val_sums:
            self._val_sums[name] = self._val_sums[name] + getattr(result, name).detach().float()

    def on_validation_epoch_end(self):
        # Each rank validated its own share of the split (DistillDataModule.val_dataloader): the sums are over all.
        sums = {name: self.trainer.strategy.reduce(value, reduce_op="sum") for name, value in self._val_sums.items()}
        if not sums["tokens"].any():
            return  # no rank had a block to count
        accuracy = sums["hits"][1:] / sums["tokens"][1:].clamp_min(1)
        self.log("val/loss", sums["weighted_ce"] / sums["weight_total"].clamp_min(1e-8), prog_bar=True)
        self.log("val/tau_chain_estimate", chain_acceptance(accuracy), prog_bar=True)
        self.log_dict({f"val/acc_{k}": accuracy[k - 1] for k in range(1, self.block_size)})
        recall = sums["top_hits"][1:] / sums["tokens"][1:].clamp_min(1)
        self.log_dict({f"val/recall{RECALL_K}_{k}": recall[k - 1] for k in range(1, self.block_size)})

    @torch.no_grad()
    def calibrate_draft_temperatures(self, batches, budget: int, max_new_tokens: int, stop_ids: list[int] = (),
                                     lookup: int | None = None, redraft: int | None = None,
                                     corpus: CorpusLookup | None = None) -> list[float]:
        """Fit and set the drafter's per-position temperatures (config.draft_temperatures) on `batches`.

        Tree decoding with `budget` nodes and `max_new_tokens` is replayed over each validation reply
        (training/replay.py) as `generate` decodes it with the drafter's defaults (lookup, redraft: None = the
        drafter's; corpus: the one it ships), as fit_replayed_calibration replays it, and each block position 1..B-1
        gets the temperature of CALIBRATION_TEMPERATURES with the least label NLL over the rounds that reached it,
        summed over ranks; a position no round reached keeps 1. Rounds start after a rejection, where decoding
        measures acceptance, not at uniform anchors, and end at an accepted stop_ids token as decoding does. Past
        depth 1 a round's rows are those its tree ranks the reply's path by: a re-drafted block's, which decoding
        divides by the same temperatures, where one was drafted behind the reply's first token. Returns them.
        Weights and argmaxes are unchanged.
        """
        drafter = self.base_drafter()
        fit = RoundNLL(self.block_size)
        runner = DrafterRunner(drafter, self.target, calibrated=False, corpus=corpus, calibration=False)
        # Without them the rounds were others than decoding runs: 184 against its 143, on the CPU recipe's drafter
        lookup, redraft, corpus = drafter_defaults("ddtree", runner, lookup, redraft, False, None)
        # Decoding's numerics: no autocast (the runner casts the bf16 features and head itself).
        with torch.autocast(self.device.type, enabled=False):
            for batch in batches:
                batch = {name: value.to(self.device) for name, value in batch.items()}
                features = self.sequence_features(batch)[0]  # (S, T, K*H)
                for row in range(features.shape[0]):
                    span = reply_span(batch["loss_mask"][row])
                    if span is not None:
                        replay_reply(runner, features[row], batch["input_ids"][row], *span, budget, max_new_tokens, fit,
                                     stop_ids, lookup=lookup, corpus=corpus, redraft=redraft)
        if self._trainer is not None:  # summed over ranks (called outside a fit: this process's alone)
            fit.nll = self.trainer.strategy.reduce(fit.nll.to(self.device), reduce_op="sum").cpu()
            fit.counts = self.trainer.strategy.reduce(fit.counts.to(self.device), reduce_op="sum").cpu()
        temperatures = fit.best()
        drafter.config.draft_temperatures = temperatures
        return temperatures

    @torch.no_grad()
    def fit_replayed_calibration(self, batches, budget: int, max_new_tokens: int, stop_ids: list[int] = (),
                                 lookup: int | None = None, redraft: int | None = None,
                                 corpus: CorpusLookup | None = None) -> OnlineCalibration:
        """Learn decoding's calibration on the validation `batches` (replay.learn_calibration) and keep it in the
        drafter's config (config.calibration), where decoders find it. Every rank replays the same replies, so every
        rank keeps the same. Weights and argmaxes are unchanged."""
        drafter = self.base_drafter()
        drafter.config.calibration = None  # learned afresh, never from the last evaluation's

        def sequences():
            for batch in batches:
                batch = {name: value.to(self.device) for name, value in batch.items()}
                features = self.sequence_features(batch)[0]  # (S, T, K*H)
                for row in range(features.shape[0]):
                    yield features[row], batch["input_ids"][row], batch["loss_mask"][row]

        runner = DrafterRunner(drafter, self.target, corpus=corpus, calibration=False)
        with torch.autocast(self.device.type, enabled=False):  # decoding's numerics (see calibrate_draft_temperatures)
            settled = learn_calibration(runner, sequences(), budget, max_new_tokens, stop_ids, lookup, redraft)
        # What the tree was replayed with (learn_calibration resolves the same), kept as calibration.json keeps it:
        # a decoder with other lookups or re-drafting is told its expected tau is priced for another tree.
        lookup, redraft, corpus = drafter_defaults("ddtree", runner, lookup, redraft, False, None)
        state = {**settled.state(), "decoded_with": {"lookup": lookup, "redraft": redraft, "corpus": corpus is not None}}
        # Every rank replayed the same replies; rank 0's result is kept everywhere all the same, so that a last-bit
        # difference between ranks can never leave them decoding with different trees.
        state = self.trainer.strategy.broadcast(state) if self._trainer is not None else state
        drafter.config.calibration = state
        return OnlineCalibration.from_state(state)

    # ------------------------------------------------------------------ checkpoints

    # What a resume cannot change: the drafter's shape and what it reads (config field -> the setting that sets it).
    # Another shape was a load_state_dict traceback; another block size or layer ids trained on silently, and the
    # run's config.yaml then named settings its first steps never had. (DeepSpeed's engine loads its shards strictly,
    # before on_load_checkpoint: there training/train.py's RefuseUnfitResume checks first, from the client state
    # saved beside them.)
    RESUME_FIXED = {
        "num_hidden_layers": "model.num_layers", "block_size": "model.block_size",
        "target_layer_ids": "model.target_layer_ids", "mask_token_id": "model.mask_token_id",
        "draft_vocab": "model.draft_vocab_size", "hidden_size": "model.target", "vocab_size": "model.target",
        "num_target_layers": "model.target",
    }
    # Hyper-parameters a resume cannot change (-> the settings that set them). The seed splits the data (data.seed,
    # kept equal to model.seed): another split would train on the replies that validate and pick the best checkpoint.
    # Lightning restores the optimizer's groups and the schedule's base rates from the checkpoint, so another lr,
    # betas or weight_decay went unused while config.yaml and the model card recorded it (warmup_ratio and
    # min_lr_ratio live in the schedule's function and do change).
    # The loss (gamma, the objective and its settings, distillation): config.yaml, report.md's train-loss note and the
    # model card then named it as the whole run's, though its steps before the resume trained on another loss. A
    # checkpoint older than a setting does not record it, and resumes as before.
    RESUME_FIXED_HPARAMS = {"lora_rank": "model.lora_rank", "lora_alpha": "model.lora_alpha",
                            "lora_target_modules": "model.lora_target_modules", "seed": "model.seed and data.seed",
                            "lr": "model.lr", "betas": "model.betas", "weight_decay": "model.weight_decay",
                            "gamma": "model.gamma", "objective": "model.objective",
                            **{name: f"model.{name}" for name in (
                                "objective_smoothing", "objective_top_k", "objective_budget", "distill_weight",
                                "distill_loss", "distill_top_k")}}
    # The target's adapter (model.target_adapter) is fixed too (check_resume_adapter): the steps before a resume
    # learned the adapted target, and with it dropped or retrained the rest learned another.

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # Lightning restores a checkpoint into the module configure_model built, after this hook.
        self.check_resume(checkpoint)

    def check_resume(self, checkpoint: dict) -> None:
        """Refuse, in one line, a resume whose launch would change the checkpoint's drafter, data split, optimizer or
        loss (gamma, the objective and its settings, distillation)."""
        saved = checkpoint.get("drafter_config")
        if saved is None or self.drafter is None:
            return
        saved_config, built = DFlashDrafterConfig.from_dict(saved), self.base_drafter().config
        changed = {}
        for field, setting in self.RESUME_FIXED.items():
            was, now = (as_compared(getattr(config, field, None)) for config in (saved_config, built))
            if was != now and field == "draft_vocab" and was and now and len(was) == len(now):
                # the same size, other tokens: model.draft_vocab_size picked them from another training split
                changed.setdefault("the data's overrides (data.*)", f"a draft vocabulary of {len(was)} other tokens "
                                   "(this launch's training split is not the run's)")
            elif was != now:
                shown = [f"{len(v)} tokens" if isinstance(v, list) and field == "draft_vocab" else v for v in (was, now)]
                changed.setdefault(setting, f"{field} {shown[0]} (this launch: {shown[1]})")
        hparams = checkpoint.get("hyper_parameters") or {}
        for name, setting in self.RESUME_FIXED_HPARAMS.items():
            was, now = as_compared(hparams.get(name)), as_compared(self.hparams.get(name))  # betas: a list or a tuple
            if name == "gamma" and not self._gamma_given and "model.block_size" in changed:
                continue  # unset, it follows the block size, refused above
            if name in hparams and was != now:
                changed.setdefault(setting, f"{name} {was} (this launch: {now})")
        self.check_resume_adapter(hparams, changed)
        if changed:
            raise DDTreeError(f"--resume: the checkpoint's run has {'; '.join(changed.values())}: a resume keeps the "
                              f"run's drafter, data split, optimizer and loss; drop {', '.join(sorted(changed))} from the "
                              "command, or start a new run")

    def check_resume_adapter(self, hparams: dict, changed: dict) -> None:
        """The checkpoint's target adapter is this launch's: by its files where both recorded them (a copy at another
        path is the same adapter), else by its path. One retrained in place is refused here, with its own remedy;
        another path, or none, joins `changed`."""
        if "target_adapter" not in hparams:  # a checkpoint older than the option
            return
        adapter, files = self.hparams.get("target_adapter"), self.hparams.get("target_adapter_sha256")
        was_adapter, was_files = hparams.get("target_adapter"), hparams.get("target_adapter_sha256")
        if was_files is not None and files is not None:
            if was_files == files:
                return
            if was_adapter == adapter:
                raise DDTreeError(f"--resume: the checkpoint's run trained against target adapter {adapter} as its "
                                  "files were then, and they have changed since (retrained?): a resume keeps the "
                                  "run's target; put back the adapter it trained against, or start a new run")
        if was_adapter != adapter:
            changed.setdefault("model.target_adapter", f"target_adapter {was_adapter} (this launch: {adapter})")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # The target never goes into a checkpoint (it is not a submodule; this guards against regressions),
        # and the drafter config travels with it so export needs no target.
        leaked = [key for key in checkpoint["state_dict"] if not key.startswith("drafter.")]
        for key in leaked:
            del checkpoint["state_dict"][key]
        checkpoint["drafter_config"] = self.base_drafter().config.to_dict()
