"""WebDataset tar shards: write them from images + captions, read them for training without hangs or stalls.

Writing (``vlmfast shards write SRC OUT``) packs a folder of images with same-name ``.txt`` captions, or a JSONL of
``{"image": path, "text": caption}`` lines, into tar shards with webdataset's ``ShardWriter`` (count and size limits,
each shard renamed into place only when complete). Image bytes are stored as they are: no re-encoding.

Reading (:class:`ShardDataset`) builds a webdataset pipeline with what webdataset leaves to the user:

- **splitting**: shards are split by rank, then by DataLoader worker; the shard order is shuffled with
  ``(seed, epoch)`` identically on every rank, so each epoch is a partition: every sample is read once per epoch.
  (webdataset's default node splitter refuses multi-node runs.)
- **resampled mode**: every rank/worker draws shards with replacement and stops after exactly
  ``samples_per_epoch`` samples per rank, split over workers in whole batches, so all DDP ranks step the same
  number of times (uneven shards would otherwise hang DDP at the epoch's end).
- **bad samples**: a corrupt or truncated tar, an undecodable image, a missing caption are skipped at whichever
  stage finds them, counted (across workers, in shared memory) and logged, without webdataset's
  ``warn_and_continue`` 0.5 s sleep; past ``max_bad_fraction`` the run stops with an error naming the shard.
- **decode**: images to uint8 [3, H, W] tensors with PIL (optionally JPEG draft mode: decode at a reduced scale
  when the model wants small images), captions to str; then your ``to_sample`` function (picklable) turns that into
  the model's sample, e.g. :class:`CaptionTokens` for the built-in tiny VLM.

Usage::

    write_shards("images/", "shards/", max_count=1000)                   # or: vlmfast shards write images/ shards/
    dataset = ShardDataset("shards/", to_sample=CaptionTokens(ShapesTokenizer()), seed=0)
    trainer = OptimizedTrainer(model, dataset, spec, collate_fn=VLMCollator())
    dataset.counts()                                                           # {"samples": ..., "bad": ...}
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from vlmfast.common.safe_files import open_for_writing
from vlmfast.data.bad_samples import (
    LOGGED_PER_PROCESS,
    BadSampleCounts,
    BadSampleError,
    TooManyBadSamplesError,
)

__all__ = ["BadSampleError", "CaptionTokens", "ShardDataset", "TooManyBadSamplesError", "write_shards"]

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
TEXT_EXTENSIONS = ("txt", "caption", "text")
MAX_CONSECUTIVE_BAD = 1000  # nothing readable at all (e.g. every shard broken in resampled mode): stop, never spin


def _wds() -> Any:
    try:
        import webdataset
    except ImportError as exc:
        raise ImportError("WebDataset shards need the webdataset package: pip install 'vlmfast[webdataset]'") from exc
    return webdataset


# ---- writing ---------------------------------------------------------------------------------------------------
@dataclass
class ShardWriteReport:
    """What :func:`write_shards` wrote, and what it skipped (with why)."""

    shards: list[Path] = field(default_factory=list)
    samples: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        text = f"wrote {self.samples} samples to {len(self.shards)} shard(s)"
        if self.skipped:
            shown = "; ".join(f"{path}: {why}" for path, why in self.skipped[:5])
            text += f"; skipped {len(self.skipped)}: {shown}{' ...' if len(self.skipped) > 5 else ''}"
        return text


def find_pairs(src: str | Path) -> tuple[list[tuple[Path, str]], list[tuple[str, str]]]:
    """(image path, caption) pairs from a folder (images + same-stem .txt) or a JSONL, and the incomplete entries."""
    src = Path(src)
    if src.is_dir():
        return _pairs_from_folder(src)
    if src.is_file() and src.suffix in (".jsonl", ".json"):
        return _pairs_from_jsonl(src)
    raise FileNotFoundError(f"{src}: expected a folder of images with .txt captions or a .jsonl file of "
                            '{"image": path, "text": caption} lines')


def _pairs_from_folder(folder: Path) -> tuple[list[tuple[Path, str]], list[tuple[str, str]]]:
    pairs, missing = [], []
    images = sorted(p for p in folder.rglob("*") if p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS)
    for image in images:
        caption = image.with_suffix(".txt")
        if caption.is_file():
            pairs.append((image, caption.read_text(encoding="utf-8").strip()))
        else:
            missing.append((str(image), f"no caption file {caption.name}"))
    return pairs, missing


def _pairs_from_jsonl(path: Path) -> tuple[list[tuple[Path, str]], list[tuple[str, str]]]:
    pairs, missing = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            image, text = record.get("image", record.get("image_path")), record.get("text", record.get("caption"))
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"{path}:{number}: not a JSON object ({exc}); each line must be "
                             '{"image": path, "text": caption}') from exc
        if not isinstance(image, str) or not isinstance(text, str):
            raise ValueError(f"{path}:{number}: needs string fields 'image' (or 'image_path') and 'text' "
                             f"(or 'caption'), got keys {sorted(record)}")
        image_path = (path.parent / image) if not Path(image).is_absolute() else Path(image)
        if image_path.is_file():
            pairs.append((image_path, text))
        else:
            missing.append((f"{path}:{number}", f"image {image_path} not found"))
    return pairs, missing


def write_shards(
    src: str | Path,
    out: str | Path,
    max_count: int = 1000,
    max_size: float = 1e9,
    pattern: str = "shard-%06d.tar",
    skip_missing: bool = False,
    verify: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> ShardWriteReport:
    """Pack image/caption pairs from `src` into tar shards in `out` (see the module docstring)."""
    from tqdm import tqdm

    pairs, missing = find_pairs(src)
    if missing and not skip_missing:
        shown = "\n  ".join(f"{where}: {why}" for where, why in missing[:10])
        raise ValueError(f"{len(missing)} entries of {src} lack an image or caption (nothing was written):\n  {shown}"
                         "\nfix them, or pass --skip-missing to leave them out")
    if not pairs:
        raise ValueError(f"{src}: no image/caption pairs found (images: {', '.join(IMAGE_EXTENSIONS)})")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    existing = sorted(out.glob("*.tar"))
    if existing and not overwrite:
        raise ValueError(f"{out} already holds {len(existing)} .tar file(s) (e.g. {existing[0].name}): "
                              "choose an empty folder or pass --overwrite")
    report = ShardWriteReport(skipped=list(missing))
    files = _AtomicShardFiles(report)
    writer = _wds().ShardWriter(str(out / pattern), maxcount=max_count, maxsize=max_size, verbose=0,
                                opener=files.open, post=files.close)
    with writer, tqdm(total=len(pairs), unit="sample", disable=not progress, desc=f"writing {out}") as bar:
        for index, (image, caption) in enumerate(pairs):
            data = image.read_bytes()
            problem = _undecodable(data) if verify else None
            if problem:
                report.skipped.append((str(image), problem))
            else:
                writer.write({"__key__": f"{index:09d}", _image_extension(image): data, "txt": caption})
                report.samples += 1
            bar.update()
            bar.set_postfix(shards=writer.shard)
    return report


class _AtomicShardFiles:
    """ShardWriter opener/post pair: write NAME.part, rename to NAME only once the shard is complete."""

    def __init__(self, report: ShardWriteReport) -> None:
        self.report = report
        self.streams: dict[str, io.BufferedWriter] = {}

    def open(self, name: str) -> io.BufferedWriter:
        self.streams[name] = stream = open_for_writing(name + ".part", "wb", what="shard")  # closed in close()
        return stream

    def close(self, name: str) -> None:
        self.streams.pop(name).close()
        os.replace(name + ".part", name)
        self.report.shards.append(Path(name))


def _image_extension(path: Path) -> str:
    extension = path.suffix.lower().lstrip(".")
    return {"jpeg": "jpg", "tiff": "tif"}.get(extension, extension)


def _undecodable(data: bytes) -> str | None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception as exc:  # PIL raises many types for broken files
        return f"cannot decode image: {exc}"
    return None


# ---- reading ---------------------------------------------------------------------------------------------------
@dataclass
class CaptionTokens:
    """A `to_sample` for the tiny VLM: {"image", "text"} -> {"image": uint8 [3, H, W], "input_ids": LongTensor}."""

    tokenizer: Any  # anything with encode(text) -> list[int]

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return {"image": sample["image"], "input_ids": torch.tensor(self.tokenizer.encode(sample["text"]))}


def decode_image(data: bytes, draft_size: int | None = None) -> torch.Tensor:
    """Encoded image bytes -> uint8 [3, H, W]; with `draft_size`, JPEGs decode at the smallest scale >= it."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        if draft_size is not None:
            image.draft("RGB", (draft_size, draft_size))  # JPEG only: DCT scaling, 2-8x less decoding work
        array = np.asarray(image.convert("RGB"))
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def decode_sample(sample: dict[str, Any], draft_size: int | None = None) -> dict[str, Any]:
    """A raw webdataset sample (bytes per extension) -> {"image": uint8 [3, H, W], "text": str, "key": str}."""
    where = f"{sample.get('__url__')} sample {sample.get('__key__')}"
    image_ext = next((ext for ext in IMAGE_EXTENSIONS if ext in sample), None)
    text_ext = next((ext for ext in TEXT_EXTENSIONS if ext in sample), None)
    if image_ext is None or (text_ext is None and "json" not in sample):
        present = sorted(k for k in sample if not k.startswith("__"))
        raise BadSampleError(f"{where}: incomplete sample (has {present}; needs an image and a caption)")
    try:
        image = decode_image(sample[image_ext], draft_size)
        text = sample[text_ext].decode("utf-8") if text_ext else json.loads(sample["json"])["text"]
    except Exception as exc:
        raise BadSampleError(f"{where}: {type(exc).__name__}: {exc}") from exc
    return {"image": image, "text": text, "key": sample.get("__key__")}


class BadSampleCounter:
    """A webdataset handler that counts bad samples in shared memory, logs a few, never sleeps, and stops the run
    once more than `max_bad_fraction` of the samples read (at least MIN_WINDOW) were bad."""

    def __init__(self, counts: BadSampleCounts, max_bad_fraction: float, where: str) -> None:
        self.counts, self.max_bad_fraction, self.where = counts, max_bad_fraction, where
        self.consecutive = 0
        self.logged = 0

    def good(self) -> None:
        self.counts.add(1, 0)
        self.consecutive = 0

    def __call__(self, exc: Exception) -> bool:
        self.counts.add(0, 1)
        self.consecutive += 1
        reason = _describe(exc)
        if self.logged < LOGGED_PER_PROCESS:
            self.logged += 1
            more = " (further ones counted, not logged)" if self.logged == LOGGED_PER_PROCESS else ""
            log.warning("%s: skipped a bad sample: %s%s", self.where, reason, more)
        if self.counts.too_many(self.max_bad_fraction) or self.consecutive >= MAX_CONSECUTIVE_BAD:
            good, bad = self.counts.as_dict().values()
            raise TooManyBadSamplesError(
                f"{bad} of {good + bad} samples read so far were corrupt or unreadable ({bad / (good + bad):.1%}), "
                f"above max_bad_fraction {self.max_bad_fraction:g} (data.max_bad_sample_fraction); last: {reason}. "
                "Check or re-write that shard (vlmfast shards write), or raise the threshold") from exc
        return True


def _describe(exc: Exception) -> str:
    """The error with the shard it came from (webdataset appends the url to the exception's args)."""
    urls = [a for a in exc.args[1:] if isinstance(a, str)]
    text = f"{type(exc).__name__}: {exc.args[0] if exc.args else exc}"
    return f"{urls[-1]}: {text}" if urls else text


def expand_shards(urls: str | Path | Sequence[str | Path]) -> list[str]:
    """Shard paths from a folder (its *.tar), a brace pattern ("shard-{000000..000009}.tar"), or a list."""
    if isinstance(urls, (str, Path)) and Path(urls).is_dir():
        found = sorted(str(p) for p in Path(urls).glob("*.tar"))
        if not found:
            raise FileNotFoundError(f"{urls}: no .tar shards in this folder; write some with `vlmfast shards write`")
        return found
    expanded = _wds().shardlists.expand_urls(str(urls)) if isinstance(urls, (str, Path)) else [str(u) for u in urls]
    local_missing = [u for u in expanded if "://" not in u and not u.startswith("pipe:") and not Path(u).is_file()]
    if local_missing:
        raise FileNotFoundError(f"{len(local_missing)} shard(s) not found, e.g. {local_missing[0]}")
    if not expanded:
        raise ValueError(f"no shards in {urls!r}")
    return expanded


class ShardDataset(IterableDataset):
    """Training samples from WebDataset shards; see the module docstring for splitting, resampling, bad samples.

    `rank` / `world_size` default to torch.distributed's (or RANK / WORLD_SIZE); `samples_per_epoch` (per rank) is
    required with `resampled`; `batch_size` makes each worker's share a whole number of batches.
    `max_bad_fraction=None` takes the trainer's ``data.max_bad_sample_fraction`` (0.01 when used alone).
    """

    splits_by_rank = True  # the trainer does not warn that it cannot shard this stream

    def __init__(
        self,
        urls: str | Path | Sequence[str | Path],
        to_sample: Callable[[dict[str, Any]], Any] | None = None,
        seed: int = 0,
        shuffle_shards: bool = True,
        shuffle_buffer: int = 0,
        resampled: bool = False,
        samples_per_epoch: int | None = None,
        batch_size: int = 1,
        rank: int | None = None,
        world_size: int | None = None,
        max_bad_fraction: float | None = None,
        draft_size: int | None = None,
    ) -> None:
        super().__init__()
        self.urls = expand_shards(urls)
        if resampled and not samples_per_epoch:
            raise ValueError("resampled=True needs samples_per_epoch (per rank): the stream has no natural end, and "
                             "a fixed length keeps every DDP rank at the same number of batches")
        self.to_sample, self.seed, self.shuffle_shards, self.shuffle_buffer = to_sample, seed, shuffle_shards, \
            shuffle_buffer
        self.resampled, self.samples_per_epoch, self.batch_size = resampled, samples_per_epoch, batch_size
        self.rank, self.world_size = rank, world_size
        self.max_bad_fraction = max_bad_fraction
        self.draft_size = draft_size
        self.epoch = 0
        self._counts = BadSampleCounts()  # shared with the DataLoader workers

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (the trainer calls it; without it each iteration counts one up)."""
        self.epoch = epoch

    def counts(self) -> dict[str, int]:
        """Samples delivered and bad samples skipped so far, summed over this rank's processes."""
        return self._counts.as_dict()

    def reset_counts(self) -> None:
        self._counts.reset()

    def __iter__(self) -> Iterator[Any]:
        rank, world_size, worker, num_workers = self._placement()
        epoch, self.epoch = self.epoch, self.epoch + 1  # persistent workers keep their copy: count epochs here too
        where = f"rank {rank} worker {worker}"
        fraction = 0.01 if self.max_bad_fraction is None else self.max_bad_fraction
        counter = BadSampleCounter(self._counts, fraction, where)
        if self.resampled:
            urls: Iterable[str] = self._resampled_urls(rank, worker, epoch)
        else:
            urls = self._epoch_shards(rank, world_size, worker, num_workers, epoch)
        wds = _wds()
        stream = wds.tarfile_to_samples(handler=counter)({"url": url} for url in urls)
        if self.shuffle_buffer > 1:
            rng = random.Random(f"{self.seed}-{rank}-{worker}-{epoch}-samples")
            stream = wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(stream)
        stream = wds.map(self._decode, handler=counter)(stream)
        if self.resampled:
            stream = islice(stream, self._worker_quota(worker, num_workers))
        for sample in stream:
            counter.good()
            yield sample

    def _decode(self, raw: dict[str, Any]) -> Any:
        sample = decode_sample(raw, self.draft_size)
        if self.to_sample is None:
            return sample
        try:
            return self.to_sample(sample)
        except Exception as exc:
            raise BadSampleError(f"{raw.get('__url__')} sample {raw.get('__key__')}: to_sample failed: "
                                 f"{type(exc).__name__}: {exc}") from exc

    def _placement(self) -> tuple[int, int, int, int]:
        rank, world_size, _, _ = _wds().utils.pytorch_worker_info()
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank = self.rank if self.rank is not None else rank
        world_size = self.world_size if self.world_size is not None else world_size
        return rank, world_size, worker, num_workers

    def _epoch_shards(self, rank: int, world_size: int, worker: int, num_workers: int, epoch: int) -> list[str]:
        """This worker's shards: one (seed, epoch) order on every rank, split by rank, then by worker."""
        if len(self.urls) < world_size:
            raise ValueError(f"{len(self.urls)} shard(s) for {world_size} ranks: some ranks would get no data; write "
                             "more, smaller shards (vlmfast shards write --max-count) or use resampled=True")
        order = list(self.urls)
        if self.shuffle_shards:
            random.Random(f"{self.seed}-{epoch}").shuffle(order)
        mine = order[rank::world_size][worker::num_workers]
        if not mine:
            log.warning("rank %d worker %d has no shard (%d shards for %d ranks x %d workers): lower num_workers or "
                        "write more shards", rank, worker, len(self.urls), world_size, num_workers)
        return mine

    def _resampled_urls(self, rank: int, worker: int, epoch: int) -> Iterator[str]:
        rng = random.Random(f"{self.seed}-{rank}-{worker}-{epoch}")
        while True:
            yield rng.choice(self.urls)

    def _worker_quota(self, worker: int, num_workers: int) -> int:
        """Samples this worker yields per epoch: the rank's epoch in whole batches, spread over its workers."""
        batches, rest = divmod(self.samples_per_epoch or 0, self.batch_size)
        share = batches // num_workers + (worker < batches % num_workers)
        return share * self.batch_size + (rest if worker == batches % num_workers else 0)
