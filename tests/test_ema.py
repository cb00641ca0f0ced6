"""EMA of the weights: the average the strategy keeps is the one computed by hand, evaluated and resumed."""

from __future__ import annotations

import torch
from conftest import TinyCausalLM, TokenDataset

from vlmfast import Callback, OptimizedTrainer, TrainSpec
from vlmfast.strategies.ema import ExponentialMovingAverage


class RecordWeights(Callback):
    def __init__(self) -> None:
        self.weights: list[list[torch.Tensor]] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.weights.append([p.detach().double().clone() for p in trainer.engine.module.parameters()])


def spec(**overrides) -> TrainSpec:
    base = dict(max_steps=6, batch_size=8, device="cpu", optimizer={"name": "sgd", "lr": 0.5},
                ema={"enabled": True, "decay": 0.8, "every_steps": 2, "update_after_step": 1},
                log={"progress": "off"})
    return TrainSpec(**{**base, **overrides})


def expected_average(weights: list[list[torch.Tensor]], decay: float, every: int, after: int) -> list[torch.Tensor]:
    average = None
    for number, current in enumerate(weights, start=1):
        if average is None or number <= after:
            average = [w.clone() for w in current]
        elif number % every == 0:
            average = [decay * a + (1 - decay) * w for a, w in zip(average, current, strict=True)]
    return average


def test_ema_is_the_average_of_the_trajectory_and_is_evaluated():
    recorder = RecordWeights()
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), spec(), callbacks=[recorder],
                               eval_data=TokenDataset(16, seed=5))
    result = trainer.fit()
    ema = trainer.strategies[[s.name for s in trainer.strategies].index("ema")].ema
    expected = expected_average(recorder.weights, 0.8, every=2, after=1)
    actual = [a.double() for a in ema.average]
    diff = torch.cat([(a - e).flatten() for a, e in zip(actual, expected, strict=True)]).norm()
    scale = torch.cat([e.flatten() for e in expected]).norm()
    assert diff / scale < 1e-6
    moved = torch.cat([(a - w).flatten() for a, w in zip(actual, recorder.weights[-1], strict=True)]).norm()
    assert moved / scale > 1e-3  # the average really differs from the weights: the flag did something
    final = result.eval_history[-1]
    assert final["eval_loss_ema"] != final["eval_loss"]
    assert any(line.startswith("ema: decay 0.8") for line in result.report.strategies)


def test_swapped_in_restores_the_trained_weights():
    model = torch.nn.Linear(3, 2)
    ema = ExponentialMovingAverage(list(model.parameters()), decay=0.5)
    trained = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    with ema.swapped_in():
        assert torch.allclose(model.weight, trained[0] + 0.5)
    assert torch.allclose(model.weight, trained[0] + 1.0)


def model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM()


def test_ema_resumes_exactly(tmp_path):
    full = OptimizedTrainer(model(), TokenDataset(64), spec())
    full.fit()
    save = {"dir": str(tmp_path), "every_steps": 3}
    OptimizedTrainer(model(), TokenDataset(64), spec(max_steps=3, save=save)).fit()
    resumed = OptimizedTrainer(model(), TokenDataset(64), spec(save={**save, "resume": "auto"}))
    resumed.fit()

    def average(trainer):
        return trainer.strategies[[s.name for s in trainer.strategies].index("ema")].ema.average

    for a, b in zip(average(full), average(resumed), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
