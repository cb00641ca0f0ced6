"""Micro-batches by token budget: each optimizer batch cut into micro-batches whose padded size stays under N tokens.

Usage in a hand-written loop::

    budget = TokenBudget(tokens=4096, image_tokens=image_token_cost(model))    # + the vision tower's patches
    for micro in split_by_tokens(batch, budget):          # longest samples first, each micro-batch trimmed
        loss = model(**micro).loss * n_items(micro) / n_items(batch)   # weighted by its share of loss tokens
        loss.backward()

    loss = accumulate_gradients(model, batch, TokenBudget(4096))   # vlmfast.hooks: the same, exact weighting

VLM samples range from 10 to 8K tokens and 0 to 8 images. A fixed number of samples per micro-batch must be small
enough for the longest ones, and then wastes the device on the short ones (and every micro-batch of a padded batch
still pays the batch's longest length). Here a micro-batch's cost is its padded length times its rows, and
micro-batches are filled longest first until the next sample would push the cost over the budget: long samples go a
few at a time, short ones many at a time, and each micro-batch is trimmed to its own longest sample. Its images
add the vision tower's patches (:func:`image_token_cost`), unpadded, since the tower keeps activations per patch
too. Packed rows (``packing``) cost their width. A sample longer than the budget runs alone (it cannot be
split): ``describe()`` and the step metrics say so.

The gradient stays the full-batch gradient: gradient accumulation weights each micro-batch by its share of loss
tokens, counted per micro-batch, whatever the split (``vlmfast.strategies.accumulation``); ranks agree on the number
of micro-batches and pad with zero-weight ones (``AccumulationPlan.padding``). The out-of-memory fallback halves N
and retries the batch; after a run of clean steps it doubles N back, up to the configured budget.

Reported per step: ``micro_batches`` and ``micro_batch_tokens`` (the largest padded cost), ``micro_batch_rows``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor

from vlmfast.common.utils import unwrap_model
from vlmfast.data.batch_layout import (
    IMAGE_KEYS,
    VIDEO_KEYS,
    BatchLayout,
    BatchSplitError,
    items_per_sample,
    take_samples,
)
from vlmfast.data.micro_batches import SampleBatch
from vlmfast.engines.collectives import agree_max
from vlmfast.memory.oom_errors import FAILED, OK, OOM, OutOfMemoryAtMinimumError, free_memory, is_oom_error
from vlmfast.strategies.base import Step, Strategy

__all__ = [
    "Pick",
    "TokenBudget",
    "TokenBudgetSizer",
    "image_token_cost",
    "images_per_row",
    "micro_batch_cost",
    "plan_token_micro_batches",
    "sample_costs",
    "sample_lengths",
    "split_by_tokens",
    "take",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Keys laid out [B, T, ...] (token keys) besides any tensor shaped like input_ids; trimmed with the sequence.
TOKEN_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", "token_type_ids", "shift_labels",
              "mm_token_type_ids", "cross_attention_mask")
COUNT_SUFFIX = "_per_row"  # packing's images_per_row / <key>_per_row: how many of [B, K, ...] are real


# ----------------------------------------------------------------------------------------------------------------
# costs and the plan


def sample_lengths(batch: Mapping[str, Any], prepended_tokens: int = 0, images: Tensor | None = None) -> list[int]:
    """Language-model tokens of each row of a collated batch: real tokens (``attention_mask``; a packed or unmasked
    row: its width), plus ``prepended_tokens`` per image for models that put image tokens before the text
    themselves (the tiny VLM's padded rows).

    Usage: ``sample_lengths(batch)`` -> ``[57, 12, ...]``
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        raise ValueError("micro_batch_tokens needs a collated batch with 'input_ids' [rows, tokens] to measure "
                         "sample lengths (dict batches only)")
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor) and mask.shape == ids.shape:
        lengths = mask.ne(0).sum(dim=1)
    else:
        lengths = torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long)
    if prepended_tokens:
        lengths = lengths + prepended_tokens * (images if images is not None else images_per_row(batch))
    return [int(n) for n in lengths.tolist()]


def images_per_row(batch: Mapping[str, Any], layout: BatchLayout | None = None) -> Tensor:
    """Images of each row, by the rules that split the batch (:func:`vlmfast.data.batch_layout.items_per_sample`:
    ``images_per_row``, image tokens in ``input_ids``, grids, pixel masks); none for a batch without image keys.
    Raises :class:`BatchSplitError` naming the key when no rule proves it (never a first-dimension guess)."""
    counts = items_per_sample(batch, layout)
    return torch.tensor(counts if counts is not None else [0] * batch["input_ids"].shape[0], dtype=torch.long)


def sample_costs(batch: Mapping[str, Any], image_tokens: int = 0, prepended_tokens: int = 0,
                 layout: BatchLayout | None = None) -> list[int]:
    """What each row costs alone: its language-model tokens plus ``image_tokens`` per image (the vision tower's
    tokens, :func:`image_token_cost`).

    Usage: ``sample_costs(batch, image_tokens=9)`` -> ``[75, 12, ...]``
    """
    images = images_per_row(batch, layout)
    lengths = sample_lengths(batch, prepended_tokens, images)
    images = images.tolist()
    return [n + image_tokens * k for n, k in zip(lengths, images, strict=True)]


def plan_token_micro_batches(lengths: Sequence[int], max_tokens: int, max_rows: int | None = None, *,
                             images: Sequence[int] | None = None, image_tokens: int = 0) -> list[list[int]]:
    """Row indices of each micro-batch, longest first, each filled while its cost stays within ``max_tokens``.

    Usage: ``plan_token_micro_batches([900, 20, 30, 400], 1000)`` -> ``[[0], [3, 2], [1]]``

    A micro-batch's cost is rows x its longest length (the language model runs padded rows) plus ``image_tokens``
    per image of its rows (the vision tower runs each image, unpadded). A row costing more than ``max_tokens`` alone
    gets a micro-batch of its own. Deterministic: ties keep batch order.
    """
    if max_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {max_tokens}")
    images = list(images) if images is not None else [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    vision = 0
    for i in order:
        group = groups[-1] if groups else None
        if group is not None and (max_rows is None or len(group) < max_rows):
            cost = (len(group) + 1) * lengths[group[0]] + image_tokens * (vision + images[i])
            if cost <= max_tokens:
                group.append(i)
                vision += images[i]
                continue
        groups.append([i])
        vision = images[i]
    return groups


def micro_batch_cost(lengths: Sequence[int], images: Sequence[int], group: Sequence[int], image_tokens: int) -> int:
    """The padded cost of one micro-batch (see :func:`plan_token_micro_batches`)."""
    return len(group) * max(lengths[i] for i in group) + image_tokens * sum(images[i] for i in group)


# ----------------------------------------------------------------------------------------------------------------
# cutting a collated batch


@dataclass(frozen=True)
class Pick:
    """One micro-batch of a token-budget split, planned on the host: its rows (samples), the columns they use and,
    per per-row image key ([rows, images, ...] with a ``<key>_per_row`` / ``images_per_row`` count), the image slots
    kept (the rows' most, at least 1). :func:`take` applies a pick to any copy of the batch without reading it.

    Usage: ``picks = TokenBudget(4096).plan(host_batch); micro = take(device_batch, picks[0], host=host_batch)``
    """

    rows: tuple[int, ...]
    columns: slice
    slots: Mapping[str, int] = field(default_factory=dict)


def _pick(batch: Mapping[str, Any], rows: list[int]) -> Pick:
    """Plan one micro-batch of ``rows``: reads the batch's mask and image counts (give it the host copy)."""
    slots = {}
    for key in batch:
        counts = batch.get("images_per_row" if key == "pixel_values" else f"{key}{COUNT_SUFFIX}")
        if isinstance(counts, Tensor):
            slots[key] = max(int(counts[rows].max()), 1)  # per-row image slots beyond every row's count are cut
    return Pick(tuple(rows), _columns(batch, rows), slots)


def take(batch: Mapping[str, Any], pick: Pick, keys: Sequence[str] | None = None, layout: BatchLayout | None = None,
         host: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``pick``'s samples of a collated ``batch`` (only ``keys`` when given), by the key-aware rules that split
    batches by samples (:func:`vlmfast.data.batch_layout.take_samples`: each sample's images found from its image
    tokens, grids or pixel masks, refused naming the key where no rule proves it); then per-token keys cut to the
    pick's columns and per-row image slots to its count. The rules read ``host`` (the batch's host copy), so a device
    batch is gathered without waiting for the device.

    Usage: ``micro_batches = [take(device_batch, p, layout=layout, host=host_batch) for p in budget.plan(host_batch)]``
    """
    if keys is not None:
        batch = {k: v for k, v in batch.items() if k in keys}
        host = {k: v for k, v in host.items() if k in keys} if host is not None else None
    tokens = _token_shape(host if host is not None else batch)
    (micro,) = take_samples(batch, [pick.rows], layout, host=host)
    return {key: _trim(key, value, pick, tokens) for key, value in micro.items()}


def _token_shape(batch: Mapping[str, Any]) -> tuple[int, int] | None:
    for key in ("input_ids", "attention_mask", "labels"):
        value = batch.get(key)
        if isinstance(value, Tensor) and value.dim() == 2:
            return tuple(value.shape)  # type: ignore[return-value]
    return None


def _is_image_key(key: str) -> bool:
    return key in IMAGE_KEYS or key in VIDEO_KEYS or any(part in key for part in ("pixel", "image", "video"))


def _trim(key: str, value: Any, pick: Pick, tokens: tuple[int, int] | None) -> Any:
    """Per-token keys (ids, masks, labels, positions: ``[rows, T, ...]``, mRoPE ``[C, rows, T]``) cut to the pick's
    columns; per-row image slots to its count. Image keys are never cut by shape."""
    if not isinstance(value, Tensor) or value.dim() < 2:
        return value
    if key in pick.slots and value.dim() >= 3:
        return value[:, : pick.slots[key]]
    if tokens is None:
        return value
    rows, width = len(pick.rows), tokens[1]
    if value.shape == (rows, width):  # shaped like input_ids: per token whatever its name (Kosmos-2's
        return value[:, pick.columns]  # image_embeds_position_mask marks its image positions among the tokens)
    if _is_image_key(key):
        return value
    if key == "position_ids" and value.dim() == 3 and value.shape[1:] == (rows, width):
        return value[:, :, pick.columns]
    if value.shape[:2] == (rows, width):  # [rows, T, ...]: per token (a non-image key)
        return value[:, pick.columns]
    return value


def _columns(batch: Mapping[str, Any], rows: list[int]) -> slice:
    """The columns any of ``rows`` uses: right or left padding beyond them is cut (packed rows keep all)."""
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    if not isinstance(mask, Tensor) or mask.shape != ids.shape:
        return slice(None)
    used = mask[rows].ne(0).any(dim=0).nonzero().squeeze(1)
    if used.numel() == 0:
        return slice(0, 1)
    return slice(int(used[0]), int(used[-1]) + 1)


def split_by_tokens(batch: Mapping[str, Any], budget: TokenBudget | int) -> list[dict[str, Any]]:
    """Cut a collated batch into micro-batches that each cost at most ``budget`` tokens (longest first, trimmed).

    Usage: ``micro_batches = split_by_tokens(batch, TokenBudget(4096, image_tokens=9))``

    Rows are gathered (a copy, unlike ``split_batch``'s views: micro-batches are not contiguous slices), token keys
    are cut to the micro-batch's own columns (right or left padding), per-row images to its largest image count.
    """
    budget = budget if isinstance(budget, TokenBudget) else TokenBudget(int(budget))
    return budget.split(batch)


# ----------------------------------------------------------------------------------------------------------------
# the size object the sizer hands to the accumulation plan


@dataclass
class TokenBudget:
    """A micro-batch size in tokens: what ``GradientAccumulation.plan`` splits by when handed this instead of an int.

    Usage: ``TokenBudget(tokens=4096, max_rows=16, image_tokens=9).split(batch)``
    """

    tokens: int
    max_rows: int | None = None  # micro_batch_size as a cap on rows, if set
    image_tokens: int = 0  # vision-tower tokens charged per image: see image_token_cost
    prepended_tokens: int = 0  # language-model tokens per image the model adds before the text (not in input_ids)
    layout: BatchLayout | None = None  # the model's image / video token ids: how a collated batch's images map
    last: dict[str, Any] = field(default_factory=dict)  # the last split: micro_batches, max tokens, rows
    picks: list[Pick] = field(default_factory=list, repr=False)  # the last split's plan: see host_micro_batches
    _host: Any = field(default=None, repr=False)  # the last split's host batch (or SampleBatch)
    _warned: bool = field(default=False, repr=False)  # images not charged: said once

    def split(self, batch: Any, host: Any = None) -> list[Any]:
        """Micro-batches of ``batch``, each costing at most ``tokens`` unless a sample alone does.

        - A :class:`SampleBatch` (vlmfast's loader): planned on its batch collated whole, then each micro-batch is
          collated from its own samples by the user's ``collate_fn``: exact for any image layout.
        - A collated dict (the user's own DataLoader): cut by the key-aware rules (:func:`take`).

        ``host``: the host batch ``batch`` was copied from (device prefetch): the split is planned there (lengths,
        image counts, columns) and only the rows are gathered from ``batch``, so no device value is read."""
        if isinstance(batch, SampleBatch):  # planned on all its samples (a rank's share may hold more than one chunk)
            chunks = batch.host_micro_batches
            whole = chunks[0] if len(chunks) == 1 else batch.first(len(batch))
            self.picks, self._host = self.plan(whole, lenient=True), batch
            return batch.collate_groups([list(pick.rows) for pick in self.picks])
        self._host = host if host is not None else batch
        self.picks = self.plan(self._host)
        return [take(batch, pick, layout=self.layout, host=self._host) for pick in self.picks]

    def plan(self, batch: Any, lenient: bool = False) -> list[Pick]:
        """The micro-batches of ``batch`` as :class:`Pick` s, longest first (reads its lengths and image counts:
        give it the host copy). Records the split's figures in ``last``. Usage: ``budget.plan(host_batch)``

        ``lenient``: where no rule proves each sample's image count, images are not charged (said once) instead of
        refused: for a batch whose micro-batches are collated from their samples, the split stays exact."""
        if not isinstance(batch, Mapping):
            raise ValueError(f"micro_batch_tokens splits dict batches (a collate_fn returning a dict of tensors); "
                             f"got a {type(batch).__name__}: use micro_batch_size")
        images_tensor = self._images(batch, lenient)
        lengths = sample_lengths(batch, self.prepended_tokens, images_tensor)
        images = images_tensor.tolist()
        groups = plan_token_micro_batches(lengths, self.tokens, self.max_rows, images=images,
                                          image_tokens=self.image_tokens)
        costs = [micro_batch_cost(lengths, images, group, self.image_tokens) for group in groups]
        self.last = {"micro_batches": len(groups), "micro_batch_tokens": max(costs),
                     "micro_batch_rows": max(len(g) for g in groups), "real_tokens": sum(lengths),
                     "over_budget": sum(len(g) == 1 and c > self.tokens for g, c in zip(groups, costs, strict=True))}
        return [_pick(batch, group) for group in groups]

    def _images(self, batch: Mapping[str, Any], lenient: bool) -> Tensor:
        try:
            return images_per_row(batch, self.layout)
        except BatchSplitError as exc:
            if not lenient:
                raise
            if not self._warned:
                log.warning("micro_batch_tokens: images not charged to the budget (%s); micro-batches are still "
                            "collated from their own samples, so the split is exact", str(exc).split(";")[0])
            self._warned = True
            return torch.zeros(batch["input_ids"].shape[0], dtype=torch.long)

    def host_micro_batches(self, host: Any, keys: Sequence[str] | None = None) -> list[Any]:
        """The last split's micro-batches on the host (only ``keys``), in the same order: what to count loss tokens
        on without reading the device copy. Usage: ``budget.host_micro_batches(host, ["labels"])``"""
        if isinstance(self._host, SampleBatch):
            return self._host.group_host_micro_batches
        return [take(host, pick, keys, layout=self.layout) for pick in self.picks]

    def resized(self, tokens: int) -> TokenBudget:
        """The same budget at ``tokens`` (rows cap, image charges and layout kept)."""
        return TokenBudget(tokens, self.max_rows, self.image_tokens, self.prepended_tokens, self.layout)

    def halved(self) -> TokenBudget:
        """Half the budget (the OOM fallback's retry size); rows capped as before."""
        return self.resized(max(self.tokens // 2, 1))

    def grown(self, limit: int) -> TokenBudget:
        """Twice the budget, at most ``limit`` (growing back after clean steps)."""
        return self.resized(min(self.tokens * 2, limit))

    @property
    def at_minimum(self) -> bool:
        """Halving cannot help: every micro-batch of the last split already held a single row."""
        return bool(self.last) and self.last["micro_batch_rows"] <= 1

    def __str__(self) -> str:
        rows = f", at most {self.max_rows} rows" if self.max_rows else ""
        return f"{self.tokens} tokens{rows}"


# ----------------------------------------------------------------------------------------------------------------
# the sizer: what the loop's micro_batching.run calls


class TokenBudgetSizer(Strategy):
    """Hands the step a :class:`TokenBudget`; with ``oom`` on, halves it on OOM (ranks agree) and grows it back.

    Usage: ``sizer = TokenBudgetSizer(4096); loss, plan = sizer.run(lambda size: train_step(batch, size), cleanup)``

    It replaces the micro-batch-size sizer (``FixedMicroBatchSize`` / ``OOMFallback``) when ``micro_batch_tokens``
    is set: the loop builds it with :func:`vlmfast.strategies.registry.build_micro_batching`.
    """

    name = "micro_batch_tokens"

    def __init__(self, tokens: int, *, max_rows: int | None = None, image_tokens: int = 0, prepended_tokens: int = 0,
                 layout: BatchLayout | None = None, oom: Any = None, describe_memory: Callable[[], str] | None = None,
                 on_oom: Callable[[], None] | None = None) -> None:
        self.configured = tokens
        self.budget = TokenBudget(tokens, max_rows, image_tokens, prepended_tokens, layout)
        self.oom = oom if oom is not None and oom.enabled else None
        self.grow_after = oom.grow_after_steps if self.oom is not None else None
        self.clean_steps = 0
        self.events: list[dict[str, Any]] = []
        self.describe_memory = describe_memory or (lambda: "")
        self.on_oom = on_oom
        self._seen = {"micro_batches": 0, "steps": 0, "over_budget": 0}

    @property
    def micro_batch_size(self) -> int:
        """Rows of the largest micro-batch of the last step (what the loop reports as micro_batch_size)."""
        return int(self.budget.last.get("micro_batch_rows", self.budget.max_rows or 0))

    def run(self, attempt: Callable[[TokenBudget], T], cleanup: Callable[[], None]) -> T:
        """``attempt(budget)`` until it finishes without OOM on every rank (or at once, without the fallback)."""
        if self.oom is None:
            return attempt(self.budget)

        self._maybe_grow()
        while True:
            status, error = OK, None
            try:
                result = attempt(self.budget)
            except Exception as exc:
                status, error = (OOM, None) if is_oom_error(exc) else (FAILED, exc)
            worst = agree_max(status)  # every rank joins, so no peer waits for one about to raise
            if error is not None:
                raise error
            if worst == FAILED:
                raise RuntimeError("another rank failed during forward/backward (its traceback shows why); "
                                   "stopping this rank too")
            if worst == OK:
                self.clean_steps += 1
                return result
            result = None
            cleanup()
            free_memory()
            if status == OOM and self.on_oom is not None:
                self.on_oom()
            self._shrink(status == OOM)

    def _shrink(self, oom_here: bool) -> None:
        if self.budget.at_minimum or self.budget.tokens <= 1:
            raise OutOfMemoryAtMinimumError(
                f"out of memory with micro_batch_tokens {self.budget.tokens}: every micro-batch already holds one "
                f"sample, so a smaller budget cannot help.\n{self.describe_memory()}")
        self._change(self.budget.halved(), "out of memory" + ("" if oom_here else " on another rank"))
        self.clean_steps = 0

    def _maybe_grow(self) -> None:
        if self.grow_after is None or self.budget.tokens >= self.configured or self.clean_steps < self.grow_after:
            return
        self._change(self.budget.grown(self.configured), f"{self.clean_steps} clean steps")
        self.clean_steps = 0

    def _change(self, new: TokenBudget, reason: str) -> None:
        log.warning("oom fallback: micro_batch_tokens %d -> %d (%s)", self.budget.tokens, new.tokens, reason)
        self.events.append({"from": self.budget.tokens, "to": new.tokens, "reason": reason})
        self.budget = new

    def after_backward(self, step: Step) -> None:
        last = self.budget.last
        if last:
            step.metrics.update({k: last[k] for k in ("micro_batches", "micro_batch_tokens", "micro_batch_rows")})
            self._seen["micro_batches"] += last["micro_batches"]
            self._seen["over_budget"] += last["over_budget"]
            self._seen["steps"] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"configured": self.configured, "tokens": self.budget.tokens, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and state.get("configured") == self.configured:  # a deliberately changed spec wins
            self.budget = self.budget.resized(state["tokens"])
            self.clean_steps = state["clean_steps"]

    def describe(self) -> str:
        seen = self._seen
        per_step = f"{seen['micro_batches'] / seen['steps']:.1f} micro-batches per step" if seen["steps"] else ""
        over = f", {seen['over_budget']} sample(s) longer than the budget ran alone" if seen["over_budget"] else ""
        changes = "; ".join(f"{e['from']}->{e['to']} ({e['reason']})" for e in self.events)
        fallback = f"; oom fallback: {changes or 'no OOM'}" if self.oom is not None else ""
        return f"micro-batches by tokens: {self.budget} each, longest first, {per_step}{over}{fallback}"


def image_token_cost(model: Any) -> int:
    """Tokens the vision tower runs per image (its patches), charged per image on top of the padded rows.

    Usage: ``image_token_cost(tiny_vlm)`` -> 9; ``image_token_cost(llava_1_5)`` -> 576

    The vision tower keeps activations per patch much as the language model does per token, and runs each image
    unpadded, so a micro-batch is charged for its images' patches whatever its rows' lengths.
    """
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    patches = getattr(config, "num_image_tokens", None)  # the tiny VLM
    if vision is not None and getattr(vision, "image_size", None) and getattr(vision, "patch_size", None):
        size, patch = vision.image_size, vision.patch_size
        size = size[0] if isinstance(size, (list, tuple)) else size
        patch = patch[0] if isinstance(patch, (list, tuple)) else patch
        patches = (size // patch) ** 2
    return int(patches or 0)

