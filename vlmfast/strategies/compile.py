"""torch.compile of the whole model or of each repeated block, with a fall-back to eager on a compile error.

Usage in a hand-written loop (after activation checkpointing and freezing, before DDP)::

    result = compile_model(model, scope="blocks", backend="inductor")   # in place: names and state_dict unchanged
    loss = model(**batch).loss                                          # compiles here, at the first call
    result.fallbacks                                                    # {} or {'model': 'BackendCompilerFailed: ...'}

Modules are compiled in place with ``nn.Module.compile`` (what torch recommends over ``torch.compile(model)``):
parameter names, ``state_dict`` keys, optimizer groups, ``model.module`` under DDP and ``no_sync`` stay as they were.

torch compiles lazily, at the first call, and lowers the backward graph later still, at the first ``backward()``.
So each compiled call is guarded: it asks AOTAutograd to lower the backward together with the forward
(``force_non_lazy_backward_lowering``), which brings every compile error into the forward call, where the guard
catches it, switches that module back to eager and redoes the call eagerly. If the eager call fails too, the error
is the model's own and is raised as eager would raise it. Out-of-memory errors are never swallowed (the OOM
fallback needs them). Calls made under a TorchDispatchMode (the profiler's FLOP counter) run eagerly: dynamo would
skip them and never compile that code afterwards. torch's own ``torch._dynamo.config.suppress_errors`` was not used:
it is process-wide, misses the lazily lowered backward, and would hide the reason behind a log line.

Order in a training setup: activation checkpointing first (compile then traces the checkpointed blocks), compile
last, DDP after compile (torch's advice: compile the inner module, then wrap; compiled code still runs inside DDP's
forward, so dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries and all-reduce overlaps backward).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _python_dispatch

from vlmfast.common.module_tree import find_repeated_blocks
from vlmfast.engines.foreign_loops import find_ddp
from vlmfast.spec import CompileSpec
from vlmfast.strategies.base import Strategy

__all__ = ["CompileResult", "TorchCompile", "allow_recompiles", "compile_model"]

log = logging.getLogger(__name__)

SCOPES = ("model", "blocks")
_GUARD = "_vlmfast_compile_guard"


@dataclass
class CompileResult:
    """What :func:`compile_model` did: the compiled modules, and those that fell back to eager (filled at run time)."""

    compiled: list[str]
    backend: str
    fallbacks: dict[str, str] = field(default_factory=dict)  # module name -> reason, set when a compile fails
    graphs_at_start: int = 0

    @property
    def graphs(self) -> int:
        """Graphs dynamo compiled in this process since :func:`compile_model` ran (includes recompilations)."""
        return _graph_count() - self.graphs_at_start


class _CompiledCall:
    """A module's compiled ``__call__``: compile errors (forward or backward) switch the module back to eager."""

    def __init__(self, module: nn.Module, name: str, compiled: Callable[..., Any], fallback: bool,
                 result: CompileResult) -> None:
        import torch._functorch.config  # loaded with torch.compile; imported here so importing vlmfast stays fast

        self.module, self.name, self.compiled = module, name, compiled
        self.fallback, self.result = fallback, result
        self.config = torch._functorch.config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _dispatch_mode_on_stack():
            # E.g. FlopCounterMode (the profiler's FLOP count): dynamo skips a frame seen under such a mode and marks
            # its code "skip" for good, so the model would never compile. Run this call eagerly instead.
            return self.module._call_impl(*args, **kwargs)
        # Lower the backward now, so its compile errors surface here and not in loss.backward(). Set by hand:
        # config.patch() costs 5x more, on every call of every compiled block.
        lazy = self.config.force_non_lazy_backward_lowering
        self.config.force_non_lazy_backward_lowering = True
        try:
            return self.compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            if not self.fallback:
                _add_note(exc, f"torch.compile of '{self.name}' failed and compile.fallback is off: set "
                          "compile.fallback: true to run it eagerly, or try compile.scope: blocks / fullgraph: false")
                raise
            reason = _reason(exc)
        finally:
            self.config.force_non_lazy_backward_lowering = lazy
        # Out of the except block, so the failed attempt's traceback no longer pins its tensors.
        self.module._compiled_call_impl = None
        try:
            output = self.module._call_impl(*args, **kwargs)  # what the compiled call wraps (hooks included)
        except BaseException:
            self.module._compiled_call_impl = self  # eager fails too: the model's own error, not the compiler's
            raise
        self.result.fallbacks[self.name] = reason
        log.warning("torch.compile of '%s' failed, running it eagerly instead: %s", self.name, reason)
        return output


def _dispatch_mode_on_stack() -> bool:
    """A user TorchDispatchMode is active (dynamo's own test, with a fallback for torch versions without it)."""
    check = getattr(_python_dispatch, "any_torch_dispatch_mode_on_stack", None)
    return check() if check is not None else _python_dispatch.is_in_torch_dispatch_mode(include_infra_modes=False)


def _reason(exc: BaseException) -> str:
    """The head of a compile error and the user-code line it points at, without dynamo's boilerplate."""
    lines = [raw.strip() for raw in str(exc).strip().splitlines()]
    paragraph = lines[: lines.index("")] if "" in lines else lines  # dynamo's summary is the first paragraph
    head = [line for line in paragraph if not line.startswith(("Hint:", "Developer debug context"))]
    # The innermost frame of dynamo's "from user code" trace comes last.
    where = next((line for line in reversed(lines) if line.startswith('File "')), "")
    text = " ".join(head)[:400]
    return f"{type(exc).__name__}: {text}" + (f" ({where})" if where else "")


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def _graph_count() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _check_backend(backend: str | Callable[..., Any]) -> None:
    if callable(backend):
        return
    import torch._dynamo

    available = torch._dynamo.list_backends(exclude_tags=())
    if backend not in available:
        raise ValueError(f"compile.backend '{backend}' is not a torch.compile backend here; available: "
                         f"{', '.join(sorted(available))}")


def _targets(model: nn.Module, scope: str) -> list[tuple[str, nn.Module]]:
    ddp = find_ddp(model)  # the engine (or the user's loop) may have wrapped it
    inner = ddp.module if ddp is not None else model
    if scope == "model":
        return [("model", inner)]
    blocks = [(f"{path}.{i}", block) for path, stack in find_repeated_blocks(inner).items()
              for i, block in enumerate(stack)]
    if not blocks:
        raise ValueError("compile.scope 'blocks': the model has no repeated blocks (an nn.ModuleList of two or more "
                         "modules of one class); use compile.scope: model")
    return blocks


def allow_recompiles(blocks: int) -> int:
    """Raise dynamo's per-function recompile limit to cover ``blocks`` compiled blocks; returns the limit.

    Blocks of one class share their code, and a block that keeps an int attribute in its forward (Hugging Face's
    ``layer_idx``) gets one graph per layer: past torch's default of 8, the remaining layers would silently run eager
    (measured: a LLaVA's graphs grow by one per layer). Never lowers a limit the user set.
    Usage: ``allow_recompiles(len(blocks))`` before the first compiled call.
    """
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    limit = max(getattr(dynamo_config, name), 2 * blocks + 8)  # two shape variants per block, and the rest
    setattr(dynamo_config, name, limit)
    return limit


def compile_model(
    model: nn.Module,
    *,
    scope: str = "model",
    mode: str = "default",
    dynamic: bool | None = None,
    fullgraph: bool = False,
    backend: str | Callable[..., Any] = "inductor",
    fallback: bool = True,
) -> CompileResult:
    """Compile ``model`` (scope 'model') or each of its repeated blocks (scope 'blocks') in place.

    Usage: ``result = compile_model(model, scope="blocks", dynamic=None)``

    Compilation happens at the first call of each compiled module. With ``fallback`` a module whose compilation
    fails runs eagerly from then on and ``result.fallbacks`` names it with the reason; without it the error is
    raised with a note. A DDP-wrapped model has its inner module compiled. Compiling twice is a no-op.
    """
    if scope not in SCOPES:
        raise ValueError(f"compile.scope must be one of {SCOPES}, got '{scope}'")
    _check_backend(backend)
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    result = CompileResult(compiled=[], backend=name, graphs_at_start=_graph_count())
    targets = _targets(model, scope)
    allow_recompiles(len(targets))
    for target_name, module in targets:
        if getattr(module, _GUARD, None) is None:
            module.compile(mode=mode, dynamic=dynamic, fullgraph=fullgraph, backend=backend)
            guard = _CompiledCall(module, target_name, module._compiled_call_impl, fallback, result)
            module._compiled_call_impl = guard
            setattr(module, _GUARD, guard)
        result.compiled.append(target_name)
    return result


class TorchCompile(Strategy):
    """The ``compile`` spec section as a trainer strategy: apply last, before the DDP wrap.

    Usage: ``model = TorchCompile(spec.compile).apply(model)``
    """

    name = "compile"

    def __init__(self, spec: CompileSpec) -> None:
        self.spec = spec
        self.result: CompileResult | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        if self.spec.enabled:
            s = self.spec
            self.result = compile_model(model, scope=s.scope, mode=s.mode, dynamic=s.dynamic, fullgraph=s.fullgraph,
                                        backend=s.backend, fallback=s.fallback)
        return model

    def describe(self) -> str:
        if self.result is None:
            return "torch.compile: off"
        s, r = self.spec, self.result
        dynamic = {None: "auto", True: "on", False: "off"}[s.dynamic]
        what = "whole model" if s.scope == "model" else f"{len(r.compiled)} blocks"
        text = f"torch.compile: {what} ({r.backend}, mode {s.mode}, dynamic shapes {dynamic}), {r.graphs} graph(s)"
        if r.fallbacks:
            failed = "; ".join(f"{name}: {reason}" for name, reason in r.fallbacks.items())
            text += f"; fell back to eager for {len(r.fallbacks)} module(s): {failed}"
        return text
