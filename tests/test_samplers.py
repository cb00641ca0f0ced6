"""Length / modality grouping sampler: less padding, longest batch first, seeded, resumable, distributed-aware."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from vlmfast.data.loader import EpochSampler
from vlmfast.data.samplers import (
    LengthGroupedSampler,
    check_groupable,
    dataset_lengths,
    grouped_order,
    padding_waste,
)
from vlmfast.models import ShapesCaptionDataset, VLMCollator
from vlmfast.spec import TrainSpec


def skewed_lengths(n: int = 800, seed: int = 0) -> torch.Tensor:
    """Token counts with a long tail (log-normal), as captions and conversations have."""
    g = torch.Generator().manual_seed(seed)
    return (torch.exp(torch.randn(n, generator=g) * 0.8) * 60).long().clamp(5, 1024)


def with_modality(lengths: torch.Tensor, text_only: float = 0.3, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    signed = lengths.clone()
    signed[torch.rand(len(lengths), generator=g) < text_only] *= -1  # LLaVA: negative = text-only
    return signed


def batches(order: list[int], batch_size: int) -> list[list[int]]:
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def test_grouping_halves_padding_waste():
    lengths = skewed_lengths()
    random_order = list(EpochSampler(len(lengths), seed=0, shuffle=True))
    grouped = list(LengthGroupedSampler(lengths, batch_size=16, seed=0))
    random_waste = padding_waste(lengths, random_order, 16)
    grouped_waste = padding_waste(lengths, grouped, 16)
    assert random_waste > 0.6  # the long tail makes random batches mostly padding
    assert grouped_waste < 0.6 * random_waste, (random_waste, grouped_waste)


def test_grouping_reduces_pad_tokens_of_the_real_collator():
    """Fraction of pad tokens in what VLMCollator really builds, shapes captions, with vs without grouping."""
    dataset = ShapesCaptionDataset(num_samples=96, seed=0, min_image_size=8, max_image_size=8)
    lengths = [len(dataset.caption_ids(i)) for i in range(len(dataset))]
    collate = VLMCollator(image_size=8)

    def pad_fraction(sampler) -> float:
        loader = DataLoader(dataset, batch_size=8, sampler=sampler, collate_fn=collate, drop_last=True)
        masks = [batch["attention_mask"] for batch in loader]
        return 1.0 - sum(int(m.sum()) for m in masks) / sum(m.numel() for m in masks)

    plain = pad_fraction(EpochSampler(len(dataset), seed=0, shuffle=True))
    grouped = pad_fraction(LengthGroupedSampler(lengths, batch_size=8, seed=0))
    assert grouped < 0.5 * plain, (plain, grouped)


def test_every_sample_once_per_epoch_seeded_and_reshuffled():
    lengths = skewed_lengths(203)
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(203))
    assert list(LengthGroupedSampler(lengths, batch_size=8, seed=3)) == first  # seeded
    sampler.set_position(1, 0)
    assert sorted(list(sampler)) == list(range(203)) and list(sampler) != first  # a new order each epoch


@pytest.mark.parametrize("seed", range(4))
def test_longest_sample_is_in_the_first_batch(seed):
    lengths = skewed_lengths(300, seed=seed)
    lengths[seed * 37 + 5] = 5000  # one outlier somewhere: it must come at step 1 so an OOM shows at once
    order = list(LengthGroupedSampler(lengths, batch_size=16, seed=seed))
    assert seed * 37 + 5 in order[:16]


def test_modality_length_keeps_image_and_text_only_apart():
    lengths = with_modality(skewed_lengths())
    batch_size = 16
    order = list(LengthGroupedSampler(lengths, batch_size, seed=0, mode="modality_length"))
    kinds = [{bool(lengths[i] > 0) for i in batch} for batch in batches(order, batch_size)]
    full = len(order) // batch_size
    n_image, n_text = int((lengths > 0).sum()), int((lengths < 0).sum())
    pure_full_batches = n_image // batch_size + n_text // batch_size
    assert all(len(k) == 1 for k in kinds[:pure_full_batches])  # only the leftovers at the end mix
    assert sum(len(k) > 1 for k in kinds) <= full - pure_full_batches + 1
    random_order = list(EpochSampler(len(lengths), seed=0, shuffle=True))
    random_mixed = sum(len({bool(lengths[i] > 0) for i in b}) > 1 for b in batches(random_order, batch_size))
    assert random_mixed > 0.8 * full  # without grouping nearly every batch mixes them
    # 'length' ignores the sign: it groups by |length| and mixes modalities
    assert padding_waste(lengths, list(LengthGroupedSampler(lengths, batch_size, seed=0)), batch_size) < 0.5


def test_two_ranks_equal_one_process_with_the_global_batch():
    lengths = with_modality(skewed_lengths(203))
    per_rank, world = 8, 2
    ranks = [list(LengthGroupedSampler(lengths, per_rank, seed=5, rank=r, world_size=world, mode="modality_length"))
             for r in range(world)]
    single = list(LengthGroupedSampler(lengths, per_rank * world, seed=5, mode="modality_length"))
    assert len(ranks[0]) == len(ranks[1]) == 203 // world  # equal counts: nobody waits at the epoch end
    assert not set(ranks[0]) & set(ranks[1])
    for step in range(203 // (per_rank * world)):
        together = ranks[0][step * per_rank:(step + 1) * per_rank] + ranks[1][step * per_rank:(step + 1) * per_rank]
        assert sorted(together) == sorted(single[step * per_rank * world:(step + 1) * per_rank * world])


def test_resume_mid_epoch_is_exact():
    lengths = skewed_lengths(120)
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=1, rank=1, world_size=2)
    sampler.set_position(2, 0)
    whole = list(DataLoader(range(120), batch_size=8, sampler=sampler, drop_last=True))
    resumed = LengthGroupedSampler(lengths, batch_size=8, seed=1, rank=1, world_size=2)
    resumed.set_position(2, 3 * 8)  # what ResumableLoader does after 3 batches of epoch 2
    rest = list(DataLoader(range(120), batch_size=8, sampler=resumed, drop_last=True))
    assert len(resumed) == 60 - 24
    assert [b.tolist() for b in rest] == [b.tolist() for b in whole[3:]]


def test_unshuffled_order_is_still_grouped_and_longest_first():
    lengths = skewed_lengths(800)
    order = grouped_order(lengths, 16, shuffle=False)
    assert sorted(order) == list(range(800))
    assert order[0] == int(lengths.argmax())
    assert padding_waste(lengths, order, 16) < 0.6 * padding_waste(lengths, list(range(800)), 16)


class CaptionLengths(Dataset):
    def __init__(self, n: int = 10) -> None:
        self.lengths = list(range(1, n + 1))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> int:
        return i


class ModalityProperty(CaptionLengths):
    @property
    def modality_lengths(self) -> list[int]:
        return [-n if n % 2 else n for n in self.lengths]


class NoLengths(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


def test_lengths_come_from_the_dataset_or_a_callable():
    assert dataset_lengths(CaptionLengths(4), "length") == [1, 2, 3, 4]
    assert dataset_lengths(ModalityProperty(4), "modality_length") == [-1, 2, -3, 4]
    assert dataset_lengths(Subset(CaptionLengths(6), [5, 0]), "length") == [6, 1]
    assert dataset_lengths(NoLengths(), "length", lengths=lambda i: 10 * i) == [0, 10, 20, 30]
    assert dataset_lengths(NoLengths(), "length", lengths=torch.tensor([4, 3, 2, 1])) == [4, 3, 2, 1]


def test_missing_or_wrong_lengths_fail_clearly():
    with pytest.raises(ValueError, match="NoLengths has no lengths or modality_lengths"):
        dataset_lengths(NoLengths(), "length")
    with pytest.raises(ValueError, match=r"modality_lengths.*negative"):
        dataset_lengths(CaptionLengths(), "modality_length")  # plain lengths cannot say which are text-only
    with pytest.raises(ValueError, match="3 lengths for a dataset of 4 samples"):
        dataset_lengths(NoLengths(), "length", lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="sample 1 has length 0"):
        dataset_lengths(NoLengths(), "modality_length", lengths=[1, 0, -2, 3])
    with pytest.raises(ValueError, match="group_by_length must be one of"):
        LengthGroupedSampler([1, 2], 1, mode="modality")


def test_streams_cannot_be_grouped():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ValueError, match="needs a map-style Dataset"):
        check_groupable(Stream(), "length")
    check_groupable(Stream(), "none")
    check_groupable(CaptionLengths(), "modality_length")


def test_spec_field():
    assert TrainSpec().data.group_by_length == "none"
    assert TrainSpec(data={"group_by_length": "modality_length"}).data.group_by_length == "modality_length"
    with pytest.raises(ValueError, match="group_by_length"):
        TrainSpec(data={"group_by_length": "tokens"})


def test_the_trainer_groups_by_length_and_says_so_in_the_report() -> None:
    from vlmfast import OptimizedTrainer
    from vlmfast.models import build_tiny_vlm_task

    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=32)
    spec = TrainSpec(max_steps=1, batch_size=8, data={"group_by_length": "length"}, log={"progress": "off"})
    trainer = OptimizedTrainer(model, dataset, spec, collate_fn=collate)
    assert type(trainer.loader.sampler).__name__ == "LengthGroupedSampler"
    assert "data: grouped by length" in trainer.fit().report.to_text()
