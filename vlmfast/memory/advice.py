"""What to say when memory runs out: a short summary and the spec changes that usually help, cheapest first.

Usage: ``print(memory_summary(device)); print("\\n".join(oom_advice(spec)))``;
``with explain_oom("optimizer step", spec, device): optimizer.step()`` for an OOM the fallback cannot retry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vlmfast.memory.stats import memory_stats
from vlmfast.spec import TrainSpec


def memory_summary(device: torch.device) -> str:
    """The allocator's abbreviated summary on CUDA; current/peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_summary(device, abbreviated=True)
    stats = memory_stats(device)
    return ", ".join(f"{key.removeprefix('mem/')} {value:.2f}" for key, value in stats.items())


def oom_advice(spec: TrainSpec) -> list[str]:
    """Spec changes that cut memory, in the reference guide's priority order, skipping those already on."""
    advice = []
    if not spec.activation_checkpointing.enabled:
        advice.append("activation_checkpointing.enabled: true  (recompute block activations: ~30% more compute, "
                      "activations drop by half or more)")
    if spec.precision == "fp32":
        advice.append("precision: bf16  (activations and matmuls in half precision)")
    if not any("vision" in pattern for pattern in spec.optimizer.freeze):
        advice.append("optimizer.freeze: [vision_tower]  (no gradients or optimizer states for the vision encoder)")
    if not spec.activation_checkpointing.offload_to_cpu:
        advice.append("activation_checkpointing.offload_to_cpu: true  (saved activations in host memory)")
    advice.append("a shorter sequence / fewer or smaller images per sample, or more GPUs with ZeRO sharding")
    advice.append("vlmfast estimate-memory shows where the memory goes and the cheapest changes that make it fit")
    return advice


# ---- out of memory outside forward/backward -----------------------------------------------------------------------

OOM_PHASES = ("optimizer step", "evaluation")
# Optimizer state bytes per trainable parameter (fp32 states): what the first step allocates.
_STATE_BYTES = {"adamw": 8, "sgd": 4, "adafactor": 0}


class OutOfMemoryOutsideStepError(torch.OutOfMemoryError):
    """Out of memory where the OOM fallback cannot retry (the optimizer step, evaluation); the message carries the
    memory summary and the cheapest fixes for that phase."""


def oom_outside_step_advice(phase: str, spec: TrainSpec, trainable_params: int | None = None) -> list[str]:
    """Spec changes that cut the memory of `phase` ("optimizer step" or "evaluation"), cheapest first.

    The optimizer step's usual OOM is AdamW allocating its two fp32 moments (8 bytes per trainable parameter) on the
    first step, on top of weights and gradients: smaller micro-batches do not help, fewer or sharded states do.
    """
    if phase not in OOM_PHASES:
        raise ValueError(f"unknown phase '{phase}': one of {OOM_PHASES}")
    if phase == "evaluation":
        return [
            "micro_batch_size smaller: evaluation runs the same micro-batches as training, without a graph",
            *(["precision: bf16  (half the activation memory)"] if spec.precision == "fp32" else []),
            "the training step's cached blocks are still held: evaluating less often (eval.every_steps) does not "
            "change the peak, a smaller micro-batch does",
            "vlmfast estimate-memory shows where the memory goes",
        ]
    optimizer = spec.optimizer.name
    states = _STATE_BYTES.get(optimizer, 8)
    sized = f" ({states * trainable_params / 2**30:.2f} GiB for {trainable_params:,} trainable parameters)" \
        if trainable_params and states else ""
    advice = []
    if optimizer == "adamw":
        advice.append(f"8-bit optimizer states: AdamW keeps 8 bytes per trainable parameter{sized}; an 8-bit AdamW "
                      "(bitsandbytes.optim.AdamW8bit, in a hand-written loop with vlmfast's hooks) keeps 2, and "
                      "optimizer.name: adafactor keeps almost none (factored second moments)")
    if not spec.optimizer.freeze:
        advice.append("optimizer.freeze: [vision_tower]  (a frozen tower has no gradients and no optimizer states)")
    deepspeed = spec.deepspeed
    if spec.engine == "ddp":
        advice.append("engine: deepspeed with deepspeed.zero_stage: 1 or 2 on N GPUs  (optimizer states split N ways: "
                      "ZeRO-2 needs 2P + 18P/N bytes instead of 20P), or engine: fsdp (parameters too)")
    if deepspeed.offload_optimizer == "none":
        advice.append("deepspeed.offload_optimizer: cpu  (states and the step in host memory: fits on one GPU, the "
                      "step runs on the CPU)")
    if spec.precision == "fp32":
        advice.append("precision: bf16 with deepspeed or fsdp  (bf16 weights and gradients; fp32 master states)")
    advice.append("vlmfast estimate-memory: parameters, gradients and optimizer states per component, per ZeRO stage")
    return advice


def describe_oom_outside_step(phase: str, spec: TrainSpec, device: torch.device, trainable_params: int | None = None,
                              step: int | None = None) -> str:
    """The message for an out-of-memory error in `phase`: where, the memory summary, the cheapest fixes."""
    where = f"in the {phase}" + (f" of step {step}" if step is not None else "")
    why = ("the OOM fallback (oom.enabled) retries forward/backward at a smaller micro-batch, which cannot help here"
           if phase == "optimizer step" else "the OOM fallback covers training steps only")
    advice = "\n".join(f"  - {line}" for line in oom_outside_step_advice(phase, spec, trainable_params))
    return f"out of memory {where}: {why}.\nmemory: {memory_summary(device)}\ntry, cheapest first:\n{advice}"


@contextlib.contextmanager
def explain_oom(phase: str, spec: TrainSpec, device: torch.device, trainable_params: int | None = None,
                step: int | None = None) -> Iterator[None]:
    """Turn an out-of-memory error inside the block into :class:`OutOfMemoryOutsideStepError` with the summary and
    the fixes for `phase`; other errors pass through.

    Usage (where the loop steps the optimizer / evaluates)::

        with explain_oom("optimizer step", spec, device, trainable_params=n, step=state.step + 1):
            precision.optimizer_step(optimizer)
    """
    from vlmfast.memory.oom_errors import free_memory, is_oom_error

    failed = False
    try:
        yield
    except OutOfMemoryOutsideStepError:
        raise
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        failed, cause = True, exc
    if failed:  # outside the except block, so the summary is read with the failed step's tensors released
        free_memory()
        raise OutOfMemoryOutsideStepError(describe_oom_outside_step(phase, spec, device, trainable_params, step)) \
            from cause
