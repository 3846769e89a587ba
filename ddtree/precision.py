"""Which precision is fast on this machine: bf16 where the hardware computes it fast (measured on a CPU), else fp32.

    choice = fast_precision("cpu")        # Choice(dtype=torch.bfloat16, reason="...") on an AMX Xeon
    choice.dtype, choice.lightning        # torch.bfloat16, "bf16-mixed"

On a GPU of compute capability 8.0 or later (Ampere on) the answer is bf16; a T4 or V100 (7.x) emulates it, and
gets fp32. On a CPU it depends on the chip: a Xeon with AMX runs a bf16 forward faster than fp32, an AVX2-only CPU
(most laptops, many AMD EPYCs) emulates bf16 and runs it several times slower (6.7x, measured on a SmolLM2-135M
forward on an AVX2 EPYC), and a 2-core Xeon with AVX512-BF16 but no AMX ran this proxy's bf16 matmul 1.64x slower
than fp32 (2026-12-03): the flag alone does not make bf16 fast. So the choice is measured, not assumed: a linear layer shaped like a small target's
MLP (512 tokens x 576 -> 1536) is timed in both dtypes on one thread, best of ten alternating calls after a
warm-up, about a fifth of a second in all. A target's forward is dominated by such matmuls, and the gap between
the two outcomes is wide (2x one way, 3-7x the other), so this proxy picks what a forward on the
real target would, without loading one. `torch.backends.cpu.get_cpu_capability()` alone cannot
tell: it reports "AVX512" for an AVX-512 chip with and without bf16 support.

Everything that runs the target uses this one rule: training (recipe `trainer.precision: auto`),
the feature store, the training-time evaluation (which decodes in the training dtype) and the
decoding CLI (`--dtype auto`). An explicit precision or dtype is never changed.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .names import AUTO

# Lightning's precision name for each dtype (the choice makes bf16 or fp32; fp16 is named for messages).
LIGHTNING_PRECISION = {torch.bfloat16: "bf16-mixed", torch.float32: "32-true", torch.float16: "16-mixed"}
# bf16 must beat fp32 by this factor to be chosen: on a tie, fp32 is exact and needs no casts.
BF16_MARGIN = 0.9


@dataclass(frozen=True)
class Choice:
    dtype: torch.dtype
    reason: str  # one line: what was measured or known

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def lightning(self) -> str:
        return LIGHTNING_PRECISION[self.dtype]


def time_linear(tokens: int = 512, features: int = 576, hidden: int = 1536, repeats: int = 10) -> dict[torch.dtype, float]:
    """Best wall time of one (tokens x features) @ (features x hidden) matmul in fp32 and in bf16, on the CPU.

    The two dtypes alternate call by call, so a burst of load from elsewhere hits both alike. On one thread: a matmul
    split across threads waits for its slowest, so load on any one core (another job on a 2-core machine) stretched
    the fp32 and bf16 calls unevenly. A 2-core Xeon without AMX, under a training run's load, read bf16 at 0.91-1.75x
    fp32 on two threads, and once 0.77x, which picked bf16, and at 1.57-2.17x on one (2026-12-03). The ratio is the
    cores' arithmetic, which one thread measures as well as many.
    """
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, features, generator=generator)
    w = torch.randn(hidden, features, generator=generator)
    inputs = {dtype: (x.to(dtype), w.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: float("inf") for dtype in inputs}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for call in range(repeats + 1):
            for dtype, (xd, wd) in inputs.items():
                started = time.perf_counter()
                torch.nn.functional.linear(xd, wd)
                if call > 0:  # call 0 warms up: kernels picked, memory allocated
                    best[dtype] = min(best[dtype], time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return best


_cpu_choice: Choice | None = None  # measured once per process
# The measured CPU choice, for the processes this one starts: Lightning's DDP launcher starts ranks 1..N-1 as copies of
# this command with this environment, and each measured alone (a two-process run read 1.22x and 3.18x), so on a
# borderline machine ranks could train in different precisions. Inherited, the choice is rank 0's everywhere.
INHERITED_CHOICE = "DDTREE_CPU_PRECISION"


def cpu_key() -> str:
    """What a CPU measurement holds for: this host, its CPU and the kernels torch picked on it."""
    from .machine import cpu_model_and_flags

    return f"{platform.node()} {cpu_model_and_flags()[0]} {torch.backends.cpu.get_cpu_capability()}"


def fast_precision(device: str | torch.device = "cpu", measure: Callable[[], dict[torch.dtype, float]] | None = None) -> Choice:
    """The precision that is fast on `device`; `measure() -> {dtype: seconds}` replaces the timing (tests)."""
    global _cpu_choice
    device = torch.device(device)
    if device.type == "cuda":
        # Ampere (8.0) on compute bf16 natively; torch.cuda.is_bf16_supported() also counts the emulation a T4 or V100
        # runs several times slower, and asks the current device rather than this one
        name, (major, minor) = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        if major >= 8:
            return Choice(torch.bfloat16, f"{name} (compute capability {major}.{minor}) computes bf16 natively")
        return Choice(torch.float32, f"{name} (compute capability {major}.{minor}) has no native bf16, which needs 8.0")
    if device.type != "cpu":
        return Choice(torch.float32, f"no measurement for device {device.type}; fp32 is always exact")
    if measure is None and _cpu_choice is None and os.environ.get(INHERITED_CHOICE):
        name, cpu, reason = (os.environ[INHERITED_CHOICE].split("\t") + ["", ""])[:3]
        # only one measured on the same CPU with the same kernels: a job started on another host with this
        # environment (sbatch's --export=ALL), or a child held to AVX2 (ATEN_CPU_CAPABILITY), measures afresh
        if name in ("bfloat16", "float32") and cpu == cpu_key():
            _cpu_choice = Choice(getattr(torch, name), f"{reason} (measured by the process that started this one)")
    if measure is None and _cpu_choice is not None:
        return _cpu_choice
    seconds = (measure or time_linear)()
    ratio = seconds[torch.bfloat16] / seconds[torch.float32]
    dtype = torch.bfloat16 if ratio < BF16_MARGIN else torch.float32
    # between the margin and 1 bf16 is faster yet fp32 is chosen: the line says why
    verdict = ("faster" if ratio < BF16_MARGIN else f"faster, but bf16 is chosen only below {BF16_MARGIN:g}x"
               if ratio < 1 else "slower")
    choice = Choice(dtype, f"on this CPU a bf16 matmul is {ratio:.2f}x the time of fp32 ({verdict}; "
                           f"{torch.backends.cpu.get_cpu_capability()})")
    if measure is None:
        _cpu_choice = choice
        os.environ[INHERITED_CHOICE] = f"{choice.name}\t{cpu_key()}\t{choice.reason}"
    return choice


def resolve_dtype(name: str, device: str | torch.device = "cpu", where: str = "--dtype") -> tuple[torch.dtype, str | None]:
    """A dtype by name, or the fast one for "auto"; returns (dtype, the one-line reason when it was chosen)."""
    from .errors import DDTreeError
    from .targets import DTYPES, parse_dtype

    if name == AUTO:
        choice = fast_precision(device)
        return choice.dtype, f"{where} auto -> {choice.name}: {choice.reason}"
    try:
        return parse_dtype(name, where), None
    except DDTreeError:  # the same refusal, naming auto too
        raise DDTreeError(f"{where}={name!r}: choose auto or one of {', '.join(DTYPES)}") from None
