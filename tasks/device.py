"""Where PyTorch trains and evaluates: the device ``train.device`` picks, its precision, and the
data-parallel launch of ``train.processes`` ranks through ``accelerate``.

``auto`` is CUDA when ``torch.cuda.is_available()``, else the CPU. On a GPU that computes bf16
(``torch.cuda.is_bf16_supported()``: Ampere and later) fine-tuning runs under bf16 autocast, the
LoRA weights and the optimizer state staying fp32; elsewhere it is fp32, and on the CPU the same seed
gives the same adapter bytes. Evaluation's PyTorch scores run on the same device in fp32 (no autocast):
they are the reference the engine's parity and the weight-quantization gates compare against.

With ``train.processes`` > 1 the fine-tune stage re-runs itself under ``accelerate launch`` (one
process per rank; on the CPU over the gloo backend), unless it already is one of those ranks. Only
such a rank creates an ``accelerate.Accelerator``: accelerate keeps one state per process that cannot
change device or precision once made, and one process may train on the CPU and then on a GPU (the
GPU check does). Autocast is therefore ``Placement.autocast``, the same with one rank or many.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Literal

from tasks.config import ConfigError

# torch.distributed.run (what `accelerate launch` starts the ranks with) sets this in every rank.
RANK_ENV = "WORLD_SIZE"


@dataclass(frozen=True)
class Placement:
    device: Literal["cpu", "cuda"]
    precision: Literal["fp32", "bf16"]  # of the training forward: bf16 is autocast, the weights stay fp32
    reason: str  # why: what the setting and the machine said

    def describe(self) -> str:
        return f"device {self.device}, {self.precision} ({self.reason})"

    def autocast(self):
        """The context a forward runs in: bf16 autocast on CUDA (weights and gradients stay fp32), else none."""
        import torch

        return torch.autocast("cuda", dtype=torch.bfloat16) if self.precision == "bf16" else contextlib.nullcontext()


ON_CPU = Placement("cpu", "fp32", "not configurable: the embedded base's pre-training runs on the CPU")


def choose_placement(setting: Literal["auto", "cpu", "cuda"]) -> Placement:
    """The device and precision for ``train.device``; ``cuda`` on a machine without one is a ``ConfigError``."""
    import torch

    available = torch.cuda.is_available()
    if setting == "cpu":
        return Placement("cpu", "fp32", "train.device: cpu")
    if not available:
        if setting == "cuda":
            raise ConfigError(f"train.device: cuda, but torch.cuda.is_available() is False (torch {torch.__version__}, "
                              f"built for CUDA {torch.version.cuda}); set train.device: auto or cpu")
        return Placement("cpu", "fp32", f"train.device: auto and torch.cuda.is_available() is False "
                                        f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    name = torch.cuda.get_device_name()
    if torch.cuda.is_bf16_supported():
        return Placement("cuda", "bf16", f"train.device: {setting}, {name} computes bf16")
    return Placement("cuda", "fp32", f"train.device: {setting}, {name} has no bf16: fp32")


def rank_accelerator(placement: Placement):
    """The ``accelerate.Accelerator`` of a launched rank: its process group (gloo on the CPU, NCCL on
    GPUs) and its device; the precision is ``placement.autocast``'s."""
    from accelerate import Accelerator

    return Accelerator(cpu=placement.device == "cpu")


def is_launched_rank() -> bool:
    """True inside a rank that ``accelerate launch`` (torch.distributed.run) started."""
    return RANK_ENV in os.environ


def launch_command(module: str, argv: list[str], processes: int) -> list[str]:
    """``accelerate launch`` of ``python -m module argv`` on ``processes`` local ranks.

    ``--multi_gpu`` selects accelerate's torch.distributed.run launcher, which also starts CPU ranks:
    without a GPU each rank's ``Accelerator(cpu=True)`` joins a gloo process group. The defaults are
    passed explicitly so that no accelerate config file of the machine changes the run; port 0 is a free
    port, so two stages (or test runs) on one machine do not meet on accelerate's default 29500."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
            "-m", module, *argv]
