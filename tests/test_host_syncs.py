"""Host-device syncs per optimizer step, counted on CPU by vlmfast.testing.count_host_syncs.

The budgets (issue 18): one host read per optimizer step in the default path (the logged loss and grad norm, read
together), at most two under DDP, FSDP2, DeepSpeed, packing, device prefetch and the OOM fallback. Every budget test
goes through the public trainer API only (``OptimizedTrainer(...).fit()`` with the counter as a callback), so it
survives a rewrite of the loop. Steps after the first are checked: step 1 also holds one-off work (DDP's parameter
check, resume agreement, FSDP's sharding). A budget test that fails names each read and where it happens.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from conftest import LlavaDataset, TinyCausalLM, TokenDataset, spawn_two_ranks, tiny_llava

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.testing import HostSyncs, count_host_syncs, simulated_oom

# ---- the counter itself -----------------------------------------------------------------------------------------


def test_reads_of_device_values_are_counted_and_host_work_is_not():
    model = torch.nn.Linear(4, 2)
    host = torch.arange(6.0)
    with count_host_syncs(model) as syncs:
        _ = host.sum().item() + len(host.tolist()) + int(host.nonzero().shape[0])  # host data: free
        out = model(torch.ones(3, 4))  # computed from the parameters: device values
        out.sum().item()
        out.tolist()
        bool(out.max() > 0)
        out[out > 0]  # boolean-mask indexing: the result's size needs the mask's count
        out.nonzero()
        torch.tensor([1.0, 2.0], device="cpu")  # python values into a device tensor: a blocking copy
    kinds = [e.kind for e in syncs.events]
    assert kinds == ["item/float/int/bool", "tolist", "item/float/int/bool", "boolean-mask indexing (nonzero)",
                     "nonzero", "torch.tensor(host values, device=...)"], syncs.report()
    assert all(e.where.startswith("test_host_syncs.py:") for e in syncs.events)


def test_a_moved_batch_is_a_device_value_and_its_host_original_is_not():
    batch = {"ids": torch.arange(8)}
    with count_host_syncs(device="cpu") as syncs:
        moved = {k: v.to("cpu", non_blocking=True) for k, v in batch.items()}
        int(batch["ids"].sum())  # the host copy: free
        assert syncs.count == 0
        int(moved["ids"].sum())  # the device copy: a sync
        moved["ids"].to("cpu").sum().item()  # already "on the device": .to is a no-op there, the read is not
    assert syncs.count == 2 and moved["ids"] is not batch["ids"]
    torch.testing.assert_close(moved["ids"], batch["ids"])


def test_threads_started_inside_are_followed():
    model = torch.nn.Linear(2, 2)
    with count_host_syncs(model) as syncs:
        thread = threading.Thread(target=lambda: model.weight.sum().item(), name="loader")
        thread.start()
        thread.join()
    assert [(e.kind, e.thread) for e in syncs.events] == [("item/float/int/bool", "loader")]


def test_steps_are_marked_by_the_trainer_callback():
    syncs = HostSyncs(torch.device("cpu"))
    syncs._record("tolist")
    syncs.on_step_end(None, {})
    syncs.on_step_end(None, {})
    syncs._record("tolist")
    syncs._record("nonzero")
    syncs.mark_step()
    assert syncs.per_step == [1, 0, 2]
    assert "2 host read(s)" in syncs.report(steps=[3])


# ---- the budgets, through the public trainer API ------------------------------------------------------------------


def _spec(**overrides) -> dict:
    return {"max_steps": 3, "batch_size": 8, "micro_batch_size": 4, "seed": 0, "log": {"progress": "off"},
            **overrides}


def count_training_syncs(spec: dict, task: str = "lm", oom_above: int | None = None) -> HostSyncs:
    """Train 3 steps of `spec` under the counter; the model is moved to the device inside, as a user's would be."""
    torch.manual_seed(0)
    if task == "vlm":
        from vlmfast.models import TinyVLMConfig, build_tiny_vlm_task

        model, data, collate = build_tiny_vlm_task(seed=0, num_samples=32,
                                                   config=TinyVLMConfig(vision_layers=1, text_layers=1))
    elif task == "llava-loader":  # the user's DataLoader: collated batches, images found from their tokens
        model, data, collate = tiny_llava(), torch.utils.data.DataLoader(LlavaDataset(32), batch_size=8), None
    else:
        model, data, collate = TinyCausalLM(), TokenDataset(32), None
    oom = simulated_oom(oom_above) if oom_above else contextlib.nullcontext()
    with oom, count_host_syncs() as syncs:
        OptimizedTrainer(model, data, TrainSpec(**spec), collate_fn=collate, callbacks=[syncs]).fit()
    return syncs


def assert_within_budget(syncs: HostSyncs, budget: int, ignore: tuple[str, ...] = ()) -> None:
    """Steps 2.. read at most `budget` device values each (reads inside `ignore`d libraries are not vlmfast's)."""
    steady = [e for e in syncs.events if e.step >= 2 and not e.where.startswith(ignore)]
    per_step = [sum(e.step == step for e in steady) for step in range(2, syncs.step + 1)]
    assert per_step and max(per_step) <= budget, (
        f"more than {budget} host read(s) per optimizer step ({per_step} in steps 2..{syncs.step}); each one makes "
        f"the CPU wait for the GPU:\n{syncs.report(steps=range(2, syncs.step + 1))}")


def test_default_path_reads_the_device_once_per_step():
    syncs = count_training_syncs(_spec(grad_clip=1.0))  # loss and grad norm: one read together
    assert_within_budget(syncs, 1)


def test_a_sync_added_to_the_step_fails_the_budget():
    class Chatty(TinyCausalLM):
        def forward(self, input_ids, labels=None, attention_mask=None):
            out = super().forward(input_ids, labels, attention_mask)
            if out["loss"] > 100:  # a harmless-looking check: bool() of a device value
                raise RuntimeError("diverged")
            return out

    torch.manual_seed(0)
    with count_host_syncs() as syncs:
        OptimizedTrainer(Chatty(), TokenDataset(32), TrainSpec(**_spec()), callbacks=[syncs]).fit()
    with pytest.raises(AssertionError, match=r"(?s)more than 1 host read.*test_host_syncs.py:\d+ in forward"):
        assert_within_budget(syncs, 1)


def test_oom_fallback_stays_within_two_reads_per_step():
    syncs = count_training_syncs(_spec(batch_size=8, micro_batch_size=8, oom={"enabled": True}), oom_above=4)
    assert_within_budget(syncs, 2)


# With device prefetch the batch reaches the step on the device; the loss and input tokens are counted on its host
# copy (a SampleBatch keeps its host micro-batches, also those collated again after an OOM resize; a collated batch's
# host original is kept by the prefetcher), so the step still reads only the loss and the norm (3 more reads before).
# A token budget plans its micro-batches on the host copy and gathers the rows from the device one (10 reads before);
# a user DataLoader's collated VLM batch finds each sample's images from its tokens on the host copy (7 before).
@pytest.mark.parametrize("spec, task, oom_above", [
    (_spec(data={"device_prefetch": True}), "lm", None),  # SampleBatch collated whole: micro-batches are slices
    (_spec(micro_batch_size=8, oom={"enabled": True}, data={"device_prefetch": True}), "vlm", 4),  # re-collated
    (_spec(packing={"enabled": True, "max_tokens": 64}, data={"device_prefetch": True}), "vlm", None),  # collated
    (_spec(micro_batch_tokens=160, data={"device_prefetch": True}), "vlm", None),  # planned on host, gathered
    (_spec(data={"device_prefetch": True}), "llava-loader", None),  # image tokens counted on host, sliced on device
], ids=["whole", "recollated-after-oom", "packed", "token-budget", "collated-vlm"])
def test_device_prefetch_stays_within_two_reads_per_step(spec, task, oom_above):
    syncs = count_training_syncs(spec, task, oom_above)
    # transformers' LLaVA reads inside its forward (masking_utils' _ignore_causal_mask_sdpa, get_placeholder_mask,
    # cache_utils' torch.tensor(..., device=)): upstream's, reported, not budgeted. vlmfast reads the loss and norm.
    assert_within_budget(syncs, 2, ignore=("transformers/",))
    assert not any("count" in e.where for e in syncs.events if e.step >= 2), syncs.report()


def test_packing_stays_within_two_reads_per_step():
    syncs = count_training_syncs(_spec(packing={"enabled": True, "max_tokens": 64}), task="vlm")
    assert_within_budget(syncs, 2)


def _count_on_two_ranks(spec: dict) -> HostSyncs:
    torch.manual_seed(0)
    with count_host_syncs() as syncs:
        OptimizedTrainer(TinyCausalLM(), TokenDataset(32), TrainSpec(**spec), callbacks=[syncs]).fit()
    syncs.active = False
    return syncs



@pytest.mark.timeout(180)
def test_ddp_with_the_oom_fallback_stays_within_two_reads_per_step(tmp_path):
    # Host counts, the OOM flag and the micro-batch count travel through a gloo group: no device read (7 per rank
    # before issue 15's rewrite).
    for syncs in spawn_two_ranks(_count_on_two_ranks, tmp_path, "ddp", _spec(oom={"enabled": True})):
        assert_within_budget(syncs, 2)


def _count_in_one_fresh_process(tmp_path, spec: dict) -> HostSyncs:
    """One rank in a fresh process: the backend's process group (and DeepSpeed's state) stays out of this one."""
    out = str(tmp_path / "syncs")
    torch.multiprocessing.spawn(_one_rank, args=(spec, out), nprocs=1)
    return torch.load(out, weights_only=False)


def _one_rank(rank: int, spec: dict, out: str) -> None:
    torch.save(_count_on_two_ranks(spec), out)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# FSDP2 and DeepSpeed run on one rank here (their collectives are DDP's, budgeted above on two ranks; on two ranks
# they read 5 and 6 values per step before issue 15's rewrite, whose host counts go through a gloo group). The OOM
# fallback is refused with sharded engines (spec), so it is budgeted on its own above.
@pytest.mark.timeout(180)
def test_fsdp2_stays_within_two_reads_per_step(tmp_path):
    syncs = _count_in_one_fresh_process(tmp_path, _spec(engine="fsdp"))
    assert_within_budget(syncs, 2)


@pytest.mark.timeout(240)
def test_deepspeed_stays_within_two_reads_per_step(tmp_path):
    pytest.importorskip("deepspeed")
    syncs = _count_in_one_fresh_process(tmp_path, _spec(engine="deepspeed", deepspeed={"zero_stage": 2}))
    # DeepSpeed's own reads (runtime/utils.py: is_invalid_grad_norm's bool(), mask_nan_or_inf_with_val_inplace's
    # torch.tensor(-1.0, device=...)) are upstream's: reported, not budgeted. vlmfast reads the loss and the norm.
    assert_within_budget(syncs, 2, ignore=("deepspeed/",))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_default_path_on_cuda_under_sync_debug_mode():
    """On a GPU: the same budget with real device tensors, and torch.cuda.set_sync_debug_mode's own count."""
    torch.manual_seed(0)
    with count_host_syncs(device="cuda") as syncs:
        OptimizedTrainer(TinyCausalLM(), TokenDataset(32), TrainSpec(**_spec(device="cuda", grad_clip=1.0)),
                         callbacks=[syncs]).fit()
    assert_within_budget(syncs, 1)
    # torch's own count (its kernels' syncs included: nonzero, copies to the host, stream syncs) holds the same budget
    torch_steady = syncs.torch_per_step[1:]
    assert torch_steady and max(torch_steady) <= 1, syncs.report(steps=range(2, syncs.step + 1))
    print(syncs.report())
