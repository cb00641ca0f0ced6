"""What the docs claim of CUDA paths, measured on a GPU (issue 25); every test skips cleanly without CUDA.

- `attention: auto` runs a fused kernel (never SDPA's math fallback) for a real Hugging Face VLM in bf16, on padded
  and on packed rows; the kernels seen are recorded in the JUnit XML (`record_property`).
- The device prefetch never hands out a batch whose copy is unfinished, even with its copy stream held back and the
  caching allocator reusing freed memory, and its copies overlap the compute stream.
- The chunked linear cross-entropy's peak allocated memory is below the standard head's at vocabulary 151,936.

(A survived real OOM returning allocated memory to its baseline: tests/test_oom.py.)
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import LlavaDataset, tiny_llava

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.attention import trace_attention_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FUSED = {"sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "torch-varlen", "flash_attn", "flex"}


def fit_and_trace(device: str, packed: bool) -> dict[str, int]:
    """Attention kernels run while OptimizedTrainer trains tiny HF LLaVA for two bf16 steps with `attention: auto`."""
    model = tiny_llava()
    model.config.use_cache = model.config.text_config.use_cache = False  # HF detects packed rows only without a cache
    spec = TrainSpec(max_steps=2, batch_size=8, device=device, precision="bf16", seed=0, attention={"backend": "auto"},
                     packing={"enabled": packed, "max_tokens": 40, "image_layout": "flat"}, log={"progress": "off"})
    with trace_attention_kernels() as trace:
        OptimizedTrainer(model, LlavaDataset(16), spec).fit()
    return dict(trace.kernels)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_auto_attention_runs_fused_kernels_for_a_hf_vlm_in_bf16(packed, record_property):
    kernels = fit_and_trace("cuda", packed)
    record_property("kernels", kernels)
    print(f"{'packed' if packed else 'padded'}: {kernels}")
    assert kernels, "no attention kernel ran"
    assert set(kernels) <= FUSED, f"a kernel outside the fused set ran: {kernels}"


def _host_batches(n: int, numel: int) -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.full((numel,), float(i)).pin_memory()} for i in range(n)]


def _gpu_sleep_cycles(ms: float) -> int:
    """torch.cuda._sleep cycles that take about `ms` milliseconds on this GPU (measured)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


def test_prefetch_never_hands_out_an_unfinished_copy():
    from vlmfast.data.prefetch import DevicePrefetcher

    numel, n = 4 * 2**20, 8
    hosts = _host_batches(n, numel)
    delay = _gpu_sleep_cycles(20.0)
    holder: dict[str, DevicePrefetcher] = {}

    def delayed():  # runs in the prefetch thread, just before each copy is queued on the side stream
        for batch in hosts:
            with torch.cuda.stream(holder["prefetcher"].stream):
                torch.cuda._sleep(delay)  # the copy queued next waits ~20 ms behind this on its stream
            yield batch

    holder["prefetcher"] = batches = DevicePrefetcher(delayed(), torch.device("cuda"))
    sums = []
    for _ in range(n):
        batch = next(batches)
        sums.append(batch["x"].sum())  # queued at once on the compute stream: it must wait for the copy
        del batch  # freed at once: the side stream's next copies may reuse it only after this read (record_stream)
    torch.cuda.synchronize()
    assert [s.item() for s in sums] == [float(i * numel) for i in range(n)]


def test_prefetch_copies_overlap_compute():
    from vlmfast.data.prefetch import DevicePrefetcher

    numel, n = 64 * 2**20, 8  # 256 MiB per batch
    hosts = _host_batches(n, numel)
    copy_start, copy_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copy_start.record()
    hosts[0]["x"].to("cuda", non_blocking=True)
    copy_end.record()
    copy_end.synchronize()
    copy_ms = copy_start.elapsed_time(copy_end)
    compute = _gpu_sleep_cycles(2 * copy_ms)

    def run(prefetch: bool) -> float:
        batches = DevicePrefetcher(iter(hosts), torch.device("cuda"), prefetch=prefetch)
        next(batches)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for batch in batches:
            batch["x"].add_(1)
            torch.cuda._sleep(compute)  # the step's compute
        torch.cuda.synchronize()
        return time.perf_counter() - start

    serial, overlapped = run(prefetch=False), run(prefetch=True)
    print(f"copy {copy_ms:.1f} ms per batch; {n - 1} steps: serial {serial * 1e3:.0f} ms, "
          f"prefetched {overlapped * 1e3:.0f} ms")
    # 2 units of compute + 1 of copy per step serially; prefetched, the copy hides behind the compute
    assert overlapped < 0.85 * serial


def test_chunked_cross_entropy_peaks_below_the_standard_head():
    transformers = pytest.importorskip("transformers")
    from vlmfast.hooks import apply_linear_cross_entropy

    config = transformers.Qwen2Config(vocab_size=151_936, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    ids = torch.randint(0, 151_936, (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()
    peaks, losses = {}, {}
    for variant in ("standard", "chunked"):
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config).cuda()
        if variant == "chunked":
            apply_linear_cross_entropy(model)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        peaks[variant] = torch.cuda.max_memory_allocated() - base
        losses[variant] = loss.item()
        del model, loss
    print({k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()}, losses)
    assert losses["chunked"] == pytest.approx(losses["standard"], rel=2e-2)  # bf16 logits against chunked fp32
    assert peaks["chunked"] < peaks["standard"] / 2
