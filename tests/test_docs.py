"""The documentation site: it builds with no warnings, its runnable code blocks run, the spec reference is complete.

Usage: ``python -m pytest tests/test_docs.py -q`` (builds the site once into a temporary folder, ~5 s; each runnable
block runs in a fresh namespace with a temporary working directory).

A code block is runnable when the line before its opening fence is ``<!-- runnable -->`` (docs/index.md explains the
convention); such blocks must run on CPU in a few seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
# Pages every runnable snippet of which the quick start and the three ways in rely on.
PAGES_WITH_RUNNABLE_BLOCKS = ("quickstart.md", "ways-in.md", "oom-guide.md", "speed-guide.md")
SNIPPET = "--8<--"  # a block whose content is included from a file at build time
STRATEGY_PAGES = ("accumulation.md", "precision.md", "optimizer.md", "activation_checkpointing.md", "oom.md",
                  "memory.md", "attention.md", "packing.md", "grouping.md", "compile.md", "data.md", "profiling.md",
                  "checkpoints.md", "distributed.md", "vision_cache.md")
STRATEGY_SECTIONS = ("What it does", "When it helps", "When it hurts", "Spec fields", "Standalone hook",
                     "Measured effect")


@dataclass(frozen=True)
class Block:
    """A fenced code block of a docs page."""

    page: str
    line: int
    language: str
    code: str
    runnable: bool

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """Every fenced block of a Markdown page, with whether the line before its fence is the runnable marker."""
    text = page.read_text()
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(page.name, line, match.group(1), match.group(2), before == MARKER))
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in sorted(DOCS.glob("*.md")) for block in code_blocks(page)]


RUNNABLE = [block for block in all_blocks() if block.runnable]


def load_hooks():
    """docs/hooks/vlmfast_docs.py, the module mkdocs loads (imported by path: docs/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vlmfast_docs", DOCS / "hooks" / "vlmfast_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------- runnable blocks


def test_runnable_markers_precede_python_blocks() -> None:
    for page in sorted(DOCS.glob("*.md")):
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines[:-1], start=1):
            if line.strip() == MARKER:
                assert lines[number].startswith("```python"), f"{page.name}:{number}: {MARKER} must precede ```python"
    for name in PAGES_WITH_RUNNABLE_BLOCKS:
        assert any(block.page == name for block in RUNNABLE), f"{name} has no runnable block"


def test_every_python_block_parses() -> None:
    """Blocks that are not run (GPU-only, fragments) must still be valid Python."""
    for block in all_blocks():
        if block.language == "python" and not block.code.startswith(SNIPPET):
            compile(block.code, block.id, "exec")


def test_every_yaml_block_is_a_valid_spec() -> None:
    """A YAML block in the docs is a spec (or part of one): it must validate, so no page shows a stale field."""
    import yaml

    from vlmfast.spec import TrainSpec

    blocks = [block for block in all_blocks() if block.language == "yaml" and not block.code.startswith(SNIPPET)]
    assert len(blocks) > 10
    for block in blocks:
        try:
            TrainSpec.model_validate(yaml.safe_load(block.code))
        except Exception as exc:
            raise AssertionError(f"{block.id}: {exc}") from exc


def test_strategy_pages_have_the_sections_users_look_for() -> None:
    for name in STRATEGY_PAGES:
        headings = re.findall(r"^## (.+)$", (DOCS / name).read_text(), re.MULTILINE)
        missing = [section for section in STRATEGY_SECTIONS if section not in headings]
        assert not missing, f"{name} lacks {missing}"


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.id for block in RUNNABLE])
def test_runnable_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        exec(compile(block.code, block.id, "exec"), {"__name__": "__main__"})
    finally:
        reset_global_state()


def test_misspelt_key_error_is_the_one_the_quick_start_shows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """quickstart.md's ``text`` block and README.md's block of ``vlmfast spec --check run.yaml`` on
    ``learning_rate`` are the real output, every line of it (and ways-in.md's "unknown keys name the closest valid
    one")."""
    from vlmfast.cli.main import main as vlmfast

    monkeypatch.chdir(tmp_path)
    Path("run.yaml").write_text("optimizer:\n  learning_rate: 1.0e-3\n")
    assert vlmfast(["spec", "--check", "run.yaml"]) == 2
    out = capsys.readouterr()
    output = out.out + out.err
    assert "did you mean 'lr'" in output, output
    for page in (DOCS / "quickstart.md", ROOT / "README.md"):
        (shown,) = [block for block in code_blocks(page) if "did you mean" in block.code]
        lines = [line for line in shown.code.splitlines() if not line.startswith("$ ")]
        assert lines == output.splitlines(), f"{page.name}:{shown.line}: {lines} is not the whole output\n{output}"


def test_the_quick_start_links_only_files_a_checkout_has() -> None:
    """A newcomer reads quickstart.md in the checkout or on the forge, where the pages the site build generates
    (spec-reference.md) do not exist: each of its relative links names a file that does."""
    text = (DOCS / "quickstart.md").read_text()
    links = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in target]
    assert links and not [link for link in links if link and not (DOCS / link).exists()]


def reset_global_state() -> None:
    """What a snippet may leave behind for the next one: Accelerate's singleton state, a process group."""
    import torch

    if "accelerate" in sys.modules:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------- the site


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Build the site once (``mkdocs build --strict``, the documented command) into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    assert proc.returncode == 0, log
    return out, log


def test_site_builds_strict_without_warnings(site: tuple[Path, str]) -> None:
    out, log = site
    problems = [line for line in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert not problems, "\n".join(problems)
    for page in ("index.html", "quickstart/index.html", "ways-in/index.html", "spec-reference/index.html",
                 "api/hooks/index.html", "examples/index.html", "speed-guide/index.html", "oom-guide/index.html"):
        assert (out / page).is_file(), page
    remote = [f"{html.relative_to(out)}: {m}" for html in out.rglob("*.html")
              for m in re.findall(r'(?:src=|rel="stylesheet" href=)"(https?://[^"]+)"', html.read_text())]
    assert not remote, f"the site loads remote resources (it must work offline): {remote[:5]}"


def test_api_reference_renders_the_public_hooks(site: tuple[Path, str]) -> None:
    import vlmfast.hooks

    html = (site[0] / "api" / "hooks" / "index.html").read_text()
    missing = [name for name in vlmfast.hooks.__all__ if f'id="vlmfast.hooks.{name}"' not in html]
    assert not missing, f"not in the API reference: {missing}"


def test_examples_page_shows_the_before_after_diff(site: tuple[Path, str]) -> None:
    html = (site[0] / "examples" / "index.html").read_text()
    assert "--- examples/hand_written_loop_before.py" in html and 'class="gi"' in html  # a rendered diff
    assert "tiny_llava" in html and "check_backends_and_documents" in html  # the scripts are included


def test_results_tables_include_every_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``<!-- results-tables: NAME -->`` pulls benchmarks/results/<device>/NAME for every device, sorted."""
    hooks = load_hooks()
    monkeypatch.setattr(hooks, "ROOT", tmp_path)
    assert "No results yet" in hooks.on_page_markdown("<!-- results-tables: compare.md -->", None, None, None)
    for device in ("h100", "cpu"):
        folder = tmp_path / "benchmarks" / "results" / device
        folder.mkdir(parents=True)
        (folder / "compare.md").write_text(f"| device |\n|---|\n| {device} |\n")
    out = hooks.on_page_markdown("<!-- results-tables: compare.md -->", None, None, None)
    assert out.index("### cpu") < out.index("### h100") and "| h100 |" in out


# ----------------------------------------------------------------------------------------------- spec reference


def schema_fields(schema: dict, node: dict, path: str = "") -> list[tuple[str, dict, bool]]:
    """(dotted path, property schema, is_section) for every property, every section, recursively."""
    out = []
    for name, prop in node.get("properties", {}).items():
        full = f"{path}.{name}" if path else name
        ref = prop.get("$ref") or prop.get("items", {}).get("$ref")
        if ref:
            sub = schema["$defs"][ref.rsplit("/", 1)[-1]]
            out.append((full, prop, True))
            out += schema_fields(schema, sub, f"{full}[]" if "items" in prop else full)
        else:
            out.append((full, prop, False))
    return out


def test_spec_reference_lists_every_field_with_default_and_description(site: tuple[Path, str]) -> None:
    from vlmfast.spec import TrainSpec

    hooks = load_hooks()
    page = hooks.spec_reference_markdown()
    rows = {line.split("|")[1].strip().strip("`"): line for line in page.splitlines() if line.startswith("| `")}
    schema = TrainSpec.model_json_schema()
    fields = schema_fields(schema, schema)
    assert len(fields) > 150  # every section, nested ones included
    for path, prop, is_section in fields:
        assert path in rows, f"spec reference lacks {path}"
        row = rows[path]
        if is_section:
            assert f"(#{hooks.section_anchor(path if 'items' not in prop else path + '[]')})" in row, row
            continue
        assert hooks._cell(prop["description"]) in row, f"{path}: description missing"
        if "default" in prop:
            assert f"`{hooks.yaml_value(prop['default'])}`" in row, f"{path}: default missing: {row}"
        else:
            assert "required" in row or "`[]`" in row, row
    html = (site[0] / "spec-reference" / "index.html").read_text()
    for path, _, _ in fields:
        assert f"<code>{path}</code>" in html, f"{path} not in the built page"


def test_no_example_prints_the_report_fit_already_printed() -> None:
    """fit() prints the run report when it ends: an example that prints `result.report.to_text()` after it shows
    the report twice (issue 29)."""
    twice = [f"{block.id}" for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))] for block in code_blocks(page)
             if block.language == "python" and ".fit()" in block.code and "report.to_text()" in block.code]
    assert not twice, f"these print the report fit() already printed: {twice}"


def test_every_mlflow_ui_hint_sets_the_file_store_variable() -> None:
    """MLflow 3 reads a local folder store only with MLFLOW_ALLOW_FILE_STORE=true: a printed `mlflow ui` must say so
    (vlmfast sets it for its own process only)."""
    files = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "vlmfast").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.*"))]
    hints = [(path.relative_to(ROOT), text[max(0, m.start() - 40):m.end()]) for path in files if path.is_file()
             for text in [path.read_text(errors="replace")] for m in re.finditer(r"mlflow ui\b", text)]
    assert hints, "the `mlflow ui` hint is gone: tell users how to read the folder store"
    bare = [hint for hint in hints if not hint[1].endswith("MLFLOW_ALLOW_FILE_STORE=true mlflow ui")]
    assert not bare, f"`mlflow ui` without MLFLOW_ALLOW_FILE_STORE=true before it: {bare}"
