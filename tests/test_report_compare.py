"""The report compares with the previous run in the same log.dir (issue 29): the spec fields that changed and each
headline figure with its ratio; a resumed run is one run (no comparison with its own earlier session)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import TinyCausalLM, TokenDataset

from vlmfast import OptimizedTrainer, TrainSpec

FIGURES = ("samples/s", "real tokens/s", "step time p50 (ms)", "step time p90 (ms)", "peak memory (GiB)", "eval loss")


def _fit(log_dir: Path, save_dir: Path | None = None, **spec):
    base = {"max_steps": 3, "batch_size": 4, "micro_batch_size": 4, "seed": 0,
            "log": {"progress": "off", "dir": str(log_dir)},
            **({"save": {"dir": str(save_dir)}} if save_dir is not None else {})}
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(32), TrainSpec(**{**base, **spec}),
                               eval_data=TokenDataset(8))
    return trainer.fit()


def _block(text: str) -> str:
    assert "vs the previous run" in text, text
    return text[text.index("vs the previous run"):]


def test_a_second_run_in_the_log_dir_compares_with_the_first(tmp_path):
    first = _fit(tmp_path)
    assert "vs the previous run" not in first.report.to_text()  # a first run has nothing to compare with
    assert json.loads((tmp_path / "report.json").read_text())["spec"]["micro_batch_size"] == 4

    second = _fit(tmp_path, micro_batch_size=2)
    block = _block(second.report.to_text())
    assert "micro_batch_size: 4 -> 2" in block and "1 field(s) differ" in block
    for label in FIGURES:
        line = next(line for line in block.splitlines() if line.strip().startswith(label))
        assert re.search(r"\S+ -> \S+\s+\d+\.\d\dx$", line), line  # old -> new and the ratio
    tokens = next(line for line in block.splitlines() if line.strip().startswith("real tokens/s"))
    old, new = (float(x) for x in re.findall(r"(\d+) -> (\d+)", tokens)[0])
    assert float(tokens.split()[-1].rstrip("x")) == round(second.report.tokens_per_s / first.report.tokens_per_s, 2)
    assert abs(new / old - second.report.tokens_per_s / first.report.tokens_per_s) < 0.02
    assert "tokens: real input tokens" in block  # the definitions under the figures

    # report.json ends with the same block; the first run's report is kept as report.previous.json
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["previous"]["spec"]["micro_batch_size"] == 4 and saved["spec"]["micro_batch_size"] == 2
    assert json.loads((tmp_path / "report.previous.json").read_text())["spec"]["micro_batch_size"] == 4


def test_a_resumed_run_does_not_compare_with_its_own_earlier_session(tmp_path):
    logs, save = tmp_path / "logs", tmp_path / "ckpt"
    _fit(logs, save, max_steps=2)
    resumed = _fit(logs, save, max_steps=4)
    assert resumed.resumed_from is not None
    assert "vs the previous run" not in resumed.report.to_text()
    saved = json.loads((logs / "report.json").read_text())
    assert saved["steps"] == 4 and saved["previous"] is None and not (logs / "report.previous.json").exists()


def test_a_resumed_run_compares_with_the_run_before_it_not_its_first_session(tmp_path):
    logs = tmp_path / "logs"
    _fit(logs, precision="fp32")  # run A: 3 steps, no checkpoint
    _fit(logs, tmp_path / "ckpt", max_steps=2, micro_batch_size=2)  # run B, first session
    resumed = _fit(logs, tmp_path / "ckpt", max_steps=4, micro_batch_size=2)  # run B, resumed
    block = _block(resumed.report.to_text())
    assert "report.previous.json: 3 steps" in block  # run A's, not B's first session (2 steps)
    assert "micro_batch_size: 4 -> 2" in block
