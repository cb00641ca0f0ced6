"""vlmfast: fast, out-of-memory-proof PyTorch training for vision-language models, one flag at a time.

Usage::

    from vlmfast import OptimizedTrainer, TrainSpec
    result = OptimizedTrainer(model, dataset, TrainSpec.from_file("run.yaml"), collate_fn=collate).fit()
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names below load on first use (PEP 562): `import vlmfast` (and the CLI) stays torch-free
    import vlmfast.attention as attention  # callable: vlmfast.attention(q, k, v, ...) dispatches to the backend
    from vlmfast.spec import SpecError, TrainSpec
    from vlmfast.strategies.nonfinite import NonFiniteLossError
    from vlmfast.train.callbacks import Callback
    from vlmfast.train.loop import DataLoaderTimeoutError, OptimizedTrainer  # the data package loads via train
    from vlmfast.train.state import FitResult, TrainState

from vlmfast.version import __version__  # pyproject.toml repeats it

# public name -> (module, attribute in it; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "attention": ("vlmfast.attention", None),
    "Callback": ("vlmfast.train.callbacks", "Callback"),
    "DataLoaderTimeoutError": ("vlmfast.train.loop", "DataLoaderTimeoutError"),
    "FitResult": ("vlmfast.train.state", "FitResult"),
    "NonFiniteLossError": ("vlmfast.strategies.nonfinite", "NonFiniteLossError"),
    "OptimizedTrainer": ("vlmfast.train.loop", "OptimizedTrainer"),
    "SpecError": ("vlmfast.spec", "SpecError"),
    "TrainSpec": ("vlmfast.spec", "TrainSpec"),
    "TrainState": ("vlmfast.train.state", "TrainState"),
}


def __getattr__(name: str) -> Any:
    """Load a public name (or a submodule, as `vlmfast.train` after `import vlmfast`) on first access."""
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value  # later accesses skip this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "Callback",
    "DataLoaderTimeoutError",
    "FitResult",
    "NonFiniteLossError",
    "OptimizedTrainer",
    "SpecError",
    "TrainSpec",
    "TrainState",
    "__version__",
    "attention",
]
