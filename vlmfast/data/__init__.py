"""Data loading: batch helpers, micro-batches of samples, and the resumable training loader."""

from vlmfast.data.batch import batch_size_of, count_input_tokens, move_to_device, split_batch
from vlmfast.data.batch_layout import BatchLayout, BatchSplitError, split_collated
from vlmfast.data.loader import EpochSampler, ResumableLoader
from vlmfast.data.micro_batches import SampleBatch, split_micro_batches

__all__ = ["BatchLayout", "BatchSplitError", "EpochSampler", "ResumableLoader", "SampleBatch", "batch_size_of",
           "count_input_tokens", "move_to_device", "split_batch", "split_collated", "split_micro_batches"]
