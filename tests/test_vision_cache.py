"""The frozen-tower feature cache (vision_cache): same training with and without it, the tower skipped on hits,
invalidation and refusals, the store, the Hugging Face layouts, and the other strategies and engines around it."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from conftest import assert_gradients_close
from torch.utils.data import DataLoader, Dataset, default_collate

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.features import FeatureStore, KeyedCollate, check_deterministic
from vlmfast.features import store as store_module
from vlmfast.features.cache import FeatureCache
from vlmfast.features.keys import KEYS_FIELD, FlatKeys, batch_image_keys
from vlmfast.features.store import CorruptEntryError, UnverifiableEntryError
from vlmfast.models import build_tiny_vlm_task
from vlmfast.models.tiny_vlm import TinyVLM, TinyVLMConfig
from vlmfast.strategies.registry import BuildContext, build_strategies
from vlmfast.strategies.vision_cache import VisionCache, cache_vision_features

FROZEN_ALL = ["vision_tower", "multi_modal_projector"]


def _task(samples: int = 32, config: TinyVLMConfig | None = None, frozen: list[str] = FROZEN_ALL):
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=samples, config=config)
    for name, param in model.named_parameters():
        param.requires_grad_(not any(name.startswith(f) for f in frozen))
    return model, dataset, collate


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is as fast and does not fight the other processes on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fit(tmp_path, cache: bool, *, frozen=FROZEN_ALL, samples=32, steps=8, collate=None, image_by_image=False,
         **extra):
    """`image_by_image`: the tower runs on one image per call (another matmul blocking than the plain run's
    micro-batches of 4): the comparisons must hold under any blocking, as on a CPU with other kernels."""
    model, dataset, default = _task(samples, frozen=frozen)
    if image_by_image:
        _run_image_by_image(model.vision_tower)
    spec = {"max_steps": steps, "batch_size": 8, "micro_batch_size": 4, "device": "cpu", "log": {"progress": "off"},
            # SGD: weights linear in the gradients, so last-bit differences stay last-bit (AdamW divides a gradient
            # that is zero in exact arithmetic, such as an attention key bias's, by its own noise: +-lr per step)
            "optimizer": {"name": "sgd", "lr": 0.05, "freeze": list(frozen)},
            "vision_cache": {"enabled": cache, "dir": str(tmp_path / "cache")}, **extra}
    trainer = OptimizedTrainer(model, dataset, TrainSpec(**spec), collate_fn=collate or default)
    result = trainer.fit()
    return trainer, result


def _run_image_by_image(tower: torch.nn.Module) -> None:
    whole = tower.forward
    tower.forward = lambda pixel_values: torch.cat([whole(image[None]) for image in pixel_values])


def assert_same_training(result, other, trainer=None, other_trainer=None) -> None:
    """Same losses (relative 1e-5) and, given the trainers, the same weights (norm-relative 1e-5, float64): what
    holds on any CPU, whatever batch sizes the tower's matmuls see (never bit-equality)."""
    losses, others = ([h["loss"] for h in r.history] for r in (result, other))
    assert others == pytest.approx(losses, rel=1e-5)
    if trainer is not None:
        assert_gradients_close(_weights(other_trainer.engine.module), _weights(trainer.engine.module), rtol=1e-5)


def _cache_of(trainer) -> FeatureCache:
    return next(s for s in trainer.strategies if isinstance(s, VisionCache)).cache


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- the promise: same losses and gradients, the tower skipped from epoch 2 ------------------------------------
@pytest.mark.parametrize("image_by_image", [False, True], ids=["same blocking", "tower image by image"])
@pytest.mark.parametrize("frozen", [FROZEN_ALL, ["vision_tower"]], ids=["tower+projector", "tower"])
def test_two_epochs_same_losses_and_weights_and_epoch_two_all_hits(tmp_path, frozen, image_by_image):
    plain, plain_result = _fit(tmp_path, False, frozen=frozen)
    cached, cached_result = _fit(tmp_path, True, frozen=frozen, image_by_image=image_by_image)
    assert_same_training(plain_result, cached_result, plain, cached)  # 8 SGD steps
    epoch2 = cached_result.history[4:]
    assert [h["vision_cache/misses"] for h in epoch2] == [0] * 4
    assert [h["vision_cache/hits"] for h in epoch2] == [8] * 4
    cache = _cache_of(cached)
    expected = "get_image_features" if frozen == FROZEN_ALL else "vision_tower.forward"
    # 32 images stored once; the label-convention probe's one no-grad forward adds a few lookups (hits) on top
    assert cache.unit.name == expected and cache.stats.misses == 32 and cache.stats.hit_rate >= 0.5
    line = next(s for s in cached_result.report.strategies if s.startswith("vision_cache"))
    assert "hit rate" in line and "entries" in line


def test_tower_does_not_run_on_hits(tmp_path):
    model, dataset, collate = _task(8)
    calls = []
    model.vision_tower.register_forward_pre_hook(lambda *a: calls.append(1))
    cache = cache_vision_features(model, tmp_path)
    batch = collate([dataset[i] for i in range(8)])
    first = model(**batch).loss
    # the check that the call needs no gradient (once: a custom model's layout is not learned end to end), the run,
    # and the first-call determinism probe (two runs on two images)
    assert len(calls) == 4
    second = model(**batch).loss
    assert len(calls) == 4 and torch.equal(first, second) and cache.stats.hits == 8


def test_hand_loop_gradients_equal_every_step_with_keys_from_loader_workers(tmp_path):
    """The standalone hook in a plain loop; KeyedCollate hashes in a DataLoader worker, not on the training thread."""

    def grads_per_step(use_cache: bool) -> list[dict[str, torch.Tensor]]:
        model, dataset, collate = _task(16, frozen=["vision_tower"])
        cache = cache_vision_features(model, tmp_path / "hand") if use_cache else None
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        loader = DataLoader(dataset, batch_size=8, collate_fn=KeyedCollate(collate) if use_cache else collate,
                            num_workers=1,
                            generator=torch.Generator().manual_seed(0), shuffle=True)
        out = []
        for _ in range(2):  # epochs
            for batch in loader:
                optimizer.zero_grad()
                model(**batch).loss.backward()
                out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
                optimizer.step()
        if cache is not None:
            assert cache.stats.hashed_images == 0 and cache.stats.hits == 16 and cache.stats.misses == 16
        return out

    for plain, cached in zip(grads_per_step(False), grads_per_step(True), strict=True):
        assert_gradients_close(cached, plain, rtol=1e-5)


def test_keys_from_a_trainer_collate_fn(tmp_path):
    _, _, collate = _task(8)
    trainer, _ = _fit(tmp_path, True, collate=KeyedCollate(collate), data={"num_workers": 1}, steps=8)
    cache = _cache_of(trainer)
    # hits: 32 from training, plus the label-convention probe's one no-grad forward on a few samples
    assert cache.stats.hashed_images == 0 and cache.stats.hits >= 32 and "loader workers" in cache.describe()


# ---- invalidation and refusals --------------------------------------------------------------------------------
def test_changed_weight_or_dtype_starts_a_new_store_with_the_right_features(tmp_path):
    model, dataset, collate = _task(4)
    cache = cache_vision_features(model, tmp_path)
    batch = collate([dataset[i] for i in range(4)])
    model(**batch)
    model(**batch)
    assert cache.stats.hits == 4 and len(cache.stores) == 1
    with torch.no_grad():
        model.vision_tower.blocks[0].mlp.fc1.weight[0, 0] += 0.5  # in place: the version counter moves
    changed = model(**batch).loss
    assert cache.stats.misses == 8 and len(cache.stores) == 2  # nothing served from the old store
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_loss = model(**batch).loss
    assert cache.stats.misses == 12 and len(cache.stores) == 3  # the compute dtype is part of the fingerprint
    cache.remove()
    assert torch.equal(model(**batch).loss, changed)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(**batch).loss, autocast_loss)


class _RandomFlip(Dataset):
    def __init__(self, data: Dataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        sample = dict(self.data[i])
        if torch.rand(()) < 0.5:
            sample["image"] = sample["image"].flip(-1)
        return sample


def test_random_flip_is_refused_before_training_and_never_served_stale(tmp_path):
    model, dataset, collate = _task(8)
    flipped = _RandomFlip(dataset)
    assert check_deterministic(dataset, collate) is None
    torch.manual_seed(1)
    state = torch.get_rng_state()
    reason = check_deterministic(flipped, collate, indices=range(8))
    assert "random transform" in reason and torch.equal(torch.get_rng_state(), state)  # RNG untouched
    with pytest.raises(ValueError, match="random transform"):
        VisionCache(TrainSpec().vision_cache).wrap_data(flipped, collate)
    _, keyed = VisionCache(TrainSpec().vision_cache).wrap_data(dataset, collate)
    assert len(keyed([dataset[i] for i in range(4)])[KEYS_FIELD]) == 4
    # Content keys: a flipped image is another image, so it misses; its features are its own.
    cache = cache_vision_features(model, tmp_path)
    batch = collate([dataset[i] for i in range(8)])
    model(**batch)
    flip = {**batch, "pixel_values": batch["pixel_values"].flip(-1)}
    served = model(**flip).loss
    assert cache.stats.misses == 16
    cache.remove()
    assert torch.equal(served, model(**flip).loss)


def test_a_training_tower_or_a_sharded_engine_is_refused_naming_the_field(tmp_path):
    model, _, _ = _task(4, frozen=[])
    with pytest.raises(ValueError, match=r"trains .*optimizer\.freeze"):
        cache_vision_features(model, tmp_path)
    for engine in ({"engine": "fsdp"}, {"engine": "deepspeed", "deepspeed": {"zero_stage": 3}}):
        spec = TrainSpec(vision_cache={"enabled": True}, **engine)
        with pytest.raises(ValueError, match=r"vision_cache\.enabled does not work with an engine that shards"):
            build_strategies(spec, BuildContext(torch.device("cpu")))
    with pytest.raises(ValueError, match="unknown key 'max_gib' in section 'vision_cache'; did you mean 'max_gb'"):
        TrainSpec(vision_cache={"enabled": True, "max_gib": 2})


def test_random_tower_turns_the_cache_off_and_training_is_unchanged(tmp_path):
    config = TinyVLMConfig(dropout=0.2)
    losses = []
    for use_cache in (False, True):
        model, dataset, collate = _task(4, config=config, frozen=["vision_tower"])
        cache = cache_vision_features(model, tmp_path) if use_cache else None
        torch.manual_seed(3)
        losses.append([model(**collate([dataset[i] for i in range(4)])).loss for _ in range(2)])
    assert torch.equal(torch.stack(losses[0]), torch.stack(losses[1]))  # the probe's RNG use is undone
    assert "different features" in cache.disabled and cache.stats.hits == 0
    assert "off (two runs" in cache.describe()


# ---- the store ------------------------------------------------------------------------------------------------
def test_store_round_trip_writers_bound_and_crash_tail(tmp_path):
    key = [bytes([i]) * 16 for i in range(4)]
    a = FeatureStore(tmp_path, max_bytes=4096)
    b = FeatureStore(tmp_path, max_bytes=4096)  # a second process on the same folder: its own writer slot
    assert (a.writer, b.writer) == (0, 1)
    x, y = torch.randn(3, 5), torch.randn(2, 4).to(torch.bfloat16)
    assert a.put(key[0], x) and b.put(key[1], y) and not a.put(key[0], x)
    assert b.get(key[0]) is None and b.refresh() == 1
    assert torch.equal(b.read(b.get(key[0])), x) and torch.equal(a.read(a.get(key[0])), x)
    a.refresh()
    assert torch.equal(a.read(a.get(key[1])), y) and a.get(key[1]).dtype == torch.bfloat16
    assert not a.put(key[2], torch.zeros(1200)) and a.full  # 4800 bytes > what is left of 4096
    b.close()
    with open(tmp_path / "w1.v2.idx", "ab") as f:
        f.write(b"\x01" * 10)  # a record torn by a kill
    c = FeatureStore(tmp_path, max_bytes=4096)  # takes the free slot 1, drops the torn tail, appends after y
    assert c.writer == 1 and os.path.getsize(tmp_path / "w1.v2.idx") == 72
    assert c.put(key[3], torch.ones(4)) and torch.equal(c.read(c.get(key[1])), y)
    reader = FeatureStore(tmp_path, max_bytes=4096, read_only=True)
    assert reader.writer is None and len(reader) == 3 and not reader.put(bytes(16), x)
    for store in (a, c, reader):
        store.close()


def _flip_sign_bits(store_dir, count: int | None = None) -> int:
    """Flip the sign bit of every float32 in the first `count` entries (all when None) of a store's segment files,
    as a damaged disk would; returns how many entries were hit."""
    entries = list(FeatureStore(store_dir, max_bytes=1 << 30, read_only=True).entries.values())[:count]
    for entry in entries:
        with open(store_dir / f"w{entry.writer}-{entry.segment}.bin", "r+b") as f:
            f.seek(entry.offset)
            data = bytearray(f.read(entry.nbytes))
            data[3::4] = bytes(b ^ 0x80 for b in data[3::4])
            f.seek(entry.offset)
            f.write(data)
    return len(entries)


def test_flipped_bytes_in_a_segment_file_are_never_trained_on(tmp_path, caplog):
    """A segment file damaged between two runs: its entries fail their checksums, the store is dropped (more than a
    few corrupt entries) with a warning naming vision_cache.dir, and the run trains on the tower's own features."""
    _, plain = _fit(tmp_path / "plain", False)
    _fit(tmp_path, True)
    (store_dir,) = (tmp_path / "cache").iterdir()
    assert _flip_sign_bits(store_dir) == 32
    trainer, damaged = _fit(tmp_path, True)
    assert_same_training(plain, damaged)
    cache = _cache_of(trainer)
    assert "failed their checksums" in cache.disabled and "vision_cache.dir" in cache.disabled
    assert cache.stats.corrupt == 4 and sum(h["vision_cache/corrupt"] for h in damaged.history) == 4
    assert any("vision_cache.dir" in r.getMessage() and str(store_dir) in r.getMessage() for r in caplog.records)
    assert any("vision_cache: off" in line for line in damaged.report.strategies)


def test_one_corrupt_entry_is_recomputed_replaced_and_said_once(tmp_path, caplog):
    model, dataset, collate = _task(4)
    batch = collate([dataset[i] for i in range(4)])
    expected = model(**batch).loss
    cache = cache_vision_features(model, tmp_path)
    model(**batch)
    (store_dir,) = tmp_path.iterdir()
    _flip_sign_bits(store_dir, count=1)
    reader = FeatureStore(store_dir, max_bytes=1 << 30, read_only=True)
    with pytest.raises(CorruptEntryError, match="do not match their checksum"):
        reader.read(next(iter(reader.entries.values())))  # the entry _flip_sign_bits damaged
    for _ in range(2):
        assert torch.equal(model(**batch).loss, expected)
    warnings = [r for r in caplog.records if "failed its checksum" in r.getMessage()]
    assert cache.stats.corrupt == 1 and len(warnings) == 1 and cache.disabled is None
    assert cache.stats.hits == 3 + 4  # the replaced entry hits in the third call
    fresh = FeatureStore(store_dir, max_bytes=1 << 30, read_only=True)  # another process: the later record wins
    assert len(fresh) == 4 and all(fresh.read(entry) is not None for entry in fresh.entries.values())
    cache.remove()


@pytest.mark.parametrize("kind", sorted(store_module.CHECKSUMS))
def test_each_checksum_function_catches_a_flip_and_a_reader_without_the_writers_treats_it_as_a_miss(
        tmp_path, monkeypatch, kind):
    monkeypatch.setattr(store_module, "CHECKSUM_KIND", kind)
    store = FeatureStore(tmp_path, max_bytes=1 << 20)
    x = torch.randn(64)
    assert store.put(bytes(16), x) and store.get(bytes(16)).checksum_kind == kind
    monkeypatch.setattr(store_module, "CHECKSUMS", {k: f for k, f in store_module.CHECKSUMS.items() if k != kind})
    with pytest.raises(UnverifiableEntryError, match="pip install xxhash"):
        FeatureStore(tmp_path, max_bytes=1 << 20, read_only=True).read(store.get(bytes(16)))
    monkeypatch.undo()
    _flip_sign_bits(tmp_path, count=1)
    with pytest.raises(CorruptEntryError, match="do not match"):
        store.read(store.get(bytes(16)))
    store.close()


def test_a_full_disk_is_an_uncached_run_with_a_warning_naming_the_folder(tmp_path, monkeypatch, caplog):
    """ENOSPC when an entry's blocks are reserved (before any byte goes through the map, so never a SIGBUS)."""
    _, plain = _fit(tmp_path / "plain", False)

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    trainer, full = _fit(tmp_path, True)
    assert_same_training(plain, full)
    cache = _cache_of(trainer)
    assert "no room" in cache.disabled and "vision_cache.dir" in cache.disabled and cache.stats.stored == 0
    assert any("No space left" in r.getMessage() and "vision_cache.dir" in r.getMessage() for r in caplog.records)


def test_without_fallocate_space_is_reserved_by_writing_and_a_full_disk_raises(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    store = FeatureStore(tmp_path, max_bytes=1 << 20)
    x = torch.randn(100)
    assert store.put(bytes(16), x) and torch.equal(store.read(store.get(bytes(16))), x)
    assert (tmp_path / "w0-0.bin").stat().st_blocks > 0 and store.disk_bytes() < 1 << 20  # reserved, still sparse

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        store.put(bytes([1]) * 16, x)
    assert store.get(bytes([1]) * 16) is None and len(store) == 1
    store.close()


def test_batch_keys_follow_rows_and_split_with_micro_batches():
    from vlmfast.data.batch import split_batch

    pixels = torch.rand(4, 3, 8, 8)
    keys = batch_image_keys({"pixel_values": pixels})
    assert len(keys) == 4 and len(set(keys)) == 4 and [len(k) for k in keys] == [1] * 4
    halves = split_batch({"pixel_values": pixels, KEYS_FIELD: keys}, 2)
    assert [h[KEYS_FIELD] for h in halves] == [keys[:2], keys[2:]]
    packed = batch_image_keys({"pixel_values": torch.rand(2, 3, 3, 8, 8), "images_per_row": torch.tensor([3, 1])})
    assert [len(k) for k in packed] == [3, 1]
    flat = batch_image_keys({"pixel_values": torch.rand(12, 6), "image_grid_thw": torch.tensor([[1, 2, 4], [1, 2, 2]])})
    assert isinstance(flat, FlatKeys) and len(flat.keys) == 2


# ---- Hugging Face VLMs: LLaVA, Idefics3 / SmolVLM, Qwen2-VL (tiny configs, no download) ------------------------
def _loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_hf(tmp_path, model, first, mixed, expected_unit):
    """Uncached loss and gradients, then cached (all misses, all hits, a mix: the tower then runs on the missed
    images alone, a batch of another size): the same within 1e-5, norm-relative over the whole gradient."""
    expected = [_loss_and_grads(model, b) for b in (first, first, mixed)]
    cache = cache_vision_features(model, tmp_path)
    for batch, (loss, grads) in zip((first, first, mixed), expected, strict=True):
        got_loss, got_grads = _loss_and_grads(model, batch)
        assert got_loss.item() == pytest.approx(loss.item(), rel=1e-5)
        assert_gradients_close(got_grads, grads, rtol=1e-5)
    # a trainable projector the stand-in call was not seen to run (Idefics3's: its call picks real images by value,
    # which a shape-only run cannot) is tried in the whole call, then left out by autograd on the first forward
    assert cache.unit.name == expected_unit
    assert cache.stats.hits > 0 and cache.stats.misses > cache.stats.stored - 1
    cache.remove()
    return cache


@pytest.mark.parametrize("frozen", [["vision_tower", "multi_modal_projector"], ["vision_tower"]],
                         ids=["tower+projector", "tower"])
def test_llava(tmp_path, frozen):
    from conftest import LlavaDataset, tiny_llava

    model = tiny_llava()
    for name, param in model.named_parameters():
        param.requires_grad_(not any(f in name for f in frozen))
    data = LlavaDataset(12)
    first = default_collate([data[i] for i in range(6)])
    mixed = default_collate([data[i] for i in range(3, 9)])
    unit = "get_image_features" if len(frozen) == 2 else "model.vision_tower.forward"
    cache = _check_hf(tmp_path, model, first, mixed, unit)
    assert (cache.stats.hits, cache.stats.misses) == (9, 9)


def _tiny_text(transformers, vocab=64):
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)


def _rows(prefix_tokens: list[list[int]], seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = [p + torch.randint(1, 50, (5,), generator=g).tolist() for p in prefix_tokens]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    return ids, mask


def test_idefics3_padding_images_and_tower_scope(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vision = transformers.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, image_size=16, patch_size=8)
    config = transformers.Idefics3Config(vision_config=vision, text_config={**_tiny_text(transformers), "model_type":
                                         "llama", "pad_token_id": 0}, image_token_id=60, scale_factor=2,
                                         pad_token_id=0)

    def batch(seed, images_per_row=(2, 1, 2)):
        g = torch.Generator().manual_seed(seed)
        pixels = torch.rand(3, 2, 3, 16, 16, generator=g)
        for row, n in enumerate(images_per_row):
            pixels[row, n:] = 0  # padding images: all zero
        ids, mask = _rows([[60] * n for n in images_per_row], seed)
        return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels,
                "pixel_attention_mask": torch.ones(3, 2, 16, 16, dtype=torch.bool),
                "labels": ids.masked_fill((ids == 60) | (mask == 0), -100)}

    first = batch(0)
    mixed = {**first, "pixel_values": first["pixel_values"].clone()}
    mixed["pixel_values"][2, 0] = 0.5 * torch.rand(3, 16, 16)  # one new image among cached ones
    for frozen, unit in ((("vision_model", "connector"), "get_image_features"),
                         (("vision_model",), "model.vision_model.forward")):
        model = transformers.Idefics3ForConditionalGeneration(config)
        for name, param in model.named_parameters():
            param.requires_grad_(not any(f in name for f in frozen))
        cache = _check_hf(tmp_path / unit, model, first, mixed, unit)
        assert (cache.stats.hits, cache.stats.misses) == (9, 6)  # 5 real images per batch; 1 new in the mix


def test_qwen2_vl_variable_patch_counts(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    text = {**_tiny_text(transformers), "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1],
                                                            "rope_theta": 10000.0}}
    config = transformers.Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2), text_config=text, image_token_id=60, video_token_id=61,
        vision_start_token_id=62, vision_end_token_id=63)
    model = transformers.Qwen2VLForConditionalGeneration(config)
    model.model.visual.requires_grad_(False)
    grids = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 2]])  # 16, 8, 8 patches -> 4, 2, 2 image tokens
    ids, mask = _rows([[62] + [60] * int(n) + [63] for n in grids.prod(-1) // 4], 0)
    pixels = torch.rand(int(grids.prod(-1).sum()), 3 * 2 * 4 * 4)
    first = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == 60).int(), "pixel_values": pixels,
             "image_grid_thw": grids, "labels": ids.masked_fill((ids == 60) | (mask == 0), -100)}
    mixed = {**first, "pixel_values": pixels.clone()}
    mixed["pixel_values"][16:24] = torch.rand(8, pixels.shape[1])  # the second image changes
    cache = _check_hf(tmp_path, model, first, mixed, "get_image_features")
    assert (cache.stats.hits, cache.stats.misses) == (5, 4)
    model.model.visual.merger.requires_grad_(True)  # the merger sits inside the tower: the tower trains
    with pytest.raises(ValueError, match=r"'model\.visual' trains .*merger"):
        cache_vision_features(model, tmp_path, scope="tower")
    model.model.visual.merger.requires_grad_(False)  # learned: nothing beside the tower, so scope tower is the call
    tower = cache_vision_features(model, tmp_path / "tower", scope="tower")
    assert tower.unit.name == "get_image_features"
    model(**first), model(**first)
    assert tower.stats.hits == 3 and not tower.disabled  # the patches-with-grid layout learned end to end
    tower.remove()


# ---- with the rest of the trainer: DDP, resume, packing, checkpointing, compile ---------------------------------
def _ddp_worker(cache_dir: str) -> dict:
    import tempfile

    from vlmfast import OptimizedTrainer, TrainSpec

    torch.set_num_threads(1)
    out = {}
    for use_cache in (False, True):
        model, dataset, collate = _task(32)
        spec = TrainSpec(max_steps=4, batch_size=8, device="cpu", log={"progress": "off"},
                         optimizer={"name": "sgd", "lr": 0.05, "freeze": FROZEN_ALL},
                         vision_cache={"enabled": use_cache, "dir": cache_dir},
                         save={"dir": tempfile.mkdtemp(), "resume": "never"})
        trainer = OptimizedTrainer(model, dataset, spec, collate_fn=collate)
        result = trainer.fit()
        out[use_cache] = {"losses": [h["loss"] for h in result.history],
                          "hits": [h.get("vision_cache/hits") for h in result.history],
                          "weights": _weights(trainer.engine.module)}
    return out


def test_ddp_two_ranks_share_one_store(tmp_path):
    """Each rank writes its own entries; in epoch 2 the sampler gives a rank images the other cached: all hit."""
    from conftest import spawn_two_ranks

    ranks = spawn_two_ranks(_ddp_worker, tmp_path, "ddp", str(tmp_path / "cache"))
    for rank in ranks:
        assert rank[True]["losses"] == pytest.approx(rank[False]["losses"], rel=1e-5)
        assert_gradients_close(rank[True]["weights"], rank[False]["weights"], rtol=1e-5)
        # 16 samples per rank: epoch 1 = steps 1-2 (step 1's hits are the label-convention probe's re-read)
        assert rank[True]["hits"][1:] == [0, 8, 8]
    names = {p.name for p in next((tmp_path / "cache").iterdir()).glob("w*.v2.idx")}
    assert {"w0.v2.idx", "w1.v2.idx"} <= names  # each rank wrote its own entries


@pytest.mark.parametrize("image_by_image", [False, True], ids=["same blocking", "tower image by image"])
def test_resume_reads_the_store_and_continues_exactly(tmp_path, image_by_image):
    _, plain = _fit(tmp_path / "plain", False)
    save = {"dir": str(tmp_path / "ckpt"), "every_steps": 4, "resume": "auto"}
    _fit(tmp_path, True, steps=4, save=save, image_by_image=image_by_image)
    trainer, resumed = _fit(tmp_path, True, steps=8, save=save, image_by_image=image_by_image)
    assert resumed.resumed_from is not None
    assert [h["loss"] for h in resumed.history] == pytest.approx([h["loss"] for h in plain.history][4:], rel=1e-5)
    assert [h["vision_cache/hits"] for h in resumed.history][1:] == [8] * 3  # step 1 adds the label probe's hits
    assert _cache_of(trainer).stats.misses == 32  # the first run's, restored with the checkpoint


@pytest.mark.parametrize("extra", [{"packing": {"enabled": True, "max_tokens": 128}},
                                   {"activation_checkpointing": {"enabled": True}}], ids=["packing", "checkpointing"])
def test_with_packing_or_activation_checkpointing(tmp_path, extra):
    _, plain = _fit(tmp_path, False, **extra)
    _, cached = _fit(tmp_path, True, image_by_image=True, **extra)
    assert_same_training(plain, cached)
    assert sum(h["vision_cache/hits"] for h in cached.history[4:]) == 32


def test_with_torch_compile_of_the_whole_model(tmp_path):
    """The cached call is a graph break (eager lookups) inside the compiled forward."""
    _, plain = _fit(tmp_path, False, samples=16, steps=4)
    _, cached = _fit(tmp_path, True, samples=16, steps=4, compile={"enabled": True, "backend": "aot_eager"})
    assert_same_training(plain, cached)
    assert [h["vision_cache/hits"] for h in cached.history][1:] == [0, 8, 8]  # step 1 adds the label probe's hits
    assert any(s.startswith("torch.compile: whole model") for s in cached.report.strategies)


# ---- doctor and estimate-memory know it -------------------------------------------------------------------------
def test_doctor_proposes_the_cache_for_a_frozen_tower_that_dominates_forward():
    from vlmfast.profiling.doctor import Evidence, _vision_frozen, diagnose

    sample = {"perf/step_time": 0.1, "perf/forward_time": 0.05, "perf/vision_forward_time": 0.03,
              "perf/backward_time": 0.05}

    def finding(spec, frozen):
        return next(f for f in diagnose(Evidence(samples=[sample], spec=spec, vision_frozen=frozen))
                    if f.key == "vision_tower")

    spec = TrainSpec(batch_size=4)
    frozen = finding(spec, True)
    assert frozen.change == {"vision_cache.enabled": True} and "epoch 2" in frozen.advice
    assert finding(spec, False).change == {}  # a training tower: other advice
    assert finding(TrainSpec(batch_size=4, vision_cache={"enabled": True}), True).change == {}  # already on
    model, _, _ = _task(4)
    assert _vision_frozen(model) is True
    model.vision_tower.requires_grad_(True)
    assert _vision_frozen(model) is False


def test_estimate_memory_prints_the_cache_footprint(capsys):
    import argparse

    from vlmfast.features.footprint import cache_footprint
    from vlmfast.memory.estimate_cli import add_estimate_memory_parser
    from vlmfast.memory.known_models import build_estimate_model

    tiny = cache_footprint(build_estimate_model("tiny-vlm"), images=1000, dtype_bytes=4, frozen=("projector",))
    assert (tiny.scope, tiny.feature_shape, tiny.bytes_per_image) == ("tower_and_projector", (9, 128), 9 * 128 * 4)
    parser = argparse.ArgumentParser()
    add_estimate_memory_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate-memory", "--model", "tiny-vlm", "--freeze", "vision_tower",
                              "--vision-cache", "4096", "--precision", "fp32", "--gpu-gb", "8"])
    args.run(args)
    assert "vision cache (tower): 9 x 64 x 4 B = 2.2 KiB per image -> 9.0 MiB on disk for 4,096 images" in \
        capsys.readouterr().out


# ---- every field takes effect ---------------------------------------------------------------------------------
class _CustomVLM(torch.nn.Module):
    """A model whose tower has an unusual name: found only through vision_cache.module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.eyes = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(3 * 8 * 8, 16))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, pixel_values, target):
        return torch.nn.functional.mse_loss(self.head(self.eyes(pixel_values)).squeeze(-1), target)


def test_every_field_takes_effect(tmp_path):
    model, dataset, collate = _task(8)
    batch = collate([dataset[i] for i in range(8)])
    spec = TrainSpec(vision_cache={"enabled": True, "dir": str(tmp_path / "a"), "max_gb": 0.5, "dtype": "bf16",
                                   "scope": "tower"}).vision_cache
    strategy = VisionCache(spec)
    strategy.apply(model)
    cache = strategy.cache
    assert (cache.root, cache.max_bytes, cache.unit.name) == (tmp_path / "a", 2**29, "vision_tower.forward")
    first, second = model(**batch).loss, model(**batch).loss  # bf16 storage: misses rounded like hits
    store = next(iter(cache.stores.values()))
    assert torch.equal(first, second) and store.get(next(iter(store.entries))).dtype == torch.bfloat16
    cache.remove()
    exact = cache_vision_features(model, tmp_path / "b")
    assert not torch.equal(model(**batch).loss, first)  # fp32 features differ from bf16-rounded ones
    exact.remove()
    # read_only: serves what is there, adds nothing
    reader = cache_vision_features(model, tmp_path / "a", scope="tower", dtype="bf16", read_only=True)
    assert torch.equal(model(**batch).loss, first) and reader.stats.hits == 8
    other = collate([dataset[0]])
    other["pixel_values"] = other["pixel_values"].flip(-1)
    model(**other)
    assert reader.stats.misses == 1 and reader.stats.stored == 0 and reader.entries() == 8
    reader.remove()
    # max_gb: a full store admits no more (and evicts nothing)
    tiny = cache_vision_features(model, tmp_path / "c", max_gb=3 * 9 * 128 * 4 / 2**30)  # room for 3 images
    model(**batch)
    model(**batch)
    assert tiny.entries() == 3 and tiny.stats.hits == 3 and "store full" in tiny.describe()
    tiny.remove()
    # module: a tower with an unusual name
    custom = _CustomVLM()
    custom.eyes.requires_grad_(False)
    with pytest.raises(ValueError, match=r"vision_cache\.module"):
        cache_vision_features(custom, tmp_path / "d")
    named = cache_vision_features(custom, tmp_path / "d", module="eyes")
    pixels, target = torch.rand(4, 3, 8, 8), torch.rand(4)
    assert torch.equal(custom(pixels, target), custom(pixels, target)) and named.stats.hits == 4
    assert named.unit.name == "eyes.forward"
    named.remove()
    # or a probe forward finds it: the module the images flow into first (the trainer passes its first samples)
    probed = cache_vision_features(custom, tmp_path / "e", probe_batches=[{"pixel_values": pixels, "target": target}])
    assert probed.unit.name == "eyes.forward" and probed.unit.modules == {"eyes": custom.eyes}
    probed.remove()


class _EyesVLM(TinyVLM):
    """The tiny VLM with its tower under an attribute no list of names holds: ``eyes`` (its own code calls it so)."""

    def __init__(self, config: TinyVLMConfig | None = None) -> None:
        super().__init__(config)
        self._modules = {("eyes" if k == "vision_tower" else k): v for k, v in self._modules.items()}

    @property
    def vision_tower(self) -> torch.nn.Module:  # what TinyVLM's forward calls: the module registered as `eyes`
        return self._modules["eyes"]


def test_a_tower_with_an_unusual_name_is_found_by_probing_for_the_cache_the_footprint_and_the_cost_model(tmp_path):
    """No attribute name decides: the tower is the first module the model's get_image_features enters (a stand-in
    call stopped there, nothing computed), the projector what the model holds besides it and the text model."""
    from vlmfast.data.rank_balance import CostModel
    from vlmfast.features.footprint import cache_footprint

    torch.manual_seed(0)
    _, dataset, collate = _task(8)
    model = _EyesVLM(TinyVLMConfig())
    assert "eyes.patch_embed.weight" in dict(model.named_parameters())
    model.eyes.requires_grad_(False)
    batch = collate([dataset[i] for i in range(8)])
    # the cache: the tower alone while the projector trains, then tower + projector
    tower = cache_vision_features(model, tmp_path / "a")
    assert tower.unit.name == "eyes.forward"
    plain = model(**batch).loss
    assert torch.equal(model(**batch).loss, plain) and tower.stats.hits == 8
    tower.remove()
    model.multi_modal_projector.requires_grad_(False)
    whole = cache_vision_features(model, tmp_path / "b")
    assert whole.unit.name == "get_image_features" and list(whole.unit.modules) == ["eyes", "multi_modal_projector"]
    assert CostModel.from_model(model).per_image > 0  # found again with the cache in place (the loop builds it later)
    assert whole.stats.calls == whole.stats.bypassed_calls == 0  # the stand-in call never reached the cache
    assert torch.equal(model(**batch).loss, plain) and torch.equal(model(**batch).loss, plain)
    assert whole.stats.hits == 8
    whole.remove()
    # the footprint: the tower's and the projector's output shapes
    assert cache_footprint(model, images=10, dtype_bytes=4).feature_shape == (9, 128)
    model.multi_modal_projector.requires_grad_(True)
    assert cache_footprint(model, images=10, dtype_bytes=4).feature_shape == (9, 64)
    # the cost model: the tower's parameters are the vision part
    eyes = sum(p.numel() for p in model.eyes.parameters())
    cost = CostModel.from_model(model)
    assert cost.per_image == 6.0 * eyes * model.config.num_image_tokens
    assert cost.per_token == 6.0 * (sum(p.numel() for p in model.parameters()) - eyes)
    assert CostModel.from_model(model, tower="eyes") == cost


# ---- the frozen boundary: a trainable part after the tower runs every step on its cached output ----------------
def _zoo_fit(case, frozen_paths, cache_dir, steps=2):
    """Two epochs (2 steps of the case's 8 samples) with `frozen_paths` frozen, SGD, fp32; (losses, weights moved,
    the cache or None)."""
    import copy

    model = copy.deepcopy(case.model)
    for name, param in model.named_parameters():
        if name.startswith(tuple(f"{path}." for path in frozen_paths)):
            param.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    spec = TrainSpec(max_steps=steps, batch_size=8, micro_batch_size=8, device="cpu", log={"progress": "off"},
                     optimizer={"name": "sgd", "lr": 0.1}, memory={"leak_check": False},
                     vision_cache={"enabled": cache_dir is not None, "dir": str(cache_dir)})
    trainer = OptimizedTrainer(model, case.samples, spec, loss_fn=case.loss_fn, collate_fn=case.collate_fn)
    result = trainer.fit()
    moved = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    return result, moved, (_cache_of(trainer) if cache_dir is not None else None)


@pytest.mark.parametrize("family", ["llava_onevision", "llava_next"])
def test_a_trainable_image_newline_runs_every_step_on_the_cached_tower_output(tmp_path, family):
    """Tower and projector frozen, ``image_newline`` trains: autograd on the image call finds it, so the cache
    stands in for the outermost frozen module the images enter (the tower, found by probing) and the projector and
    ``image_newline`` run on its cached output: epoch 2 all hits, the same losses and updates as without the cache,
    and ``image_newline`` moves."""
    pytest.importorskip("transformers")
    from zoo import build_case

    from vlmfast.common.image_path import find_image_modules

    case = build_case(family)
    found = find_image_modules(case.model, batches=[case.collate_fn(case.samples)])
    frozen = (found.tower, *found.projectors)
    plain, plain_moved, _ = _zoo_fit(case, frozen, None)
    cached, cached_moved, cache = _zoo_fit(case, frozen, tmp_path)
    assert cache.disabled is None and cache.unit.name == f"{found.tower}.forward"
    assert list(cache.unit.modules) == [found.tower]
    assert cached.history[1]["vision_cache/hits"] > 0 and cached.history[1]["vision_cache/misses"] == 0
    assert_same_training(plain, cached)
    assert_gradients_close(cached_moved, plain_moved, rtol=1e-5)
    newline = next(n for n in plain_moved if n.endswith("image_newline"))
    assert plain_moved[newline].abs().max() > 0  # it trains, with or without the cache


def test_a_trainable_part_inside_the_tower_is_still_refused_naming_the_tower(tmp_path):
    """Only what is frozen is cached: a tower with a trainable tensor (besides the trainable image_newline) has no
    frozen module the images enter first, so the cache refuses, naming the tower and the field to set."""
    pytest.importorskip("transformers")
    from zoo import build_case

    from vlmfast.common.image_path import find_image_modules

    case = build_case("llava_onevision")
    found = find_image_modules(case.model, batches=[case.collate_fn(case.samples)])
    tower = case.model.get_submodule(found.tower)
    case.model.requires_grad_(False)
    next(tower.parameters()).requires_grad_(True)  # one trainable tensor inside the tower
    case.model.get_submodule(found.tower.rsplit(".", 1)[0]).image_newline.requires_grad_(True)
    with pytest.raises(ValueError, match=rf"vision tower '{found.tower}' trains .*optimizer\.freeze"):
        cache_vision_features(case.model, tmp_path)


class _NewlineVLM(TinyVLM):
    """The tiny VLM whose image call adds a trainable vector after the projector (an ``image_newline`` of its own):
    a custom model, so no layout is learned end to end and the first call with gradients on finds it."""

    def __init__(self, config: TinyVLMConfig | None = None) -> None:
        super().__init__(config)
        self.trailer = torch.nn.Parameter(torch.full((self.config.text_dim,), 0.1))

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return super().get_image_features(pixel_values) + self.trailer


def test_a_custom_image_call_with_a_trainable_part_caches_the_tower_and_the_part_keeps_its_gradient(tmp_path):
    _, dataset, collate = _task(8)
    batch = collate([dataset[i] for i in range(8)])
    torch.manual_seed(0)
    model = _NewlineVLM(TinyVLMConfig())
    model.vision_tower.requires_grad_(False)
    model.multi_modal_projector.requires_grad_(False)
    expected = _loss_and_grads(model, batch)
    cache = cache_vision_features(model, tmp_path)
    assert cache.unit.name == "get_image_features"  # until a call shows what it uses
    for _ in range(3):  # the check's call (uncached), misses, hits
        loss, grads = _loss_and_grads(model, batch)
        assert loss.item() == pytest.approx(expected[0].item(), rel=1e-5)
        assert_gradients_close(grads, expected[1], rtol=1e-5)
    assert cache.disabled is None and cache.unit.name == "vision_tower.forward"
    assert (cache.stats.hits, cache.stats.misses, cache.stats.bypassed_calls) == (8, 8, 1)
    assert expected[1]["trailer"].abs().max() > 0
    cache.remove()
