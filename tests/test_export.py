"""Export without writing code: `save.export` at the end of a completed fit(), and `vlmfast export CHECKPOINT OUT`.

- `save.export.dir`: a LoRA run writes PEFT's adapter folder (or, with `merge`, the merged model), a plain run its
  weights; each folder reloads to the trained model's logits / weights; an interrupted run exports nothing; a
  folder that cannot be written is refused before any work.
- `vlmfast export`: the checkpoint's model rebuilt by its task on its saved spec, the checkpoint loaded, the folder
  written: the built-in tiny VLM's weights equal the checkpoint's; a LoRA checkpoint of a tiny LLaVA merges into a
  folder `from_pretrained` loads with the trained logits (within 1e-5, fp32); bad paths fail in one line.
"""

from __future__ import annotations

import copy
import os
import signal

import pytest
import torch
from conftest import LlavaDataset, TinyCausalLM, TokenDataset, tiny_llava
from safetensors.torch import load_file

from vlmfast import Callback, OptimizedTrainer, SpecError, TrainSpec
from vlmfast.checkpoints.store import load_checkpoint
from vlmfast.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")
TOLERANCE = 1e-5


def spec(tmp_path, **extra) -> TrainSpec:
    base = {"max_steps": 2, "batch_size": 4, "micro_batch_size": 4, "device": "cpu", "log": {"progress": "off"},
            "optimizer": {"name": "adamw", "lr": 1e-2}, "memory": {"leak_check": False},
            "save": {"dir": str(tmp_path / "ckpt")}}
    for key, value in extra.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    return TrainSpec(**base)


def logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


def llava_batch() -> dict[str, torch.Tensor]:
    return torch.utils.data.default_collate([LlavaDataset(8)[i] for i in range(8)])


# ---- save.export: the end of fit() exports ------------------------------------------------------------------------
@pytest.mark.parametrize("merge", [False, True], ids=["adapters", "merged"])
def test_save_export_writes_the_lora_folder_at_the_end_of_a_fit_and_the_report_says_where(tmp_path, merge):
    peft = pytest.importorskip("peft")
    out = tmp_path / "export"
    trainer = OptimizedTrainer(tiny_llava(0), LlavaDataset(16), spec(
        tmp_path, lora={"enabled": True, "r": 4}, save={"export": {"dir": str(out), "merge": merge}}))
    result = trainer.fit()
    trained = logits(trainer.engine.module, llava_batch())
    assert not torch.allclose(trained, logits(tiny_llava(0), llava_batch()), atol=1e-3)  # the adapters moved

    assert result.exported == out and result.report.extra["exported"] == str(out)
    assert f"exported: {out}" in result.report.to_text()
    if merge:
        assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
        loaded = type(tiny_llava(0)).from_pretrained(str(out))
    else:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
        loaded = peft.PeftModel.from_pretrained(tiny_llava(0), str(out))  # onto a fresh base
    torch.testing.assert_close(logits(loaded, llava_batch()), trained, rtol=TOLERANCE, atol=TOLERANCE)


def test_save_export_writes_the_weights_of_a_plain_run(tmp_path):
    out = tmp_path / "export"
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec(tmp_path, save={"export": {"dir": str(out)}}))
    assert trainer.fit().exported == out
    saved = load_file(str(out / "model.safetensors"))
    state = trainer.engine.module.state_dict()
    assert sorted(saved) == sorted(state) and all(torch.equal(saved[n], t) for n, t in state.items())


class _SigtermAfterStep(Callback):
    def on_step_end(self, trainer, metrics) -> None:
        if metrics["step"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler: the run stops after this step


def test_an_interrupted_run_writes_its_checkpoint_but_exports_nothing(tmp_path):
    out = tmp_path / "export"
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec(tmp_path, save={"export": {"dir": str(out)}}),
                               callbacks=[_SigtermAfterStep()])
    result = trainer.fit()
    assert result.interrupted == "SIGTERM" and result.checkpoint is not None
    assert result.exported is None and not out.exists() and "exported" not in result.report.extra


def test_an_export_dir_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SpecError, match=r"save.export.dir .*a_file is a file, not a folder"):
        OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec(tmp_path, save={"export": {"dir": str(blocker)}}))
    assert not (tmp_path / "ckpt").exists()


# ---- vlmfast export CHECKPOINT OUT ----------------------------------------------------------------------------------
def test_vlmfast_export_writes_the_weights_of_a_tiny_vlm_checkpoint(tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    assert main(["train", "--samples", "64", "--set", "max_steps=2", "--set", "batch_size=4",
                 "--set", "log.progress=off", "--set", f"save.dir={ckpt}"]) == 0
    capsys.readouterr()
    assert main(["export", str(ckpt / "step_00000002"), str(out), "--samples", "64"]) == 0
    assert f"exported the model of step 2 ({ckpt / 'step_00000002'}) to {out}" in capsys.readouterr().out
    saved = load_file(str(out / "model.safetensors"))
    trained = load_checkpoint(ckpt / "step_00000002")["engine"]["model"]
    assert sorted(saved) == sorted(trained) and all(torch.equal(saved[n], t) for n, t in trained.items())

    again = tmp_path / "again"  # a save.dir names its newest checkpoint
    assert main(["export", str(ckpt), str(again), "--samples", "64"]) == 0
    assert load_file(str(again / "model.safetensors")).keys() == saved.keys()


LLAVA_TASK = '''
import json
from pathlib import Path

from conftest import LlavaDataset, tiny_llava


class Processor:
    """Stands in for a Hugging Face processor: what export saves next to the model."""

    def save_pretrained(self, directory):
        (Path(directory) / "processor_config.json").write_text(json.dumps({"kind": "stub"}))


def build():
    return {"model": tiny_llava(0), "train_data": LlavaDataset(16), "processor": Processor()}
'''


def test_vlmfast_export_merge_of_a_lora_checkpoint_loads_with_from_pretrained_and_gives_the_trained_logits(
        tmp_path, monkeypatch, capsys):
    pytest.importorskip("peft")
    (tmp_path / "llava_export_task.py").write_text(LLAVA_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    from llava_export_task import build

    job = build()
    trainer = OptimizedTrainer(job["model"], job["train_data"], spec(tmp_path, lora={"enabled": True, "r": 4}))
    checkpoint = trainer.fit().checkpoint
    trained = logits(copy.deepcopy(trainer.engine.module), llava_batch())
    assert not torch.allclose(trained, logits(tiny_llava(0), llava_batch()), atol=1e-3)  # the adapters moved

    out = tmp_path / "merged"
    assert main(["export", str(checkpoint), str(out), "--merge", "--task", "llava_export_task:build"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "processor_config.json"} <= names and "adapter_config.json" not in names
    loaded = pytest.importorskip("transformers").LlavaForConditionalGeneration.from_pretrained(str(out))  # no PEFT
    torch.testing.assert_close(logits(loaded, llava_batch()), trained, rtol=TOLERANCE, atol=TOLERANCE)


def test_vlmfast_export_names_a_missing_or_wrong_checkpoint_in_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / 'nope'} does not exist" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "is neither a checkpoint folder (no state.pt) nor a save.dir" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
