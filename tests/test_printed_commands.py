"""Every command the README, the docs and examples/ print runs, with a small step count, so none can rot.

Commands are collected from fenced bash blocks of README.md and docs/*.md, the docstrings of examples/*.py and the
comment lines of examples/*.sh and examples/configs/*.yaml. Each one is, by the first rule of RULES it matches:

- "run": run in this process (``vlmfast ...`` through ``vlmfast.cli.main.main``, ``python examples/X.py`` by runpy),
  with at most MAX_STEPS optimizer steps and 64 generated samples for the built-in task;
- "launch": run as printed in a fresh process group of 2 CPU processes (the launcher's process count cut to 2);
- "check": parsed by vlmfast's own argument parser and its spec validated, files named must exist; the reason says
  which test runs the same job (a GPU launcher, or a sharded engine in a fresh process elsewhere);
- "skip": not a training command (installing, the test suite, the site build, a second machine, a download).

A printed command that matches no rule fails `test_every_printed_command_has_a_rule`: add a rule, or fix the text.
Usage: ``python -m pytest tests/test_printed_commands.py -q``.
"""

from __future__ import annotations

import ast
import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
PROGRAM = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:\.venv/bin/)?(vlmfast|python3?|torchrun|accelerate|bash|deepspeed|pip|"
                     r"mkdocs)\s")
MAX_STEPS = 5  # a printed step count up to this runs as printed; larger ones (and none) run SMALL_STEPS
SMALL_STEPS = 2
DOCTOR_STEPS = 4  # the doctor needs a warm-up step, timed steps and a traced one
EXIT_CODES = {"estimate-memory": (0, 1)}  # documented: 1 means "does not fit"


@dataclass(frozen=True)
class Printed:
    """One printed command: where it is printed and its words (comments, [optional] parts and notes removed)."""

    source: str
    text: str

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    @property
    def id(self) -> str:
        return f"{self.source}: {self.text}"


def _joined_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined."""
    lines, pending = [], ""
    for raw in text.splitlines():
        line = f"{pending} {raw.strip()}".strip() if pending else raw.strip()
        line = line.removesuffix("\\\\")  # a continuation inside a Python docstring
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        lines.append(line)
    return lines


def _clean(line: str) -> list[str]:
    """The commands of one printed line: prompt, comment, [optional] parts and a trailing (note) removed."""
    line = re.sub(r"^\$\s+", "", line)
    line = re.sub(r"\s+#\s.*$", "", line)
    line = re.sub(r"\s*\[[^\]]*\]", "", line)
    line = re.sub(r"\s+\([^)]*\)\s*$", "", line)
    return [part.strip() for part in line.split("&&") if part.strip()]


def _printed_lines() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in FENCE.finditer(page.read_text()):
            if match.group(1) in ("bash", "sh", "shell", "console"):
                found += [(page.name, line) for line in _joined_lines(match.group(2))]
    for script in sorted((ROOT / "examples").glob("*.py")):
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        found += [(f"examples/{script.name}", re.sub(r"^Usage:\s*", "", line)) for line in _joined_lines(doc)]
    for path in [*sorted((ROOT / "examples").glob("*.sh")), *sorted((ROOT / "examples" / "configs").glob("*.yaml"))]:
        comments = "\n".join(line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#"))
        found += [(str(path.relative_to(ROOT)), line) for line in _joined_lines(comments)]
    return found


def printed_commands() -> list[Printed]:
    """Every distinct command printed anywhere (the first place it is printed names it)."""
    commands: dict[str, Printed] = {}
    for source, line in _printed_lines():
        for text in _clean(line):
            if PROGRAM.match(text + " ") and "placeholder" not in text:
                commands.setdefault(text, Printed(source, text))
    return list(commands.values())


# (pattern on the command text, action, reason); the first match wins.
RULES: list[tuple[str, str, str]] = [
    (r"scripts/setup\.sh|^pip ", "skip", "installs the environment (CI runs scripts/setup.sh --dev itself)"),
    (r"-m pytest", "skip", "the test suite itself"),
    (r"mkdocs build", "skip", "tests/test_docs.py::test_site_builds_strict_without_warnings builds the site"),
    (r"benchmarks/compare\.py", "skip", "a benchmark (minutes; --quick is tests/test_bench.py's quick fixture)"),
    (r"benchmarks/gpu_lease\.sh", "skip", "the GPU lease's commands (prepare downloads, run is sent to the device); "
     "tests/test_gpu_lease.py rehearses both"),
    (r"NNODES=2|--nnodes 2", "skip", "needs a second machine (the rendezvous is the 1-node command's)"),
    (r"--model-path llava-hf/", "skip", "downloads 7B weights from the Hugging Face Hub"),
    (r"^deepspeed ", "check", "DeepSpeed's launcher needs GPUs; the engine trains in tests/test_deepspeed.py"),
    (r"(zero2|fsdp2)_bf16\.yaml|engine=(deepspeed|fsdp)", "check",
     "a sharded engine: tests/test_examples.py::test_sharded_config_trains_through_the_cli_without_a_launcher runs "
     "the config in a fresh process; tests/test_fsdp.py and tests/test_deepspeed.py on 2 ranks"),
    (r"launch_multi_gpu\.sh(?! examples/configs/ddp_comm_hook\.yaml$)|torchrun .*configs/ddp_comm_hook", "check",
     "the same script and config as the launched "
     "`bash examples/launch_multi_gpu.sh examples/configs/ddp_comm_hook.yaml` (torchrun inside)"),
    (r"vlmfast train examples/configs/(tiny_vlm_cpu|accumulate_bf16|activation_checkpointing|oom_fallback)\.yaml$",
     "check", "tests/test_examples.py::test_config_trains_two_steps_through_the_cli trains it through the CLI"),
    (r"python3? examples/(hand_written_loop_before|replace_the_loop|accelerate_loop|fabric_loop|own_attention)\.py"
     r"( --steps \d+)?$", "check", "tests/test_examples.py::test_script_trains_a_few_steps runs its main(steps=2)"),
    (r"python3? examples/hf_llava\.py", "check",
     "tests/test_examples.py::test_hf_llava_trains_from_a_config_and_from_saved_weights runs its main(steps=2)"),
    (r"python3? examples/my_task\.py", "check",
     "tests/test_examples.py::test_my_task_runs_the_packing_and_grouping_config runs its main(steps=2)"),
    (r"python3? examples/webdataset_shards\.py", "check",
     "tests/test_examples.py::test_webdataset_example_writes_shards_and_trains runs its main(steps=2)"),
    (r"doctor .*--apply", "check", "tests/test_doctor.py::test_one_flag_at_a_time_measures_each_change_alone runs "
     "--apply's trials"),
    (r"^vlmfast export ", "check", "needs a checkpoint: tests/test_export.py::"
     "test_vlmfast_export_of_a_tiny_vlm_run_that_saved_every_step_reloads_with_the_documented_lines trains one and "
     "exports it (a save.dir too)"),
    (r"^(torchrun|accelerate launch|bash examples/launch_multi_gpu\.sh)|--devices 2", "launch", ""),
    (r"^(\S+=\S+ )*(\.venv/bin/)?(vlmfast|python3? examples/)", "run", ""),
]


def rule(command: Printed) -> tuple[str, str]:
    for pattern, action, reason in RULES:
        if re.search(pattern, command.text):
            return action, reason
    return "unknown", ""


COMMANDS = printed_commands()
BY_ACTION = {action: [c for c in COMMANDS if rule(c)[0] == action] for action in ("run", "launch", "check")}


def test_every_printed_command_has_a_rule() -> None:
    assert len(COMMANDS) > 30  # the collection itself works
    unknown = [c.id for c in COMMANDS if rule(c)[0] == "unknown"]
    assert not unknown, "printed commands no rule covers (add one to RULES, or fix the text):\n" + "\n".join(unknown)
    for command in COMMANDS:  # a reason that names a test names one that exists
        for test_file, test_name in re.findall(r"(tests/\w+\.py)::(\w+)", rule(command)[1]):
            assert f"def {test_name}(" in (ROOT / test_file).read_text(), (command.id, test_name)


# ------------------------------------------------------------------------------------------ the workspace


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA config.json (what `--hf-config path/to/config.json` reads)."""
    path = tmp_path_factory.mktemp("hf") / "config.json"
    _hf_config(path)
    return path


@pytest.fixture
def workdir(tmp_path: Path, hf_config: Path) -> Path:
    """A fresh folder that looks like a checkout (examples/ linked) with the inputs printed commands assume:
    run.yaml from the documented `vlmfast spec --defaults > run.yaml`, images/ and data.jsonl for shards, the HF
    config at path/to/config.json, and mypkg.jobs (a user's package) for --task mypkg.jobs:build."""
    from PIL import Image

    from vlmfast.spec import defaults_yaml

    for name in ("examples", "benchmarks", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "run.yaml").write_text(defaults_yaml())
    (tmp_path / "images").mkdir()
    lines = []
    for i in range(4):
        Image.new("RGB", (16, 16), (60 * i, 0, 0)).save(tmp_path / f"images/{i}.png")
        (tmp_path / f"images/{i}.txt").write_text(f"a red square {i}")
        lines.append(f'{{"image": "images/{i}.png", "text": "square {i}"}}')
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg/__init__.py").write_text("")
    (tmp_path / "mypkg/jobs.py").write_text("from my_task import build  # a user's own job: the example's\n")
    (tmp_path / "path/to").mkdir(parents=True)
    (tmp_path / "path/to/config.json").write_text(hf_config.read_text())
    return tmp_path


def _hf_config(path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    vision = transformers.CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4)
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2)
    transformers.LlavaConfig(vision_config=vision, text_config=text).to_json_file(str(path))


class _stdout_to:
    """Redirect sys.stdout (what `> file` does in the shell)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def __enter__(self) -> None:
        self.saved, sys.stdout = sys.stdout, self.handle

    def __exit__(self, *exc: object) -> None:
        sys.stdout = self.saved


# ------------------------------------------------------------------------------------- budget and arguments


def _env_and_words(command: Printed) -> tuple[dict[str, str], list[str]]:
    words = command.words
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words and words[0].startswith(".venv/bin/"):
        words[0] = words[0].removeprefix(".venv/bin/")
    return env, words


def _small_steps(value: str) -> str:
    return value if int(value) <= MAX_STEPS else str(SMALL_STEPS)


def vlmfast_budget(args: list[str]) -> list[str]:
    """vlmfast arguments with at most MAX_STEPS steps, the built-in task on 64 samples, no progress bar."""
    args = list(args)
    if not args or args[0] not in ("train", "doctor", "find-batch-size"):
        return args
    sets = [args[i + 1] for i, word in enumerate(args[:-1]) if word == "--set"]
    if args[0] == "doctor":
        if "--steps" in args:
            i = args.index("--steps") + 1
            args[i] = str(min(int(args[i]), DOCTOR_STEPS))
        else:
            args += ["--steps", str(DOCTOR_STEPS)]
    else:
        max_steps = [s for s in sets if s.startswith("max_steps=")]
        if not max_steps or int(max_steps[-1].split("=")[1]) > MAX_STEPS:
            args += ["--set", f"max_steps={SMALL_STEPS}"]
        args += ["--set", "log.progress=off"]
    if "--task" not in args:  # the built-in task: fewer generated samples, one held-out batch
        args += ["--samples", "32"] + (["--set", "eval.max_batches=1"] if args[0] == "train" else [])
    return args


def script_budget(args: list[str]) -> list[str]:
    """A script's arguments with --steps at most MAX_STEPS (added when absent)."""
    args = list(args)
    if "--steps" in args:
        i = args.index("--steps") + 1
        args[i] = _small_steps(args[i])
        return args
    return [*args, "--steps", str(SMALL_STEPS)]


# ------------------------------------------------------------------------------------------------- run


def _run_in_process(command: Printed, monkeypatch: pytest.MonkeyPatch) -> int:
    from vlmfast.cli.main import main as vlmfast

    env, words = _env_and_words(command)
    for key, value in env.items():
        if key == "PYTHONPATH":
            monkeypatch.syspath_prepend(str(Path(value).resolve()))
        else:
            monkeypatch.setenv(key, value)
    if words[0] == "vlmfast":
        if ">" in words:  # `vlmfast spec --defaults > run.yaml`
            at = words.index(">")
            with open(words[at + 1], "w") as handle, _stdout_to(handle):
                return vlmfast(words[1:at])
        return vlmfast(vlmfast_budget(words[1:]))
    script = words[1]
    monkeypatch.syspath_prepend(str(Path(script).resolve().parent))  # what `python script.py` puts first
    monkeypatch.setattr(sys, "argv", [script, *script_budget(words[2:])])
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


@pytest.fixture
def in_workdir(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))  # mypkg
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # mypkg.jobs imports my_task
    yield workdir
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("command", BY_ACTION["run"], ids=lambda c: c.id)
def test_printed_command_runs(command: Printed, in_workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = next((codes for word, codes in EXIT_CODES.items() if word in command.text), (0,))
    assert _run_in_process(command, monkeypatch) in allowed, command.id


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_words(command: Printed) -> tuple[dict[str, str], list[str]]:
    """The launched command with 2 processes and the step budget; `python` is this interpreter."""
    env, words = _env_and_words(command)
    python = [sys.executable]
    launcher = {"torchrun": [*python, "-m", "torch.distributed.run"],
                "accelerate": [*python, "-m", "accelerate.commands.launch"],
                "python": python, "python3": python}.get(words[0])
    rest = words[1:] if launcher else words
    if words[0] == "accelerate":
        rest = rest[1:]  # `launch`
    for flag in ("--nproc_per_node", "--num_processes"):
        if flag in rest:
            rest[rest.index(flag) + 1] = "2"
    if words[0] == "bash":
        env.update(PYTHON=sys.executable, NPROC_PER_NODE="2")
    # Launched side by side: each gets its own rendezvous port (the launchers all default to 29500).
    port = str(_free_port())
    env.update(MASTER_PORT=port, PET_MASTER_PORT=port)  # bash script and Fabric read the first, torchrun the second
    if words[0] == "accelerate":
        rest = ["--main_process_port", port, *rest]
    if "vlmfast.cli.main" in rest:  # -m vlmfast.cli.main ARGS
        at = rest.index("vlmfast.cli.main") + 1
        rest = rest[:at] + vlmfast_budget(rest[at:])
    elif words[0] == "bash":
        rest = [*rest, "--samples", "64", "--set", "log.progress=off", "--steps", str(SMALL_STEPS)]
    else:
        script = next(i for i, word in enumerate(rest) if word.endswith(".py"))
        rest = rest[:script + 1] + script_budget(rest[script + 1:])
    return env, (launcher or []) + rest


@pytest.mark.timeout(600)
def test_launched_commands_start_two_processes_and_train(workdir: Path) -> None:
    """All launcher commands at once (each is 2-3 processes, mostly waiting on imports): each trains on 2 ranks."""
    procs = {}
    for command in BY_ACTION["launch"]:
        env, words = _launch_words(command)
        procs[command.id] = subprocess.Popen(
            words, cwd=workdir, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    failures = []
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=540)
        two_ranks = "2 ranks" in out or "rank 1" in out or out.count("final loss") == 2
        if proc.returncode != 0 or not two_ranks or "trains alone" in out:
            failures.append(f"{name}: exit {proc.returncode}\n{out[-3000:]}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("command", BY_ACTION["check"], ids=lambda c: c.id)
def test_checked_command_parses_and_its_spec_is_valid(command: Printed, in_workdir: Path) -> None:
    """Commands run elsewhere (see their reason): vlmfast's parser accepts the arguments, the spec they name is valid
    and every file they name exists."""
    from vlmfast.cli.jobs import build_spec
    from vlmfast.cli.main import _parser

    _, words = _env_and_words(command)
    for word in words:
        if re.search(r"\.(ya?ml|py|sh|json)$", word):
            assert Path(word).exists(), f"{command.id}: {word} does not exist"
    if words[0].startswith("python") and words[1].endswith(".py"):  # the script's parser knows every flag printed
        source = Path(words[1]).read_text()
        assert all(f'"{flag}"' in source for flag in words[2:] if flag.startswith("--")), command.id
    if "vlmfast.cli.main" in words or words[0] == "vlmfast" or "launch_multi_gpu.sh" in " ".join(words):
        at = words.index("vlmfast.cli.main") + 1 if "vlmfast.cli.main" in words else 1
        args = words[at:]
        if "launch_multi_gpu.sh" in " ".join(words):  # its own --steps N is --set max_steps=N
            args = ["train", *" ".join(args[1:]).replace("--steps ", "--set max_steps=").split()]
        parsed = _parser().parse_args(args)
        build_spec(getattr(parsed, "config", None), getattr(parsed, "set", []))
