"""Data loading: batch helpers and the resumable training loader."""

from vlmfast.data.batch import batch_size_of, count_input_tokens, move_to_device, split_batch
from vlmfast.data.loader import EpochSampler, ResumableLoader

__all__ = ["EpochSampler", "ResumableLoader", "batch_size_of", "count_input_tokens", "move_to_device", "split_batch"]
