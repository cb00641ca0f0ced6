"""Every example runs: each script for a few steps, each config validated and (where one CPU process can) trained.

Usage: ``python -m pytest tests/test_examples.py -q`` (in-process where possible; the launch script starts 2 CPU
processes). Each test runs in a temporary working directory, so checkpoints and logs land there.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from vlmfast import OptimizedTrainer
from vlmfast.cli.main import main as vlmfast
from vlmfast.spec import TrainSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CONFIGS = sorted((EXAMPLES / "configs").glob("*.yaml"))
SCRIPTS = sorted(EXAMPLES.glob("*.py"))
TINY = ["--samples", "64", "--set", "max_steps=2", "--set", "scheduler.warmup_steps=0", "--set", "log.progress=off",
        "--set", "eval.max_batches=1"]


@pytest.fixture(autouse=True)
def in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def no_global_state_left():
    """Nothing an example sets up process-wide outlives its test: a process group (DeepSpeed, FSDP2), Accelerate's
    singleton state."""
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


def load(name: str) -> ModuleType:
    """Import examples/NAME.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------- scripts


def test_every_script_has_main_with_steps_and_a_steps_flag() -> None:
    import inspect

    for script in SCRIPTS:
        module = load(script.stem)
        assert "steps" in inspect.signature(module.main).parameters, script.name
        assert '"--steps"' in script.read_text(), script.name
    assert "--steps" in (EXAMPLES / "launch_multi_gpu.sh").read_text()


def test_hand_written_loop_after_differs_by_a_few_lines_of_hooks() -> None:
    before = (EXAMPLES / "hand_written_loop_before.py").read_text().splitlines()
    after = (EXAMPLES / "hand_written_loop_after.py").read_text().splitlines()
    changed = [line for line in difflib.unified_diff(before, after, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert len(changed) <= 20, changed
    assert any("vlmfast.hooks" in line for line in changed)


@pytest.mark.parametrize("name", ["hand_written_loop_before", "replace_the_loop", "accelerate_loop", "fabric_loop",
                                  "own_attention"])
def test_script_trains_a_few_steps(name: str) -> None:
    loss = load(name).main(steps=2)
    assert math.isfinite(loss)


def test_hand_written_loop_after_survives_the_oom_that_stops_the_loop_before(caplog: pytest.LogCaptureFixture) -> None:
    """What the hooks promise: an OOM at micro-batch 4 halves it and retries the batch, with the same gradient."""
    from vlmfast.testing import simulated_oom

    with simulated_oom(2), pytest.raises(torch.OutOfMemoryError):  # a forward on more than 2 samples
        load("hand_written_loop_before").main(steps=2)
    after = load("hand_written_loop_after")
    plain = after.main(steps=2)
    with simulated_oom(2) as oom, caplog.at_level("WARNING", logger="vlmfast.strategies.oom"):
        shrunk = after.main(steps=2)
    assert oom.count == 1  # once at micro-batch 4; every later micro-batch has 2 samples
    assert "micro_batch_size 4 -> 2 (out of memory)" in caplog.text
    assert shrunk == pytest.approx(plain, rel=1e-3)  # token-weighted: the split does not change the gradient


def test_hf_llava_trains_from_a_config_and_from_saved_weights() -> None:
    pytest.importorskip("transformers")
    module = load("hf_llava")
    model, processor = module.tiny_llava()
    dataset = module.ShapesCaptionDataset(num_samples=4)
    batch = module.CaptionCollator(processor, dataset.tokenizer.decode)([dataset[i] for i in range(2)])
    image_tokens = (batch["input_ids"] == model.config.image_token_index).sum(dim=1)
    assert image_tokens.tolist() == [16, 16]  # <image> expanded to one token per patch
    assert (batch["labels"][batch["input_ids"] == model.config.image_token_index] == -100).all()
    assert math.isfinite(module.main(steps=2))
    # The real-weights path (--model-path): from_pretrained of the model and its processor, saved here.
    model.save_pretrained("saved_llava")
    processor.save_pretrained("saved_llava")
    assert math.isfinite(module.main(steps=2, model_path="saved_llava"))


def train_hf_llava(module: ModuleType, monkeypatch: pytest.MonkeyPatch, **kwargs) -> OptimizedTrainer:
    """Run the example's main(**kwargs); the trainer it built (its spec and model)."""
    built = []

    class Recorded(OptimizedTrainer):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            built.append(self)

    monkeypatch.setattr(module, "OptimizedTrainer", Recorded)
    assert math.isfinite(module.main(**kwargs))
    return built[0]


def test_hf_llava_merges_a_config_into_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """--config adds the YAML's fields to the example's settings: freeze and the lr for the weights stay unless the
    YAML or a flag sets them; the config's 20-step warm-up is cut for a 2-step run instead of failing."""
    pytest.importorskip("transformers")
    module = load("hf_llava")
    model, processor = module.tiny_llava()
    model.save_pretrained("saved_llava")
    processor.save_pretrained("saved_llava")
    Path("wd.yaml").write_text("optimizer: {weight_decay: 0.05}\nscheduler: {name: cosine, warmup_steps: 20}\n")
    spec = train_hf_llava(module, monkeypatch, steps=2, model_path="saved_llava", config="wd.yaml").spec
    assert spec.optimizer.lr == 2e-5 and spec.optimizer.freeze == ["vision_tower"]  # real weights: the example's
    assert spec.optimizer.weight_decay == 0.05 and spec.scheduler.name == "cosine"  # the YAML's
    assert spec.scheduler.warmup_steps == 0 and spec.max_steps == 2
    assert spec.batch_size == 8 and spec.attention.vision_backend == "sdpa"

    pytest.importorskip("deepspeed")  # the documented command's config
    zero2 = str(EXAMPLES / "configs" / "zero2_bf16.yaml")
    trainer = train_hf_llava(module, monkeypatch, steps=2, config=zero2, lr=1e-3)
    spec = trainer.spec
    assert spec.optimizer.lr == 1e-3 and spec.optimizer.freeze == ["vision_tower"]  # the flag, the example's
    assert spec.optimizer.weight_decay == 0.01 and spec.engine == "deepspeed" and spec.precision == "bf16"  # the YAML's
    assert spec.scheduler.warmup_steps == 0 and spec.max_steps == 2
    vision = [p for name, p in trainer.model.named_parameters() if "vision_tower" in name]
    assert vision and not any(p.requires_grad for p in vision)


def test_webdataset_example_writes_shards_and_trains() -> None:
    pytest.importorskip("webdataset")
    assert math.isfinite(load("webdataset_shards").main(steps=2, workdir="demo", samples=48))
    assert len(list(Path("demo/shards").glob("*.tar"))) == 4


def test_my_task_runs_the_packing_and_grouping_config() -> None:
    assert load("my_task").main(steps=2) == 0


# ---------------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_config_is_a_valid_spec(config: Path) -> None:
    spec = TrainSpec.from_file(config)
    assert spec.max_steps > 2


CPU_CONFIGS = ["tiny_vlm_cpu", "accumulate_bf16", "activation_checkpointing", "oom_fallback"]


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_config_trains_two_steps_through_the_cli(name: str) -> None:
    assert vlmfast(["train", str(EXAMPLES / "configs" / f"{name}.yaml"), *TINY]) == 0


def test_profile_doctor_config_runs_the_doctor(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(EXAMPLES / "configs" / "profile_doctor.yaml")
    assert vlmfast(["doctor", config, "--steps", "4", "--samples", "64", "--out", "doctor"]) == 0
    assert "step time p50" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["zero2_bf16", "fsdp2_bf16"])
def test_sharded_config_trains_through_the_cli_without_a_launcher(name: str) -> None:
    # A fresh process, as a user runs it: a process group left by an earlier test would not be this run's.
    if name.startswith("zero"):
        pytest.importorskip("deepspeed")
    command = [sys.executable, "-m", "vlmfast.cli.main", "train", str(EXAMPLES / "configs" / f"{name}.yaml"), *TINY]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_launch_script_trains_on_two_cpu_processes() -> None:
    env = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}
    command = ["bash", str(EXAMPLES / "launch_multi_gpu.sh"), str(EXAMPLES / "configs" / "ddp_comm_hook.yaml"),
               "--steps", "2", *TINY[:2], *TINY[4:]]  # --steps instead of --set max_steps=2
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "steps 2" in proc.stdout + proc.stderr
