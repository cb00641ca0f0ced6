"""The standalone hooks inside plain DDP, Accelerate and Lightning Fabric loops on 2 gloo ranks, against the
gradient of the global batch computed in one process.

One spawn runs every loop and every hook (the imports dominate the time): exact accumulation with the loop's own
no-sync, the OOM fallback when only one rank runs out of memory, packed rows, and a comm hook registered on the
loop's model (not the private DDP module inside it).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TinyCausalLM, spawn_two_ranks, token_batch

pytest.importorskip("accelerate")
pytest.importorskip("lightning_fabric")

GLOBAL_BATCH = 16  # 8 rows per rank
LOOPS = ("plain", "accelerate", "fabric")


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Norm of the difference over the whole gradient, relative to the gradient's norm."""
    diff = torch.cat([(got[name] - want[name]).flatten() for name in want]).norm()
    return float(diff / torch.cat([g.flatten() for g in want.values()]).norm())


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = model
    while hasattr(inner, "module") and inner.module is not inner:
        inner = inner.module
    return {name: p.grad.detach().clone() for name, p in inner.named_parameters()}


def _wrap(kind: str, model: torch.nn.Module):
    """The model as the loop sees it, and the loop object (None for a plain DDP loop)."""
    if kind == "plain":
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        return torch.nn.parallel.DistributedDataParallel(model), None
    if kind == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        return accelerator.prepare(model), accelerator
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    return fabric.setup_module(model), fabric


def _packed_task():
    from vlmfast.models import TinyVLM, TinyVLMConfig, VLMCollator, build_tiny_vlm_task

    config = TinyVLMConfig(vision_dim=32, text_dim=32, vision_heads=2, text_heads=2, vision_layers=1, text_layers=2)
    _, dataset, _ = build_tiny_vlm_task(seed=0, num_samples=GLOBAL_BATCH, config=config)
    torch.manual_seed(0)
    return TinyVLM(config), [dataset[i] for i in range(GLOBAL_BATCH)], VLMCollator(), config


def _all_loops_worker() -> dict[str, dict]:
    return {kind: _loop_worker(kind) for kind in LOOPS}  # plain first: it starts the process group the others join


def _loop_worker(kind: str) -> dict:
    from vlmfast.engines.comm_hooks import count_bytes
    from vlmfast.engines.foreign_loops import find_ddp
    from vlmfast.hooks import OOMFallback, accumulate_gradients
    from vlmfast.spec import OOMSpec
    from vlmfast.testing import simulated_oom

    rank = int(__import__("os").environ["RANK"])
    torch.manual_seed(0)
    model, loop = _wrap(kind, TinyCausalLM())
    local = {k: v[8 * rank: 8 * rank + 8] for k, v in token_batch(GLOBAL_BATCH).items()}
    out: dict = {}

    # 1. exact accumulation: 3 micro-batches, only the last one's backward all-reduces
    ddp = find_ddp(model)
    flags: list[bool] = []
    # Training forwards only: the label-convention probe runs the model once under no_grad first.
    hook = ddp.module.register_forward_pre_hook(
        lambda *_: flags.append(ddp.require_backward_grad_sync) if torch.is_grad_enabled() else None)
    out["loss"] = float(accumulate_gradients(model, local, 3, loop=loop))
    hook.remove()
    out["sync_flags"], out["grads"] = flags, _grads(model)
    model.zero_grad(set_to_none=True)

    # 2. the OOM fallback when only rank 0 runs out of memory at 4 samples
    fallback = OOMFallback(OOMSpec(enabled=True), micro_batch_size=4, model=model, loop=loop)
    with simulated_oom(2, ranks=[0]) as oom:
        loss = fallback.run(lambda size: accumulate_gradients(model, local, size, loop=loop),
                            cleanup=lambda: model.zero_grad(set_to_none=True))
    out.update(oom_loss=float(loss), oom_grads=_grads(model), oom_size=fallback.micro_batch_size, ooms=oom.count)
    model.zero_grad(set_to_none=True)

    # 3. a comm hook on the loop's own model object: fp16 all-reduce, once per optimizer batch
    counter = count_bytes(model, "fp16")
    out["fp16_loss"] = float(accumulate_gradients(model, local, 3, loop=loop))
    out.update(fp16_bytes=counter.take(), fp16_grads=_grads(model),
               numel=sum(p.numel() for p in model.parameters()))

    # 4. packed rows, 6 samples on rank 0 and 10 on rank 1: the padded global batch's gradient
    from vlmfast.data.packing import PackingCollator

    vlm, samples, collate, config = _packed_task()
    vlm, loop = _wrap(kind, vlm)
    pack = PackingCollator(max_tokens=72, collate_fn=collate, image_tokens=config.num_image_tokens)
    packed = pack(samples[:6] if rank == 0 else samples[6:])  # uneven: rank 0 pads with zero-weight micro-batches
    out["rows"] = int(packed["input_ids"].shape[0])
    out["packed_loss"] = float(accumulate_gradients(vlm, packed, 1, loop=loop))
    out["packed_grads"] = _grads(vlm)
    return out


def _reference() -> tuple[float, dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
    """Loss and gradient of the whole global batch in one process: the token LM, then the packed VLM (padded)."""
    torch.manual_seed(0)
    model = TinyCausalLM()
    loss = model(**token_batch(GLOBAL_BATCH))["loss"]
    loss.backward()
    vlm, samples, collate, _ = _packed_task()
    vlm_loss = vlm(**collate(samples)).loss
    vlm_loss.backward()
    return (loss.item(), {n: p.grad for n, p in model.named_parameters()},
            vlm_loss.item(), {n: p.grad for n, p in vlm.named_parameters()})


@pytest.fixture(scope="module")
def loops(tmp_path_factory) -> list[dict[str, dict]]:
    return spawn_two_ranks(_all_loops_worker, tmp_path_factory.mktemp("loops"), "loops")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", LOOPS)
def test_hooks_give_the_global_batch_gradient_in_each_loop(loops, kind: str) -> None:
    loss, grads, vlm_loss, vlm_grads = _reference()
    ranks = [rank[kind] for rank in loops]
    for rank in ranks:
        # accumulation: the global loss on every rank (not this rank's share), the global gradient, one sync
        assert rank["loss"] == pytest.approx(loss, rel=1e-5)
        assert _relative_error(rank["grads"], grads) < 1e-5
        assert rank["sync_flags"] == [False, False, True]
        # OOM on rank 0 only: both ranks shrink to 2 and the gradient is still the global one
        assert rank["oom_size"] == 2 and rank["oom_loss"] == pytest.approx(loss, rel=1e-5)
        assert _relative_error(rank["oom_grads"], grads) < 1e-5
        # fp16 comm hook found inside the loop's wrapper: 2 bytes per gradient element, once
        assert rank["fp16_bytes"] == 2 * rank["numel"]
        assert rank["fp16_loss"] == pytest.approx(loss, rel=1e-5)
        assert _relative_error(rank["fp16_grads"], grads) < 2e-3
        # packing: uneven rows per rank, the padded global batch's loss and gradient
        assert rank["packed_loss"] == pytest.approx(vlm_loss, rel=1e-5)
        assert _relative_error(rank["packed_grads"], vlm_grads) < 1e-5
    assert [r["ooms"] for r in ranks] == [1, 0]
    assert ranks[0]["rows"] < ranks[1]["rows"]


@pytest.fixture
def accelerate_state(monkeypatch: pytest.MonkeyPatch):
    """Accelerate keeps its state in a process-wide singleton: reset it after the test. A launcher's variables left
    in this process (DeepSpeed needs LOCAL_RANK for as long as its engine lives; vlmfast sets it for a one-process
    engine) would make Accelerator(cpu=True) start a multi-process group: the test runs without them."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def test_accumulate_refuses_an_accelerator_that_accumulates_too(accelerate_state) -> None:
    from accelerate import Accelerator

    from vlmfast.hooks import accumulate_gradients

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = accelerator.prepare(TinyCausalLM())
    batch = token_batch(8)
    for how in ({"loop": accelerator}, {"backward": accelerator.backward}):  # the loop is found from its backward
        with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4\).*1/4 of the batch gradient"):
            accumulate_gradients(model, batch, 4, **how)
    assert all(p.grad is None for p in model.parameters())  # refused before any work
