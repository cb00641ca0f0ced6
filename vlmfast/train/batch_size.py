"""`OptimizedTrainer.find_micro_batch_size`: probe the trainer's own step at growing sizes, then restore everything.

Usage::

    search = trainer.find_micro_batch_size()      # model, optimizer, RNG and data position restored afterwards
    print(search.largest, search.recommended)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vlmfast.common.utils import rng_state, set_rng_state
from vlmfast.data.batch import split_batch
from vlmfast.memory.batch_size import BatchSizeSearch, find_max_micro_batch_size, restore_from_host, snapshot_to_host
from vlmfast.spec import SpecError

__all__ = ["BatchSizeSearch", "search_micro_batch_size"]


def search_micro_batch_size(train_step: Callable[[Any, int], Any], *, engine: Any, model: nn.Module, loader: Any,
                            max_size: int, device: torch.device, safety_margin: float = 0.9) -> BatchSizeSearch:
    """Largest n <= `max_size` whose `train_step(batch[:n], n)` plus an optimizer step fits, on the loader's next
    batch; model, optimizer, RNG and the loader's position are restored after. Gradients stay local during the
    probes (`engine.local_gradients()`), so ranks only meet in the search's own agreement.
    """
    if not engine.can_probe:
        raise SpecError("find_micro_batch_size probes with engine: ddp (the per-rank activation memory is the same "
                        "under FSDP2 / DeepSpeed): run it with engine: ddp")
    snapshot = _host_snapshot(engine, loader)
    batch = next(loader)
    was_training = model.training
    model.train()

    def probe(n: int) -> None:
        try:
            with engine.local_gradients():
                train_step(split_batch(batch, n)[0], n)
            engine.optimizer.step()  # optimizer states are allocated on the first step: count them
        finally:
            engine.optimizer.zero_grad(set_to_none=True)

    try:
        return find_max_micro_batch_size(probe, max_size, safety_margin=safety_margin, device=device)
    finally:
        _restore(engine, loader, snapshot)
        model.train(was_training)


def _host_snapshot(engine: Any, loader: Any) -> tuple[Any, ...]:
    """Model and optimizer state copied to the host (a device copy would take the memory being measured), complete
    when this returns (blocking copies: see snapshot_to_host)."""
    return (snapshot_to_host(engine.module.state_dict()), snapshot_to_host(engine.optimizer.state_dict()),
            rng_state(), loader.state_dict())


def _restore(engine: Any, loader: Any, snapshot: tuple[Any, ...]) -> None:
    model_state, optimizer_state, rng, position = snapshot
    restore_from_host(engine.module, engine.optimizer, model_state, optimizer_state)
    set_rng_state(rng)
    loader.load_state_dict(position)
