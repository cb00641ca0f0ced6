"""Every spec change an error message or advice suggests (``set packing.enabled: false``, ``--set precision=bf16``)
is a value the spec takes: each is fed back through the CLI's ``--set`` parser.

The suggestions are found, not listed: a regex over every string in vlmfast/ (so a new message is covered when it
is written), and over the messages that are built at run time (OOM advice, the memory estimator's fixes, the label
probe's question) for the values only known then.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel
from torch import nn

from vlmfast.cli.jobs import build_spec
from vlmfast.spec import TrainSpec

PACKAGE = Path(__file__).resolve().parent.parent / "vlmfast"

# `key: value` (a spec file's way) or, after --set, `key=value`; a value is a word, a number or a [list]
PAIR = re.compile(r"(?<![\w.\-])(?P<key>[a-z_]+(?:\.[a-z_]+)*)(?P<sep>: |=)"
                  r"(?P<value>\[[^\]\s]+\]|[^\s,;()'\"`{}\[\]|]+)")
# ... that is a suggestion: after "set", "use", "or", "+", "(" or a backtick, or alone at the start of a line
# (advice lists: "precision: bf16  (why)") when followed by the end, two spaces, a bracket, " with ", " or ", " + "
SUGGESTED_AFTER = re.compile(r"(?:\b(?:[Ss]et|[Uu]se|[Tt]ry|or|and|with) |\+ |[`(]|--set )$")
LINE_START = re.compile(r"(?:^|\n)[ \t]*(?:- )?$")
ALONE_UNTIL = re.compile(r"$|\n|  | with | or | \+ | \(|, |\)|\.$")


def spec_paths(model: type[BaseModel] = TrainSpec, prefix: str = "") -> set[str]:
    """Every dotted field of the spec, by its YAML name (save.async)."""
    paths: set[str] = set()
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            paths |= spec_paths(section, f"{key}.")
        else:
            paths.add(key)
    return paths


PATHS = spec_paths()


Suggestion = tuple[tuple[str, str], ...]  # the (field, value) pairs one change sets together


def suggestions(text: str) -> list[Suggestion]:
    """The spec changes `text` suggests; pairs joined by " + " or " with " are one change (deepspeed.zero_stage: 3 +
    deepspeed.offload_param: cpu), `a/b` alternatives are changes apart."""
    found: list[Suggestion] = []
    joined_at = -1  # where the last suggestion ended when " + " / " with " follows it
    for m in PAIR.finditer(text):
        before = text[: m.start()]
        if m["key"] not in PATHS or (m["sep"] == "=") != before.endswith("--set "):
            continue
        alone = LINE_START.search(before) and ALONE_UNTIL.match(text, m.end())
        if not (SUGGESTED_AFTER.search(before) or alone):
            continue
        alternatives = [(m["key"], value) for value in m["value"].rstrip(".").split("/")]
        if m.start() == joined_at and found:
            found[-1:] = [(*found[-1], pair) for pair in alternatives]
        else:
            found += [(pair,) for pair in alternatives]
        joined = re.match(r" (?:\+|with) ", text[m.end():])
        joined_at = m.end() + joined.end() if joined else -1
    return found


def source_suggestions() -> dict[Suggestion, list[str]]:
    """Each suggestion -> where: from every string constant (f-string parts too) of the package's source."""
    found: dict[Suggestion, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for suggestion in suggestions(node.value):
                    found.setdefault(suggestion, []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


SOURCE = source_suggestions()


def name(suggestion: Suggestion) -> str:
    return " + ".join(f"{key}={value}" for key, value in suggestion)


def assert_valid(suggestion: Suggestion, where: str) -> None:
    try:
        build_spec(None, [f"{key}={value}" for key, value in suggestion])
    except ValueError as exc:
        pytest.fail(f"{where} suggests {name(suggestion)}, which the spec refuses:\n{exc}")


@pytest.mark.parametrize("suggestion", sorted(SOURCE), ids=[name(s) for s in sorted(SOURCE)])
def test_every_suggestion_in_the_source_is_a_value_the_spec_takes(suggestion: Suggestion) -> None:
    assert_valid(suggestion, ", ".join(SOURCE[suggestion]))


def test_the_scan_finds_the_suggestions_users_are_given() -> None:
    """The regex keeps finding the known ones (a reworded message must not drop out of the check unseen)."""
    known = {("loss.shift_labels", "yes"), ("loss.shift_labels", "no"), ("packing.enabled", "false"),
             ("data.check_samples", "skip"), ("ddp.find_unused_parameters", "true"), ("vision_cache.enabled", "false"),
             ("linear_cross_entropy.enabled", "false"), ("activation_checkpointing.enabled", "true"),
             ("precision", "bf16"), ("oom.enabled", "false"), ("save.resume", "never"), ("loss.on_nonfinite", "skip")}
    pairs = {pair for suggestion in SOURCE for pair in suggestion}
    assert known <= pairs, sorted(known - pairs)
    assert suggestions("the message: save.resume: cannot resume from x") == []  # a field named, nothing suggested
    assert suggestions("with save.async, only the copy") == []
    assert suggestions("  - deepspeed.zero_stage: 3 + deepspeed.offload_param: cpu (why)") == [
        (("deepspeed.zero_stage", "3"), ("deepspeed.offload_param", "cpu"))]
    assert suggestions("use ddp.comm_hook: fp16/bf16") == [(("ddp.comm_hook", "fp16"),), (("ddp.comm_hook", "bf16"),)]


class _IgnoresLabels(nn.Module):
    """A loss that does not read the labels: the label probe cannot decide and asks for loss.shift_labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids).square().mean()


def runtime_messages() -> list[str]:
    """Messages whose suggested values are only known at run time."""
    from vlmfast.memory.advice import oom_advice, oom_outside_step_advice
    from vlmfast.memory.known_models import estimate_from_hf_config
    from vlmfast.models.conventions import LabelConventionError, probe_label_conventions

    spec = TrainSpec(engine="ddp")
    messages = [*oom_advice(spec), *oom_outside_step_advice("optimizer step", spec, 10**9),
                *oom_outside_step_advice("evaluation", spec)]
    est = estimate_from_hf_config("llava-1.5-7b", micro_batch_size=4, gpu_memory_gb=24)
    for gpu_gb in (8, 24, 40):
        messages += est.cheapest_fixes(gpu_gb)
    messages += est.reestimate(world_size=8, micro_batch_size=16).cheapest_fixes(80)
    ids = torch.arange(6).remainder(10).view(1, 6)
    with pytest.raises(LabelConventionError) as probe:
        probe_label_conventions(_IgnoresLabels(), {"input_ids": ids, "labels": ids})
    return [*messages, str(probe.value)]


def test_suggestions_in_messages_built_at_run_time_are_values_the_spec_takes() -> None:
    messages = runtime_messages()
    found = {suggestion: message for message in messages for suggestion in suggestions(message)}
    pairs = {pair for suggestion in found for pair in suggestion}
    assert {("loss.shift_labels", "yes"), ("precision", "bf16"), ("deepspeed.offload_param", "cpu"),
            ("linear_cross_entropy.enabled", "true")} <= pairs, messages
    for suggestion, message in sorted(found.items()):
        assert_valid(suggestion, repr(message))
