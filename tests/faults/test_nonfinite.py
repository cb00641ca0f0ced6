"""NaN / Inf in the loss or the gradients at step k: the configured policy, never a silently corrupted model.

`loss.on_nonfinite: stop` raises NonFiniteLossError naming the step and the offending parameter group, before any
update, leaving the last checkpoint intact; `skip` drops the step (parameters untouched) and stops after
`loss.max_consecutive_skips` in a row. Under fp16 the GradScaler owns overflowing gradients: it skips the step and
lowers its scale, and the run goes on.
"""

from __future__ import annotations

import pytest
import torch
from _faults import losses, make_spec, params_of, train
from conftest import TinyCausalLM, TokenDataset
from torch.nn import functional as F

from vlmfast import Callback, NonFiniteLossError, OptimizedTrainer
from vlmfast.checkpoints.store import latest_checkpoint, list_checkpoints, load_checkpoint


class NonFiniteAt(TinyCausalLM):
    """Forward call `k` (and every later one if `stay`) returns a `kind` loss: nan, inf, or "grad": a finite loss
    whose gradient is inf in head.bias (sqrt at 0)."""

    def __init__(self, k: int, kind: str, stay: bool = False) -> None:
        super().__init__()
        self.k, self.kind, self.stay, self.calls = k, kind, stay, 0

    def forward(self, input_ids, labels=None, attention_mask=None):
        loss = self._loss(input_ids, labels)
        if not torch.is_grad_enabled():  # the label-convention probe (once, no grad) is not a training call
            return {"loss": loss}
        self.calls += 1
        if self.calls == self.k or (self.stay and self.calls > self.k):
            if self.kind == "grad":
                w = self.head.bias[0]
                loss = loss + torch.sqrt(w - w.detach())  # value 0, gradient inf
            else:
                loss = loss * float(self.kind)
        return {"loss": loss}

    def _loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """TinyCausalLM's loss, with its position divisor on the input's device (so it also runs on CUDA)."""
        h = self.dropout(self.embed(input_ids))
        positions = torch.arange(1, h.shape[1] + 1, device=h.device)[:, None]
        logits = self.head(self.norm(h + torch.tanh(self.mix(torch.cumsum(h, dim=1) / positions))))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


class Snapshots(Callback):
    """Parameters after every step."""

    def __init__(self) -> None:
        self.params: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, trainer, metrics) -> None:
        self.params[metrics["step"]] = params_of(trainer.model)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


ONE_PASS = {"micro_batch_size": 8}  # one forward per step: forward call k is step k


def seeded(k: int, kind: str) -> NonFiniteAt:
    """NonFiniteAt(k, kind) with the same initial parameters every time (k=0: never non-finite)."""
    torch.manual_seed(1234)
    return NonFiniteAt(k, kind)


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_nonfinite_loss_stops_naming_the_step_before_any_update_and_the_last_checkpoint_is_intact(kind, tmp_path):
    """A run saving every 2 steps meets a NaN/Inf loss at step 6: it stops naming step 6 before updating anything;
    no checkpoint is written on the way out (neither a final one of step 5 nor one of step 6), so the newest is
    step 4's, complete, holding step 4's parameters, and a run resumed from it matches an unbroken run."""
    snapshots = Snapshots()
    spec = make_spec(**ONE_PASS, save={"dir": str(tmp_path), "every_steps": 2})
    trainer = OptimizedTrainer(seeded(6, kind), TokenDataset(64), spec, callbacks=[snapshots])
    with pytest.raises(NonFiniteLossError, match=rf"step 6: loss is {kind}.*loss.on_nonfinite=stop"):
        trainer.fit()
    assert trainer.state.step == 5
    assert_same(params_of(trainer.model), snapshots.params[5])  # step 6 changed nothing

    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000004"]
    assert not list(tmp_path.glob(".tmp-*"))  # no half-written checkpoint either
    newest = latest_checkpoint(tmp_path)
    saved = load_checkpoint(newest)
    assert saved["trainer"]["step"] == 4
    assert_same(snapshots.params[4], saved["engine"]["model"])
    _, unbroken = train(make_spec(**ONE_PASS), seeded(0, kind))
    _, resumed = train(spec, seeded(0, kind))  # same save.dir: resumes from the newest checkpoint
    assert resumed.resumed_from == newest
    assert [m["step"] for m in resumed.history] == list(range(5, 13))
    assert losses(resumed) == losses(unbroken)[4:]


@pytest.mark.parametrize("kind", ["nan", "inf", "grad"])
def test_skip_policy_drops_the_step_leaves_parameters_untouched_and_goes_on(kind):
    snapshots = Snapshots()
    spec = make_spec(**ONE_PASS, grad_clip=1.0, loss={"on_nonfinite": "skip"})
    trainer, result = train(spec, NonFiniteAt(3, kind), callbacks=[snapshots])
    assert [m["skipped"] for m in result.history] == [False, False, True] + [False] * 9
    assert result.report.skipped_steps == 1 and trainer.state.step == 12
    assert_same(snapshots.params[2], snapshots.params[3])
    assert not torch.equal(snapshots.params[3]["head.weight"], snapshots.params[4]["head.weight"])  # trains again
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_skip_policy_stops_after_max_consecutive_skips():
    spec = make_spec(**ONE_PASS, loss={"on_nonfinite": "skip", "max_consecutive_skips": 2})
    with pytest.raises(NonFiniteLossError, match=r"step 5: loss is nan.*3 non-finite step\(s\) in a row"):
        train(spec, NonFiniteAt(3, "nan", stay=True))


def test_nonfinite_gradient_names_the_parameter_group():
    spec = make_spec(grad_clip=1.0, optimizer={"param_groups": [{"modules": ["head"], "lr": 1e-3}]})
    expected = r"step 1: .*gradient norm inf; non-finite gradients in group 'head \(no decay\)' \(head.bias\)"
    with pytest.raises(NonFiniteLossError, match=expected):
        train(spec, NonFiniteAt(1, "grad"))


# ---- fp16: the GradScaler skips overflowing steps ------------------------------------------------------------
def test_grad_scaler_skip_step_logic_on_cpu():
    """The fp16 path of the trainer with a CPU GradScaler in place of the CUDA one (fp16 autocast needs CUDA; the
    skip logic does not): an inf gradient at step 3 is skipped by the scaler, whose scale halves; the run goes on
    even under loss.on_nonfinite: stop, because overflow is the scaler's normal business."""
    snapshots = Snapshots()
    trainer = OptimizedTrainer(NonFiniteAt(3, "grad"), TokenDataset(64), make_spec(**ONE_PASS), callbacks=[snapshots])
    trainer.engine.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    result = trainer.fit()
    assert [m["skipped"] for m in result.history] == [False, False, True] + [False] * 9
    assert trainer.engine.precision.scaler.get_scale() == 2.0**9
    assert_same(snapshots.params[2], snapshots.params[3])
    assert trainer.state.step == 12 and all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp16_grad_scaler_skips_an_overflowing_step_on_cuda():
    snapshots = Snapshots()
    spec = make_spec(**ONE_PASS, precision="fp16", device="cuda")
    trainer = OptimizedTrainer(NonFiniteAt(3, "grad"), TokenDataset(64), spec, callbacks=[snapshots])
    scale = trainer.engine.precision.scaler.get_scale()
    result = trainer.fit()
    assert result.history[2]["skipped"] and not any(m["skipped"] for m in result.history[3:])
    assert trainer.engine.precision.scaler.get_scale() <= scale / 2  # backed off at step 3 (grows every 2000)
    assert_same(snapshots.params[2], snapshots.params[3])
    assert trainer.state.step == 12 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
