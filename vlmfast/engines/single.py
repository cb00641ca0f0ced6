"""One process, one device: the engine every other one builds on (see :class:`vlmfast.engines.base.Engine`).

Usage::

    engine = SingleEngine(MixedPrecision("bf16", device))
    model = engine.setup(model, lambda m: torch.optim.AdamW(m.parameters()))
"""

from __future__ import annotations

from vlmfast.engines.base import Engine


class SingleEngine(Engine):
    """Plain backward and optimizer step through the precision plugin (autocast, GradScaler for fp16)."""

    name = "single"
