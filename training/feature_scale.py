"""Train the drafter's feature projection `fc` as if every target feature had unit scale.

Why: LLM hidden states carry "massive activations": a few dimensions hundreds of times larger than
the rest (SmolLM2-135M, layers 14-27: RMS ~1800 in 3 of 2880 feature dims against a median of ~5;
the first token reaches 25000). Through a randomly initialised `fc`, those few dimensions make up
half of every context vector, so the contexts of all positions look alike (mean cosine 0.63; 0.11
after per-dimension scaling) and Adam, which moves every weight at the same rate, keeps them loud.

What: `fc.weight` is re-parametrised as W * inv_rms[None, :] (torch.nn.utils.parametrize), with
inv_rms = 1 / RMS of each feature dimension measured once on the first training batch. Adam then
trains W against unit-scale features. The function is unchanged in form: `folded_copy` writes
W * inv_rms back into a plain `fc.weight`, which is what export saves, so a trained folder
is an ordinary DFlash drafter that reads raw target features at inference. Only the trainable-fc
case uses it (with LoRA, fc is frozen).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class FeatureScale(nn.Module):
    """Parametrization of fc.weight (H, K*H): effective weight = trained weight * inv_rms per input column."""

    def __init__(self, num_features: int):
        super().__init__()
        self.register_buffer("inv_rms", torch.ones(num_features))
        self.register_buffer("calibrated", torch.tensor(False))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.inv_rms.to(weight.dtype)


def has_feature_scale(drafter: nn.Module) -> bool:
    return parametrize.is_parametrized(drafter.fc, "weight")


def add_feature_scale(drafter: nn.Module) -> None:
    """Re-parametrise drafter.fc.weight in place (identity until calibrated)."""
    parametrize.register_parametrization(drafter.fc, "weight", FeatureScale(drafter.fc.in_features))


def scale_of(drafter: nn.Module) -> FeatureScale:
    return drafter.fc.parametrizations.weight[0]


@torch.no_grad()
def calibrate_feature_scale(
    drafter: nn.Module,
    sum_squares: torch.Tensor,  # (K*H,) sum over real tokens of feature**2 (summed over ranks)
    num_tokens: torch.Tensor,  # () number of tokens in that sum
    keep_function: bool,
) -> None:
    """Set inv_rms from feature statistics, once.

    keep_function=False (a fresh drafter): the random W now acts on unit-scale features, which is the
    point. keep_function=True (a warm start): W is rescaled so the effective fc.weight does not change.
    """
    scale = scale_of(drafter)
    rms = (sum_squares.float() / num_tokens.clamp_min(1)).sqrt()
    # A dimension that is (nearly) always zero would get a huge factor; floor it at 1% of the median RMS.
    rms = rms.clamp_min(1e-2 * rms.median().clamp_min(1e-6))
    if keep_function:
        drafter.fc.parametrizations.weight.original.mul_(rms.to(drafter.fc.parametrizations.weight.original.dtype))
    scale.inv_rms.copy_(1.0 / rms)
    scale.calibrated.fill_(True)


def folded_copy(drafter: nn.Module) -> nn.Module:
    """A new plain drafter whose fc.weight is the effective (folded) weight; `drafter` is left as it is.

    Built from the config and a rewritten state dict rather than by copy.deepcopy, because a deep copy
    of a parametrized module shares its injected class, and removing the parametrization from the
    copy would remove it from the original too.
    """
    state = drafter.state_dict()
    if has_feature_scale(drafter):
        weight = state.pop("fc.parametrizations.weight.original")
        inv_rms = state.pop("fc.parametrizations.weight.0.inv_rms")
        state.pop("fc.parametrizations.weight.0.calibrated")
        state["fc.weight"] = weight * inv_rms.to(weight.dtype)
    plain = type(drafter)(drafter.config).to(dtype=next(iter(state.values())).dtype)
    plain.load_state_dict(state, strict=True)
    return plain.to(next(drafter.parameters()).device)
