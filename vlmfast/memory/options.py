"""What the memory estimate is asked about and what a group of parameters costs: the estimate's inputs.

Usage: ``opts = EstimateOptions(zero_stage=2, world_size=8); optimizer_state_bytes((4096, 4096), "adamw")``

Its own module so that ``vlmfast.memory.estimator`` (which makes estimates) and ``vlmfast.memory.zero`` (which
shards their model states) both import it and neither imports the other; it imports neither of them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from vlmfast.common.utils import PRECISION_DTYPES

__all__ = [
    "CHECKPOINT_SCOPES",
    "OPTIMIZERS",
    "EstimateOptions",
    "OptimizerName",
    "Precision",
    "StateBytes",
    "optimizer_state_bytes",
]

Precision = Literal["fp32", "bf16", "fp16"]
OptimizerName = Literal["adamw", "adam", "sgd", "sgd_momentum", "adafactor", "adamw_8bit"]
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "sgd_momentum", "adafactor", "adamw_8bit")
CHECKPOINT_SCOPES = ("all", "language_model", "vision")


@dataclass(frozen=True)
class EstimateOptions:
    """Everything about the run that changes its memory (usage: ``EstimateOptions(zero_stage=2, world_size=8)``)."""

    precision: Precision = "bf16"
    optimizer: OptimizerName = "adamw"
    micro_batch_size: int = 1
    seq_len: int | None = None
    world_size: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool | str = False  # True = "all"; or "language_model" / "vision"
    frozen: tuple[str, ...] = ()
    master_weights: bool = True  # mixed precision keeps fp32 master weights; False: the guide's all-16-bit count
    gpus_per_node: int | None = None  # host memory is per node; default min(world_size, 8)
    linear_cross_entropy: bool = False  # chunked head + loss: no [tokens, vocab] logits kept
    checkpoint_budget_gb: float | None = None  # activation_checkpointing.budget_gb: the planner's choice of blocks
    micro_batch_tokens: int | None = None  # micro-batches by tokens: rows = tokens // seq_len (the longest sample)

    def __post_init__(self) -> None:
        checks = [
            (self.precision in PRECISION_DTYPES,
             f"precision must be one of {sorted(PRECISION_DTYPES)}, got {self.precision!r}"),
            (self.optimizer in OPTIMIZERS, f"optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}"),
            (self.micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {self.micro_batch_size}"),
            (self.seq_len is None or self.seq_len >= 2, f"seq_len must be >= 2, got {self.seq_len}"),
            (self.world_size >= 1, f"world_size must be >= 1, got {self.world_size}"),
            (self.zero_stage in (0, 1, 2, 3), f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}"),
            (not self.offload_optimizer or self.zero_stage >= 1, "offload_optimizer needs zero_stage 1, 2 or 3"),
            (not self.offload_params or self.zero_stage == 3, "offload_params needs zero_stage 3"),
            (self.checkpoint_scope is None or self.checkpoint_scope in CHECKPOINT_SCOPES,
             f"activation_checkpointing must be a bool or one of {CHECKPOINT_SCOPES}"),
            (self.checkpoint_budget_gb is None or self.checkpoint_budget_gb > 0,
             f"checkpoint_budget_gb must be > 0, got {self.checkpoint_budget_gb}"),
            (self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
             f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def checkpoint_scope(self) -> str | None:
        """The checkpointed tower ('all', 'language_model', 'vision'), or None without checkpointing."""
        if self.activation_checkpointing is True:
            return "all"
        return self.activation_checkpointing or None

    @property
    def mixed(self) -> bool:
        """16-bit weights and gradients."""
        return self.precision != "fp32"

    @property
    def ranks_per_node(self) -> int:
        """Processes sharing one host's memory."""
        return self.gpus_per_node or min(self.world_size, 8)


def optimizer_state_bytes(shape: torch.Size | Sequence[int], optimizer: str, state_bytes: int = 4) -> int:
    """Bytes of one parameter's optimizer states (fp32 master weights not included).

    Usage: ``optimizer_state_bytes((4096, 4096), "adafactor")`` -> 32768 (a row and a column vector)
    """
    numel = math.prod(shape)
    if optimizer in ("adamw", "adam"):
        return 2 * numel * state_bytes
    if optimizer == "sgd":
        return 0
    if optimizer == "sgd_momentum":
        return numel * state_bytes
    if optimizer == "adamw_8bit":
        # bitsandbytes keeps small tensors (< 4096 elements, its min_8bit_size) in 32 bits.
        return 2 * numel if numel >= 4096 else 8 * numel
    if optimizer == "adafactor":
        if len(shape) < 2:
            return numel * state_bytes
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
        return (rows + cols) * state_bytes
    raise ValueError(f"unknown optimizer {optimizer!r}; one of {list(OPTIMIZERS)}")


@dataclass
class StateBytes:
    """Unsharded bytes of a group of parameters, by kind (w, g, f, o in ``vlmfast.memory.zero``'s docstring).

    Usage: ``b = StateBytes(); b.add_param(p.shape, p.requires_grad, opts); b.weights``
    """

    weights: int = 0
    grads: int = 0
    grad_partition: int = 0  # DeepSpeed's fp32 gradient partition (mixed precision, ZeRO >= 1)
    master: int = 0
    states: int = 0

    def add_param(self, shape: torch.Size, trainable: bool, opts: EstimateOptions) -> None:
        """Count one parameter of ``shape``: its weights always, gradients and optimizer states if trainable."""
        numel = math.prod(shape)
        unit = 2 if opts.mixed else 4
        self.weights += unit * numel
        if not trainable:
            return
        self.grads += unit * numel
        keeps_master = opts.mixed and opts.master_weights
        self.master += 4 * numel if keeps_master else 0
        self.grad_partition += 4 * numel if keeps_master and opts.zero_stage >= 1 else 0
        self.states += optimizer_state_bytes(shape, opts.optimizer, 4 if keeps_master or not opts.mixed else 2)
