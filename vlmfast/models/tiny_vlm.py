"""A tiny LLaVA-shaped vision-language model in pure PyTorch.

Layout (the submodule names are relied upon by other vlmfast code to find components and blocks)::

    TinyVLM
      vision_tower            ViT: patch_embed (conv) + pos_embed + blocks[VisionBlock] + norm
      multi_modal_projector   linear_1 -> GELU -> linear_2 (vision_dim -> text_dim)
      language_model          embed_tokens + embed_positions + layers[DecoderLayer] + norm + lm_head

Image tokens are prepended to the caption tokens and the language model runs causally over both. Attention goes
through ``vlmfast.attention`` (SDPA by default), so ``set_attention_backend`` can switch it per tower.

Packed rows (from ``vlmfast.data.packing.PackingCollator``) hold several samples each: ``input_ids`` carry
``IMAGE_PLACEHOLDER_ID`` where a sample's image tokens go, ``position_ids`` restart at every sample, and attention
never crosses samples.

Usage::

    model = TinyVLM(TinyVLMConfig())
    out = model(pixel_values, input_ids, labels=labels)
    out.loss.backward()
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmfast.attention.dispatch import ScaledDotProductAttention
from vlmfast.attention.documents import PackedDocuments, host_to_device
from vlmfast.data.packing import IMAGE_PLACEHOLDER_ID  # where packed rows put a sample's image tokens
from vlmfast.models.shapes import ShapesCaptionDataset, ShapesTokenizer, VLMCollator

__all__ = [
    "IMAGE_PLACEHOLDER_ID",
    "Attention",
    "DecoderLayer",
    "LanguageModel",
    "MultiModalProjector",
    "TinyVLM",
    "TinyVLMConfig",
    "VLMOutput",
    "VisionBlock",
    "VisionTower",
    "build_tiny_vlm_task",
    "causal_lm_loss",
]

IGNORE_INDEX = -100


def _default_vocab_size() -> int:
    return ShapesTokenizer().vocab_size


@dataclass
class TinyVLMConfig:
    """Sizes of a ``TinyVLM`` (usage: ``TinyVLMConfig(text_layers=4)``)."""

    # One 16x16 patch per cell of the shapes' 3x3 grid: 9 image tokens, cheap and easy to learn from.
    image_size: int = 48
    patch_size: int = 16
    vision_dim: int = 64
    vision_layers: int = 2
    vision_heads: int = 4
    text_dim: int = 128
    text_layers: int = 2
    text_heads: int = 4
    mlp_ratio: int = 4
    vocab_size: int = field(default_factory=_default_vocab_size)
    max_text_len: int = 64  # a shapes caption with max_objects=8 has 57 tokens
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} not a multiple of patch_size {self.patch_size}")
        if self.vision_dim % self.vision_heads or self.text_dim % self.text_heads:
            raise ValueError("vision_dim / text_dim must be divisible by vision_heads / text_heads")

    @property
    def num_image_tokens(self) -> int:
        """Number of patch tokens the vision tower emits per image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def max_positions(self) -> int:
        """Longest sequence (image tokens + text tokens) the language model accepts."""
        return self.num_image_tokens + self.max_text_len


@dataclass
class VLMOutput:
    """Model output: ``loss`` (None without labels) and ``logits`` [B, T, vocab] over text positions."""

    loss: Tensor | None
    logits: Tensor


class Attention(nn.Module):
    """Multi-head self-attention through ``vlmfast.attention`` (SDPA unless switched).

    The single place both towers compute attention, so ``set_attention_backend`` can swap it.
    Usage: ``Attention(dim=64, num_heads=4, causal=False)(x)`` with ``x`` [B, T, dim].
    """

    def __init__(self, dim: int, num_heads: int, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.causal = causal
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attend = ScaledDotProductAttention()  # no parameters: state_dict keys are unchanged

    def forward(self, x: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        # No mask: vision attends fully; text is right-padded after the image tokens, so with a causal
        # mask real tokens never see pads (pad positions' outputs are ignored by the loss). Packed rows
        # pass their documents, and attention stays inside each one.
        out = self.attend(
            q, k, v, causal=self.causal, documents=documents, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear -> GELU -> Linear (usage: ``MLP(64, 256)(x)``)."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (usage: see subclasses)."""

    causal: bool = False

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, causal=self.causal, dropout=dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_ratio * dim, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, documents: PackedDocuments | None = None) -> Tensor:
        x = x + self.drop(self.attn(self.norm1(x), documents))
        return x + self.mlp(self.norm2(x))


class VisionBlock(TransformerBlock):
    """Bidirectional ViT block; a distinct class so wrapping policies can target it by type.

    Usage: ``VisionBlock(dim=64, num_heads=4, mlp_ratio=4)(x)``
    """

    causal = False


class DecoderLayer(TransformerBlock):
    """Causal decoder block of the language model (usage: ``DecoderLayer(128, 4, 4)(x)``)."""

    causal = True


class VisionTower(nn.Module):
    """ViT encoder: images [B, 3, S, S] -> patch features [B, N, vision_dim].

    Usage: ``VisionTower(TinyVLMConfig())(pixel_values)``
    """

    def __init__(self, config: TinyVLMConfig) -> None:
        super().__init__()
        c = config
        self.patch_embed = nn.Conv2d(3, c.vision_dim, kernel_size=c.patch_size, stride=c.patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, c.num_image_tokens, c.vision_dim))
        self.blocks = nn.ModuleList(
            VisionBlock(c.vision_dim, c.vision_heads, c.mlp_ratio, c.dropout) for _ in range(c.vision_layers)
        )
        self.norm = nn.LayerNorm(c.vision_dim)

    def forward(self, pixel_values: Tensor) -> Tensor:
        # Match the weights' dtype so a bf16/fp16 model accepts the collator's float32 images.
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        x = x.flatten(2).transpose(1, 2)
        if x.shape[1] != self.pos_embed.shape[1]:
            raise ValueError(f"expected {self.pos_embed.shape[1]} patches, got {x.shape[1]} (image size?)")
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class MultiModalProjector(nn.Module):
    """Two-layer GELU MLP mapping vision features into the text embedding space.

    Usage: ``MultiModalProjector(64, 128)(features)``
    """

    def __init__(self, vision_dim: int, text_dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(text_dim, text_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LanguageModel(nn.Module):
    """Causal decoder over input embeddings; ``embed_tokens`` turns ids into those embeddings.

    Usage: ``logits = lm(lm.embed_tokens(input_ids))``
    """

    def __init__(self, config: TinyVLMConfig) -> None:
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.text_dim)
        self.embed_positions = nn.Embedding(c.max_positions, c.text_dim)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(
            DecoderLayer(c.text_dim, c.text_heads, c.mlp_ratio, c.dropout) for _ in range(c.text_layers)
        )
        self.norm = nn.LayerNorm(c.text_dim)
        self.lm_head = nn.Linear(c.text_dim, c.vocab_size, bias=False)

    def forward(self, inputs_embeds: Tensor, logits_from: int = 0, position_ids: Tensor | None = None,
                document_lengths: list[list[int]] | None = None, apply_head: bool = True,
                attention_mask: Tensor | None = None) -> Tensor:
        """Logits [B, T - logits_from, vocab] for positions ``logits_from`` onwards (the normed hidden states
        without ``apply_head``: a chunked loss applies the head itself).

        ``position_ids`` [B, T] that restart at 0 mark packed documents: attention stays inside each, and every
        position gets logits (a document's prefix is not at the row's start). ``document_lengths`` (per row, on
        the host, from vlmfast's packing collator) describes the same documents without any read from the device.
        ``attention_mask`` [B, T] is not needed here (right padding under a causal mask never reaches a real
        token) but says where the padding is to whoever packs these rows (packing by embeddings).
        """
        del attention_mask
        hidden = self.hidden_states(inputs_embeds, 0 if position_ids is not None else logits_from, position_ids,
                                    document_lengths)
        return self.lm_head(hidden) if apply_head else hidden

    def hidden_states(self, inputs_embeds: Tensor, logits_from: int = 0, position_ids: Tensor | None = None,
                      document_lengths: list[list[int]] | None = None) -> Tensor:
        """The final (normed) hidden states [B, T - logits_from, dim]: what ``lm_head`` turns into logits."""
        t = inputs_embeds.shape[1]
        max_positions = self.embed_positions.num_embeddings
        documents = None
        if position_ids is None:
            if t > max_positions:
                raise ValueError(f"sequence of {t} tokens exceeds max_positions={max_positions}")
            positions = torch.arange(t, device=inputs_embeds.device)
        else:
            positions = position_ids.to(inputs_embeds.device)
            too_long = f"a packed sample is longer than max_positions={max_positions}, which the model accepts"
            if document_lengths is not None:  # checked on the host for free
                if max((n for row in document_lengths for n in row), default=0) > max_positions:
                    raise ValueError(too_long)
                documents = PackedDocuments.from_lengths(document_lengths, t, inputs_embeds.device)
            else:  # checked on the device: reading positions.max() would make the host wait for the GPU
                torch._assert_async(positions.max() < max_positions, too_long)
                documents = PackedDocuments.from_position_ids(positions)  # built once, shared by every layer
        x = self.drop(inputs_embeds + self.embed_positions(positions))
        for layer in self.layers:
            x = layer(x, documents=documents)
        # Skipping the prefix (image tokens) before the head saves work: they never carry a loss.
        return self.norm(x[:, logits_from:])


class TinyVLM(nn.Module):
    """LLaVA-shaped VLM: ViT patches -> projector -> prepended to caption embeddings -> causal LM.

    Usage: ``out = TinyVLM(TinyVLMConfig())(pixel_values, input_ids, labels=labels); out.loss.backward()``
    """

    # Declared so trainers count loss tokens as HF causal LMs do (labels[:, 1:] != -100) and pass
    # num_items_in_batch for exact gradient accumulation, without guessing from the class name.
    loss_shifts_labels = True
    accepts_loss_kwargs = True

    def __init__(self, config: TinyVLMConfig | None = None) -> None:
        super().__init__()
        self.config = config or TinyVLMConfig()
        self.vision_tower = VisionTower(self.config)
        self.multi_modal_projector = MultiModalProjector(self.config.vision_dim, self.config.text_dim)
        self.language_model = LanguageModel(self.config)
        self.apply(_init_weights)

    @property
    def prepended_image_tokens(self) -> int:
        """Image tokens placed before each sample's text (the packing collator reserves them per sample)."""
        return self.config.num_image_tokens

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Total (or trainable) parameter count."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def get_image_features(self, pixel_values: Tensor) -> Tensor:
        """Projected image features [N, image tokens, text_dim] of images [N, 3, S, S]: what the language model
        receives (Hugging Face VLMs have the same method; the vision cache stands in for it when both the tower and
        the projector are frozen)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def forward(
        self,
        pixel_values: Tensor,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        num_items_in_batch: int | Tensor | None = None,
        position_ids: Tensor | None = None,
        images_per_row: Tensor | None = None,
        document_lengths: list[list[int]] | None = None,
    ) -> VLMOutput:
        """Logits over the text positions, plus the shifted causal-LM loss when ``labels`` is given.

        ``attention_mask`` is not needed for the result (right padding under the causal mask never reaches a real
        token); it goes to the language model so that packing by embeddings can find the padding. With
        ``num_items_in_batch`` the loss is ``sum / num_items_in_batch`` (for exact gradient accumulation
        over micro-batches), otherwise the mean over non-ignored shifted labels.

        Packed rows (``position_ids`` given): ``pixel_values`` is [R, K, 3, S, S] with ``images_per_row``
        [R] valid images per row (or [N, 3, S, S] in row order), and logits cover every position.
        ``document_lengths`` (per row, host ints; vlmfast's packing collator adds it) lets the packed path run
        without reading anything back from the device.
        """
        # Through the language model's own call (not its parts), so hooks on it (phase timer, FLOPs by tower) fire.
        logits = self._language_model(pixel_values, input_ids, position_ids, images_per_row, document_lengths,
                                      apply_head=True, attention_mask=attention_mask)
        loss = None if labels is None else causal_lm_loss(logits, labels, num_items_in_batch)
        return VLMOutput(loss=loss, logits=logits)

    def get_output_embeddings(self) -> nn.Linear:
        """The language head (Hugging Face's name for it): chunked losses take its weight."""
        return self.language_model.lm_head

    def hidden_states_for_loss(self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None,
                               position_ids: Tensor | None = None, images_per_row: Tensor | None = None,
                               document_lengths: list[list[int]] | None = None) -> Tensor:
        """The hidden states the head turns into the logits ``forward`` returns (text positions; every position of
        packed rows), so a loss can apply the head itself (``vlmfast.hooks.linear_cross_entropy``)."""
        return self._language_model(pixel_values, input_ids, position_ids, images_per_row, document_lengths,
                                    apply_head=False, attention_mask=attention_mask)

    def _language_model(self, pixel_values: Tensor, input_ids: Tensor, position_ids: Tensor | None,
                        images_per_row: Tensor | None, document_lengths: list[list[int]] | None,
                        apply_head: bool, attention_mask: Tensor | None = None) -> Tensor:
        if position_ids is not None:
            inputs_embeds = self._packed_inputs_embeds(pixel_values, input_ids, images_per_row, document_lengths)
            return self.language_model(inputs_embeds, position_ids=position_ids, document_lengths=document_lengths,
                                       apply_head=apply_head, attention_mask=attention_mask)
        image_embeds = self.get_image_features(pixel_values)
        text_embeds = self.language_model.embed_tokens(input_ids)
        inputs_embeds = torch.cat([image_embeds.to(text_embeds.dtype), text_embeds], dim=1)
        mask = None if attention_mask is None else torch.cat(
            [attention_mask.new_ones(attention_mask.shape[0], image_embeds.shape[1]), attention_mask], dim=1)
        out = self.language_model(inputs_embeds, logits_from=image_embeds.shape[1], apply_head=apply_head,
                                  attention_mask=mask)
        # The text positions: all it returns, or the last ones when its rows were packed (every position returned)
        return out[:, -input_ids.shape[1]:]

    def _packed_inputs_embeds(self, pixel_values: Tensor, input_ids: Tensor, images_per_row: Tensor | None,
                              document_lengths: list[list[int]] | None = None) -> Tensor:
        """Each sample's image features go to its placeholders, in row order (as LLaVA's masked_scatter)."""
        pixel_values = self._packed_images(pixel_values, images_per_row, document_lengths)
        image_embeds = self.get_image_features(pixel_values)
        is_image = input_ids == IMAGE_PLACEHOLDER_ID
        expected = image_embeds.shape[0] * image_embeds.shape[1]
        # Checked on the device (a host read of the count would wait for the GPU); masked_scatter needs it to hold.
        torch._assert_async(is_image.sum() == expected,
                            f"packed batch: image placeholders != {image_embeds.shape[0]} images of "
                            f"{image_embeds.shape[1]} tokens: pack with image_tokens={image_embeds.shape[1]}")
        text_embeds = self.language_model.embed_tokens(input_ids.clamp(min=0))
        return text_embeds.masked_scatter(is_image.unsqueeze(-1), image_embeds.to(text_embeds.dtype))

    @staticmethod
    def _packed_images(pixel_values: Tensor, images_per_row: Tensor | None,
                       document_lengths: list[list[int]] | None) -> Tensor:
        """The valid images of per-row packed ``pixel_values`` [R, K, ...], in row order."""
        if images_per_row is None:
            return pixel_values  # already [N, ...] in row order
        if document_lengths is not None:  # one image per sample: row r holds len(document_lengths[r]) of them
            slots = pixel_values.shape[1]
            index = [r * slots + j for r, row in enumerate(document_lengths) for j in range(len(row))]
            return pixel_values.flatten(0, 1).index_select(0, host_to_device(index, pixel_values.device))
        slots = torch.arange(pixel_values.shape[1], device=pixel_values.device)
        return pixel_values[slots < images_per_row.to(pixel_values.device)[:, None]]  # one host read (the count)


def causal_lm_loss(logits: Tensor, labels: Tensor, num_items_in_batch: int | Tensor | None = None) -> Tensor:
    """HF-convention loss: position t predicts ``labels[t + 1]``; ``-100`` labels are ignored.

    Usage: ``loss = causal_lm_loss(logits, labels, num_items_in_batch=512)``
    """
    # float32 so the loss is accurate even when the model runs in bf16.
    shift_logits = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1).to(logits.device)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if num_items_in_batch is None:
        # clamp: an all-ignored batch gives 0 rather than NaN.
        return total / (shift_labels != IGNORE_INDEX).sum().clamp(min=1)
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _init_weights(module: nn.Module) -> None:
    """GPT-style init: normal(0, 0.02) weights, zero biases, unit LayerNorm; also the pos embedding."""
    if isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
    elif isinstance(module, VisionTower):
        nn.init.normal_(module.pos_embed, std=0.02)


def build_tiny_vlm_task(
    seed: int = 0, num_samples: int = 4096, config: TinyVLMConfig | None = None
) -> tuple[TinyVLM, ShapesCaptionDataset, VLMCollator]:
    """Model, dataset and collator that fit together (vocab size, image size), seeded for reproducibility.

    Usage: ``model, dataset, collator = build_tiny_vlm_task(seed=0, num_samples=4096)``
    """
    config = config or TinyVLMConfig()
    dataset = ShapesCaptionDataset(num_samples=num_samples, seed=seed)
    if config.vocab_size < dataset.tokenizer.vocab_size:
        raise ValueError(f"vocab_size {config.vocab_size} < tokenizer's {dataset.tokenizer.vocab_size}")
    collator = VLMCollator(image_size=config.image_size, pad_id=dataset.tokenizer.pad_id)
    # Seed a local generator state for init, then restore the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyVLM(config)
    return model, dataset, collator
