"""Models and synthetic data shipped with vlmfast.

Usage::

    from vlmfast.models import build_tiny_vlm_task
    model, dataset, collator = build_tiny_vlm_task(seed=0)
"""

from vlmfast.models.shapes import (
    ShapesCaptionDataset,
    ShapesTokenizer,
    VLMCollator,
    text_only_baseline_loss,
)
from vlmfast.models.tiny_vlm import TinyVLM, TinyVLMConfig, VLMOutput, build_tiny_vlm_task, causal_lm_loss

__all__ = [
    "ShapesCaptionDataset",
    "ShapesTokenizer",
    "TinyVLM",
    "TinyVLMConfig",
    "VLMCollator",
    "VLMOutput",
    "build_tiny_vlm_task",
    "causal_lm_loss",
    "text_only_baseline_loss",
]
