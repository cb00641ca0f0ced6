"""Profiling and diagnosis: where the step time goes, FLOPs and MFU, torch.profiler traces, `vlmfast doctor`.

Usage::

    from vlmfast.profiling import PhaseTimer, FlopsMeter, StepProfiler, diagnose
    timer = PhaseTimer(device, every_steps=10)     # see vlmfast.profiling.phase_timer
    meter = FlopsMeter(model)                      # FLOPs once per batch shape; peak_tflops(device, "bf16") for MFU

Each piece works alone in a hand-written loop; :class:`RunProfiler` bundles them for the trainer (spec section
``profile``). docs/profiling.md explains the metrics and the doctor's rules.
"""

from vlmfast.profiling.doctor import Evidence, Finding, FlagTrial, diagnose, format_findings, one_flag_at_a_time
from vlmfast.profiling.flops import (
    PEAK_TFLOPS,
    FlopsMeter,
    TowerShape,
    analytic_flops,
    measure_flops,
    peak_tflops,
    transformer_flops,
)
from vlmfast.profiling.phase_timer import PHASES, PhaseTimer, timed_comm_hook
from vlmfast.profiling.profiler import RunProfiler
from vlmfast.profiling.torch_profiler import StepProfiler, nvtx_range, top_operators

__all__ = [
    "PEAK_TFLOPS",
    "PHASES",
    "Evidence",
    "Finding",
    "FlagTrial",
    "FlopsMeter",
    "PhaseTimer",
    "RunProfiler",
    "StepProfiler",
    "TowerShape",
    "analytic_flops",
    "diagnose",
    "format_findings",
    "measure_flops",
    "nvtx_range",
    "one_flag_at_a_time",
    "peak_tflops",
    "timed_comm_hook",
    "top_operators",
    "transformer_flops",
]
