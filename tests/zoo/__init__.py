"""A zoo of tiny models of the architectures people fine-tune, with inputs made by their real processors.

Nothing is downloaded: models are built from tiny configs, tokenizers are word-level ``tokenizers`` models with each
architecture's special / image tokens, wrapped in ``PreTrainedTokenizerFast`` and then in the real processor class
(the image processors construct without files). Each case has per-sample items (variable text lengths, 0 / 1 / 2
images per sample where the model takes them) and a collate_fn that runs the processor, so micro-batches are
collated from samples exactly as a user's would be.

Usage (in tests)::

    from zoo import ZOO, build_case
    case = build_case("qwen2_vl")
    batch = case.collate_fn(case.samples)            # what the processor makes for all 8 samples
    loss = case.model(**batch).loss
"""

from __future__ import annotations

from .cases import VLM_CASES, ZOO, ZooCase, build_case

__all__ = ["VLM_CASES", "ZOO", "ZooCase", "build_case"]
