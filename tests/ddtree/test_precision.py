"""The line `--dtype auto` prints for its CPU choice (ddtree/precision.py) says why bf16 was or was not chosen. The
choice itself, and the overrides of it, are tested in tests/training/test_precision_choice.py.

    .venv/bin/pytest -q tests/ddtree/test_precision.py
"""

import pytest
import torch

from ddtree.precision import BF16_MARGIN, fast_precision


@pytest.mark.parametrize("ratio, dtype, verdict", [
    (0.5, torch.bfloat16, "(faster; "),
    (0.95, torch.float32, f"(faster, but bf16 is chosen only below {BF16_MARGIN:g}x; "),
    (BF16_MARGIN, torch.float32, f"(faster, but bf16 is chosen only below {BF16_MARGIN:g}x; "),
    (1.5, torch.float32, "(slower; "),
], ids=["fast", "within the margin", "at the margin", "slow"])
def test_the_reason_says_when_bf16_is_faster_but_not_by_the_margin(ratio, dtype, verdict):
    """Found in a review of the fixed-shape paths: at 0.95x the line said bf16 was "faster" while picking fp32, and
    named no margin, so a reader could not tell why fp32 was chosen."""
    choice = fast_precision("cpu", measure=lambda: {torch.float32: 1.0, torch.bfloat16: ratio})
    assert choice.dtype == dtype
    assert choice.reason.startswith(f"on this CPU a bf16 matmul is {ratio:.2f}x the time of fp32 {verdict}")
