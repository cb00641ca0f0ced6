"""CUDA paths made right by reading the libraries' source (issue 18), checked on CPU through seams.

Each test fails without its fix: what CUDA would do is reproduced with what the CPU build has (fake CUDA tensors,
the allocator-settings call, custom ops shaped like flash-attn's, the optimizer-step hook, fake streams).
"""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import types
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCausalLM, TokenDataset
from torch import Tensor
from torch.overrides import TorchFunctionMode

import vlmfast.attention
from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.testing import count_host_syncs, simulated_oom

# ---- find_micro_batch_size: the snapshot is complete when taken ---------------------------------------------------


class _RecordTo(TorchFunctionMode):
    """Records every Tensor.to call's non_blocking flag and target."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.to:
            parse = {k: v for k, v in kwargs.items() if k != "copy"}
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **parse)
            self.calls.append((device, bool(non_blocking)))
        return func(*args, **kwargs)


def test_batch_size_snapshot_copies_are_blocking_independent_and_restored_exactly():
    from vlmfast.memory.batch_size import restore_from_host, snapshot_to_host

    torch.manual_seed(0)
    model = TinyCausalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(**{k: v[:4] for k, v in TokenDataset(8).batch.items()})["loss"].backward()
    optimizer.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_opt = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    with _RecordTo() as record:
        saved_model, saved_opt = snapshot_to_host(model.state_dict()), snapshot_to_host(optimizer.state_dict())
    # A device-to-host copy with non_blocking=True is only complete after a sync: the old snapshot made those.
    assert record.calls and not any(non_blocking for _, non_blocking in record.calls)
    with torch.no_grad():  # the probe trains: every tensor changes in place
        for p in model.parameters():
            p.add_(1.0)
    optimizer.step()
    assert not torch.equal(saved_model["embed.weight"], model.state_dict()["embed.weight"])  # not an alias
    restore_from_host(model, optimizer, saved_model, saved_opt)
    for name, value in before.items():
        assert torch.equal(model.state_dict()[name], value), name
    for key, value in before_opt.items():
        assert torch.equal(optimizer.state_dict()["state"][0][key], value), key
    assert optimizer.param_groups[0]["params"][0] is next(model.parameters())  # still the model's parameters


# ---- oom.expandable_segments after CUDA has started ---------------------------------------------------------------


def test_expandable_segments_is_applied_after_cuda_started(monkeypatch):
    from vlmfast.memory import allocator
    from vlmfast.spec import OOMSpec
    from vlmfast.strategies.oom import OOMFallback

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # device: auto has started CUDA already
    monkeypatch.setattr(allocator, "allocator_setter", lambda: calls.append)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    OOMFallback(OOMSpec(enabled=True, expandable_segments=True), micro_batch_size=8)
    assert calls == ["expandable_segments:True"]  # torch._C._accelerator_setAllocatorSettings at run time
    assert allocator.allocator_setter.__module__  # the seam is the real lookup otherwise:
    monkeypatch.undo()
    assert allocator.allocator_setter() is torch._C._accelerator_setAllocatorSettings


# ---- the OOM snapshot is the allocator's state at the failure -----------------------------------------------------


def test_oom_snapshot_is_taken_by_the_allocator_observer_at_the_failure(tmp_path):
    from vlmfast.memory.allocator import OOMSnapshots
    from vlmfast.memory.monitor import MemoryMonitor
    from vlmfast.spec import MemorySpec

    state = {"live": "the tensors of the failed step"}
    observers = []
    monitor = MemoryMonitor(MemorySpec(record_history=True), device="cuda", log_dir=tmp_path)
    monitor.oom_snapshots = OOMSnapshots(snapshot_fn=lambda: dict(state))
    assert monitor.oom_snapshots.attach(attach_fn=observers.append)
    observers[0](0, 2 * 2**30, 80 * 2**30, 2**20)  # the allocator, as the allocation fails (before the raise)
    state["live"] = "freed by empty_cache in the OOM handler"  # what a snapshot taken afterwards would show
    path = monitor.dump_snapshot()
    assert pickle.loads(path.read_bytes()) == {"live": "the tensors of the failed step"}
    assert monitor.oom_snapshots.failures[0]["requested"] == 2 * 2**30
    monitor.oom_snapshots.detach()


# ---- SDPA kernel restrictions CUDA would refuse ------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "mask", "kernels", "fits"), [
    (torch.float32, False, ("flash",), False),  # flash: fp16/bf16 only
    (torch.bfloat16, True, ("flash",), False),  # flash: no dense mask
    (torch.float32, False, ("cudnn",), False),
    (torch.bfloat16, True, ("flash", "efficient"), True),
    (torch.float32, False, ("efficient",), True),
    (torch.bfloat16, False, ("flash",), True),
])
def test_sdpa_kernels_cuda_would_refuse_are_refused_naming_the_field(dtype, mask, kernels, fits):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vlmfast.attention import AttentionBackendError
    from vlmfast.attention.backends import AttentionInputs
    from vlmfast.attention.dispatch import resolve_backend

    with FakeTensorMode(allow_non_fake_inputs=True):  # CUDA tensors without a GPU: only their metadata is read
        q = torch.empty(2, 4, 16, 32, device="cuda", dtype=dtype)
        inputs = AttentionInputs(causal=not mask, sdpa_kernels=kernels,
                                 attn_mask=torch.ones(16, 16, dtype=torch.bool, device="cuda") if mask else None)
        if fits:
            assert resolve_backend("sdpa", q, inputs) == ("sdpa", "requested")
        else:
            with pytest.raises(AttentionBackendError, match=r"attention\.sdpa_kernels"):
                resolve_backend("sdpa", q, inputs)


# ---- attention: auto decided once, documents built once per forward, flex compiled for all shapes ---------------


def test_auto_probes_the_backends_once_per_kind_of_input(monkeypatch):
    import importlib.util

    import vlmfast.attention
    from vlmfast.attention import backends, dispatch

    lookups = []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: lookups.append(name) or real_find_spec(name, *a))
    backends.flash_attn_installed.cache_clear()
    monkeypatch.setattr(dispatch, "_auto_decisions", {})
    decide = dispatch._decide_auto
    decisions = []
    monkeypatch.setattr(dispatch, "_decide_auto", lambda q, i: decisions.append(1) or decide(q, i))
    q = torch.randn(1, 2, 8, 16)
    for _ in range(5):
        vlmfast.attention(q, q, q, causal=True, backend="auto")
    assert len(decisions) == 1 and lookups.count("flash_attn") <= 1
    backends.flash_attn_installed.cache_clear()


def test_documents_from_position_ids_are_built_once_per_forward(monkeypatch):
    import vlmfast.attention
    from vlmfast.attention.documents import PackedDocuments

    built = []
    original = PackedDocuments.from_position_ids.__func__
    monkeypatch.setattr(PackedDocuments, "from_position_ids",
                        classmethod(lambda cls, p: built.append(1) or original(cls, p)))
    q = torch.randn(2, 2, 8, 16)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    outs = [vlmfast.attention(q, q, q, causal=True, position_ids=positions) for _layer in range(4)]
    assert len(built) == 1  # every layer passed the same tensor
    positions[0, 3] = 3  # changed in place: a new set of documents
    vlmfast.attention(q, q, q, causal=True, position_ids=positions)
    assert len(built) == 2
    torch.testing.assert_close(outs[0], outs[3])


def test_flex_and_its_block_masks_are_compiled_for_changing_shapes(monkeypatch):
    from vlmfast.attention import backends, documents

    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append((fn.__name__, kw)) or fn)
    backends._compiled_flex.cache_clear()
    documents._compiled_create_block_mask.cache_clear()
    try:
        backends._compiled_flex()
        documents._compiled_create_block_mask()
    finally:
        backends._compiled_flex.cache_clear()
        documents._compiled_create_block_mask.cache_clear()
    # dynamic=False compiled one graph per sequence length until dynamo's recompile limit sent flex to eager
    assert compiled == [("flex_attention", {"dynamic": None}), ("create_block_mask", {"dynamic": None})]


def test_packed_documents_from_host_lengths_match_position_ids():
    from vlmfast.attention.documents import PackedDocuments

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])  # row 2: 2 pad tokens
    from_positions = PackedDocuments.from_position_ids(positions)
    from_lengths = PackedDocuments.from_lengths([[3, 2, 3], [6]], seq_len=8, device="cpu")
    same = from_positions.ids[:, :, None] == from_positions.ids[:, None, :]
    torch.testing.assert_close(from_lengths.ids[:, :, None] == from_lengths.ids[:, None, :], same)
    assert from_lengths.spans() == from_positions.spans() == [(0, 3), (3, 5), (5, 8), (8, 14), (14, 16)]
    cu, longest = from_lengths.cu_seqlens()
    assert cu.tolist() == [0, 3, 5, 8, 14, 16] and longest == 6
    with count_host_syncs(device="cpu") as syncs:  # the tiny VLM's packed path: nothing read back
        docs = PackedDocuments.from_lengths([[3, 2, 3], [6]], seq_len=8, device="cpu")
        docs.cu_seqlens(), docs.spans(), docs.dense_mask(causal=True)
    assert syncs.count == 0, syncs.report()
    with count_host_syncs(device="cpu") as syncs:  # from device position ids: one read of the boundaries
        docs = PackedDocuments.from_position_ids(positions.to("cpu"))
        docs.cu_seqlens(), docs.spans()
    assert syncs.count == 1, syncs.report()


# ---- FLOPs of flash-attn's kernels ---------------------------------------------------------------------------------


def _define_flash_like_ops(namespace: str) -> types.SimpleNamespace:
    """Custom ops with flash-attn's names and argument order ([B, T, H, D] layout), computed by SDPA on CPU."""

    @torch.library.custom_op(f"{namespace}::_flash_attn_forward", mutates_args=())
    def forward(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool) -> Tensor:
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal) \
            .transpose(1, 2).contiguous()

    @torch.library.custom_op(f"{namespace}::_flash_attn_varlen_forward", mutates_args=())
    def varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool) -> Tensor:
        bounds = cu_seqlens_q.tolist()
        pieces = [F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1)[None] for x in (q, k, v)),
                                                 is_causal=causal)[0].transpose(0, 1)
                  for a, b in itertools.pairwise(bounds)]
        return torch.cat(pieces)

    return getattr(torch.ops, namespace)


def test_flash_attn_kernels_are_counted_like_torchs_own_attention():
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    from vlmfast.profiling.flash_flops import flash_backward_flop, register_flash_attn_flops

    ops = _define_flash_like_ops("vlmfast_test_flashattn")
    assert register_flash_attn_flops(ops) == ["_flash_attn_forward", "_flash_attn_varlen_forward"]
    q = torch.randn(2, 16, 4, 8)  # [B, T, H, D]
    with FlopCounterMode(display=False) as counter:
        ops._flash_attn_forward(q, q, q, 0.0, 0.35, True)
    assert counter.get_total_flops() == sdpa_flop_count((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8)) > 0
    flat = torch.randn(10, 4, 8)  # two packed documents of 3 and 7 tokens
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    with FlopCounterMode(display=False) as counter:
        ops._flash_attn_varlen_forward(flat, flat, flat, cu, cu, 7, 7, 0.0, 0.35, True)
    per_doc = [sdpa_flop_count((1, 4, n, 8), (1, 4, n, 8), (1, 4, n, 8)) for n in (3, 7)]
    assert counter.get_total_flops() == sum(per_doc)  # sum of l_i^2, not T^2
    assert flash_backward_flop(q, q, q, q) == sdpa_backward_flop_count(*[(2, 4, 16, 8)] * 4)


# ---- TF32 through one API: Lightning's check after an HF Trainer run ----------------------------------------------


_TF32_SCRIPT = """
import torch
from transformers.utils.import_utils import enable_tf32
from vlmfast.bench.harness import _reset_process_state
from vlmfast.bench.runners import _tf32
enable_tf32.__wrapped__(True)  # what TrainingArguments does on an Ampere+ GPU with torch >= 2.9 (hf-best row)
_reset_process_state(1)        # the bench, before the next row
with _tf32(True):              # a row with TF32 on, then off again
    torch.get_float32_matmul_precision()
torch.get_float32_matmul_precision()  # lightning_fabric.accelerators.cuda._check_cuda_matmul_precision
from vlmfast.strategies.precision import enable_tf32 as vlmfast_tf32
vlmfast_tf32(True)
print(torch.get_float32_matmul_precision())
"""


def test_tf32_settings_never_mix_torchs_two_apis():
    pytest.importorskip("transformers")
    run = subprocess.run([sys.executable, "-c", _TF32_SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-2000:]  # "mix of the legacy and new APIs" raised before
    assert run.stdout.strip().endswith("high")


# ---- device prefetch waits for its own batch only -----------------------------------------------------------------


class _Log(list):
    def stream(self, name):
        log = self

        class Stream:
            def wait_event(self, event):
                log.append(("wait", name, event.batch))

            def wait_stream(self, other):
                log.append(("wait_stream", name))

        return Stream()


def test_prefetcher_waits_for_the_event_of_the_batch_it_hands_out(monkeypatch):
    from vlmfast.data.prefetch import DevicePrefetcher

    log = _Log()
    loaded = iter([{"x": torch.full((2,), float(i))} for i in range(4)])
    prefetcher = DevicePrefetcher(loaded, "cpu", background=False, depth=2)
    prefetcher.stream = log.stream("side")  # what a CUDA device gets
    compute = log.stream("compute")
    batches_copied = []

    class Event:
        def record(self, stream):
            self.batch = len(batches_copied)
            batches_copied.append(self.batch)
            log.append(("record", self.batch))

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextmanager(lambda: iter([None]))())
    monkeypatch.setattr(DevicePrefetcher, "_used_on", staticmethod(lambda batch, stream: None))
    first = next(prefetcher)
    second = next(prefetcher)
    assert [first["x"][0].item(), second["x"][0].item()] == [0.0, 1.0]
    waits = [entry for entry in log if entry[0].startswith("wait")]
    # batch k is handed out after waiting for event k, although batches k+1.. were already queued on the side stream
    assert waits == [("wait", "compute", 0), ("wait", "compute", 1)]
    assert log.index(("record", 2)) < log.index(("wait", "compute", 1))


# ---- batched image preprocessing: no blocking host-to-device copies ----------------------------------------------


def test_image_preprocessing_makes_no_blocking_copies():
    from vlmfast.data.images import preprocess_images

    images = [torch.randint(0, 255, (3, 20, 24), dtype=torch.uint8), torch.randint(0, 255, (3, 32, 32),
                                                                                   dtype=torch.uint8)] * 2
    with count_host_syncs(device="cpu") as syncs:
        out = preprocess_images(images, 16, device="cpu")
    assert syncs.count == 0, syncs.report()  # torch.tensor(mean / indices, device=...) made 4 before
    expected = torch.stack([F.interpolate(i[None].float() / 255, size=(16, 16), mode="bilinear", antialias=True,
                                          align_corners=False)[0] for i in images]).sub(0.5).div(0.5)
    torch.testing.assert_close(out, expected)


# ---- the headroom benchmark caps what it measured -----------------------------------------------------------------


def test_headroom_budget_is_the_peak_reserved_memory_the_cap_limits(monkeypatch):
    from vlmfast.bench import headroom

    monkeypatch.setattr(headroom, "_cuda_probe", lambda *args: (lambda n: None))
    monkeypatch.setattr(headroom, "free_memory", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 600 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 1000 * 2**20)
    budget = headroom._budget(types.SimpleNamespace(batch_size=8), None, torch.device("cuda"))
    assert budget == int(1000 * 2**20 * 1.02)  # set_per_process_memory_fraction caps reserved memory


# ---- OOM outside forward/backward -----------------------------------------------------------------------------------


def test_an_oom_in_the_optimizer_step_ends_with_the_summary_and_the_fixes_that_address_it():
    from vlmfast.memory.advice import OutOfMemoryOutsideStepError, explain_oom

    spec = TrainSpec(batch_size=8, micro_batch_size=8)
    model = TinyCausalLM()
    optimizer = torch.optim.AdamW(model.parameters())
    model(**TokenDataset(8).batch)["loss"].backward()
    n = sum(p.numel() for p in model.parameters())
    explained = explain_oom("optimizer step", spec, torch.device("cpu"), trainable_params=n, step=1)
    with simulated_oom(phase="optimizer") as oom, pytest.raises(OutOfMemoryOutsideStepError) as error, explained:
        optimizer.step()
    message = str(error.value)
    assert oom.count == 1 and isinstance(error.value, torch.OutOfMemoryError)
    assert message.startswith("out of memory in the optimizer step of step 1")
    for fix in ("8-bit", "adafactor", "zero_stage", "offload_optimizer: cpu", "estimate-memory", "memory: "):
        assert fix in message, fix
    assert "activation_checkpointing" not in message  # it does not shrink optimizer states


_LOOP_MUST_EXPLAIN = ("lead's files (issue 15): the loop must wrap the optimizer step (trainer.py _apply_update: "
                      "precision.optimizer_step; _deepspeed_update: deepspeed.step) in vlmfast.memory.advice."
                      "explain_oom('optimizer step', spec, device, trainable_params, step), and evaluate() in "
                      "explain_oom('evaluation', ...)")


def test_fit_turns_an_optimizer_step_oom_into_the_explained_error():
    from vlmfast.memory.advice import OutOfMemoryOutsideStepError

    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), TrainSpec(
        max_steps=2, batch_size=8, micro_batch_size=4, oom={"enabled": True}, log={"progress": "off"}))
    with simulated_oom(phase="optimizer"), pytest.raises(OutOfMemoryOutsideStepError, match="8-bit"):
        trainer.fit()


# ---- torch's varlen_attn: each release's signature (torch/nn/attention/varlen.py) ---------------------------------


def _reference_varlen(query, key, value, cu_seq_q, max_q, scale, causal):
    """What every release's varlen_attn computes, one document at a time; same head counts only, as torch <= 2.11."""
    assert key.shape[1] == query.shape[1], "this varlen_attn has no enable_gqa: K/V must have the query's heads"
    bounds = cu_seq_q.tolist()
    pieces = [F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (query, key, value)),
                                             is_causal=causal, scale=scale).transpose(0, 1)
              for a, b in itertools.pairwise(bounds)]
    return torch.cat(pieces)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _reference_varlen(query, key, value, cu_seq_q, max_q, None, is_causal)


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    assert tuple(window_size) in ((-1, -1), (-1, 0))
    return _reference_varlen(query, key, value, cu_seq_q, max_q, scale, tuple(window_size) == (-1, 0))


@pytest.mark.parametrize("varlen_attn", [varlen_attn_2_10, varlen_attn_2_11], ids=["torch-2.10", "torch-2.11"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_packed_sdpa_runs_on_every_varlen_attn_signature_and_equals_eager(monkeypatch, varlen_attn, kv_heads, scale):
    from vlmfast.attention import backends

    # Past the CUDA gate: the packed SDPA path takes torch's varlen kernel, here a stub with an older signature.
    monkeypatch.setattr(backends, "_varlen_attn", lambda: varlen_attn)
    monkeypatch.setattr(backends, "_uses_varlen", lambda q, inputs: inputs.documents is not None)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 12, 8, generator=g, dtype=torch.float64) for _ in range(2))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    common = {"causal": True, "position_ids": positions, "scale": scale, "enable_gqa": kv_heads != 4}
    packed = vlmfast.attention(q, k, v, backend="sdpa", **common)
    eager = vlmfast.attention(q, k, v, backend="eager", **common)
    # eager takes its softmax in float32 whatever the inputs' dtype: a float64 comparison holds to ~1e-7
    assert (packed - eager).norm() <= 1e-6 * eager.norm()
