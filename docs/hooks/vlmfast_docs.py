"""mkdocs hooks of the vlmfast site: the generated spec reference, file diffs, benchmark result tables.

Usage: listed under ``hooks:`` in mkdocs.yml; ``mkdocs build --strict`` runs them. Page directives (HTML comments,
so the Markdown still reads well on GitHub):

- ``<!-- diff: A B -->``: a unified diff of two files (paths from the repo root), e.g. the hand-written loop
  before and after adding hooks.
- ``<!-- results-tables: NAME -->``: every ``benchmarks/results/<device>/NAME`` (Markdown written by a benchmark),
  each under a ``### <device>`` heading, devices sorted; a note when none exists yet.
- ``<!-- spec-fields: NAME ... -->``: the spec reference rows of these fields or whole sections (dotted names),
  generated like the spec reference page.
- ``<!-- runnable -->`` on the line before a fenced ``python`` block: the block is executed by tests/test_docs.py
  (left in the HTML as a comment; nothing to do here).

The spec reference page (``spec-reference.md``) is not a file in docs/: :func:`spec_reference_markdown` renders it
from the Pydantic models at every build, so it cannot drift from the code.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic_core import PydanticUndefined, to_jsonable_python

ROOT = Path(__file__).resolve().parents[2]
SPEC_PAGE = "spec-reference.md"

DIFF = re.compile(r"^<!-- diff: (\S+) (\S+) -->$", re.MULTILINE)
RESULTS = re.compile(r"^<!-- results-tables: (\S+) -->$", re.MULTILINE)
SPHINX_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):(?=<code>)")
SPEC_FIELDS = re.compile(r"^<!-- spec-fields: ([^>]+?) -->$", re.MULTILINE)


# ------------------------------------------------------------------------------------------- mkdocs events


def on_files(files: Any, config: Any) -> Any:
    """Add the spec reference, generated from vlmfast.spec, as a page of the site."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, SPEC_PAGE, content=spec_reference_markdown()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Expand the diff, results-tables and spec-fields directives."""
    markdown = SPEC_FIELDS.sub(lambda m: spec_fields_table(m.group(1).split()), markdown)
    markdown = DIFF.sub(lambda m: diff_block(m.group(1), m.group(2)), markdown)
    return RESULTS.sub(lambda m: results_tables(m.group(1)), markdown)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Docstrings are written in reST style (:func:`name`, "Usage::"); show roles as plain code, "::" as ":"."""
    return SPHINX_ROLE.sub("", html).replace("::</p>", ":</p>")


# ------------------------------------------------------------------------------------------- directives


def diff_block(before: str, after: str) -> str:
    """A fenced ``diff`` block between two files of the repository, with a one-line count of changed lines."""
    old, new = (ROOT / before).read_text().splitlines(), (ROOT / after).read_text().splitlines()
    lines = list(difflib.unified_diff(old, new, before, after, lineterm="", n=2))
    added = sum(1 for line in lines if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in lines if line.startswith("-") and not line.startswith("---"))
    body = "\n".join(lines)
    return f"`diff {before} {after}`: {added} lines added, {removed} removed.\n\n```diff\n{body}\n```"


def results_tables(name: str) -> str:
    """The Markdown result files ``benchmarks/results/*/NAME``, one section per device."""
    found = sorted((ROOT / "benchmarks" / "results").glob(f"*/{name}"))
    if not found:
        return (f'!!! note "No results yet"\n    No `benchmarks/results/<device>/{name}` has been written yet; '
                "run the benchmark on that machine to add it.")
    parts = [f"### {path.parent.name}\n\n*Source: `{path.relative_to(ROOT)}`*\n\n{path.read_text().strip()}"
             for path in found]
    return "\n\n".join(parts)


# ------------------------------------------------------------------------------------------- spec reference


def spec_reference_markdown() -> str:
    """The spec reference page: one table per section of TrainSpec, every field with type, default, description."""
    from vlmfast.spec import TrainSpec, defaults_yaml

    lines = [
        "# Spec reference",
        "",
        "Every field of `TrainSpec`, generated from the Pydantic models in `vlmfast/spec.py` each time the site is "
        "built (`docs/hooks/vlmfast_docs.py`), so it cannot drift from the code. The same information is printed "
        "by `vlmfast spec --defaults` (a commented YAML template) and `vlmfast spec --schema` (JSON schema).",
        "",
        "A spec is YAML, JSON or keyword arguments: `TrainSpec.from_file(\"run.yaml\")`, `TrainSpec(**data)`, "
        "`vlmfast train run.yaml --set section.field=value`. Fields are nested by section; a dotted name below is "
        "the `--set` key. Unknown keys are errors that name the closest valid key; cross-field mistakes (e.g. "
        "`micro_batch_size` not dividing `batch_size`) fail before any model or data is touched.",
        "",
    ]
    lines += _section(TrainSpec, "", "Top level")
    lines += ["## Every default as YAML", "", "`vlmfast spec --defaults`:", "", "```yaml", defaults_yaml().rstrip(),
              "```", ""]
    return "\n".join(lines)


def section_anchor(path: str) -> str:
    """The HTML id of a section's heading, e.g. ``ddp.powersgd`` -> ``ddp-powersgd``; the top level is ``top-level``."""
    return path.replace(".", "-").replace("[]", "") or "top-level"


def _section(model: type[BaseModel], path: str, title: str | None = None) -> list[str]:
    level = "##" if path.count(".") == 0 else "###"
    heading = title or f"`{path}`"
    lines = [f"{level} {heading} {{ #{section_anchor(path)} }}", ""]
    doc = _summary(model)
    if path and doc:
        lines += [doc, ""]
    rows, children = _field_rows(model, path)
    lines += [TABLE_HEAD, "|---|---|---|---|", *rows, ""]
    for sub, child in children:
        lines += _section(sub, child)
    return lines


TABLE_HEAD = "| field | type | default | description |"


def _summary(model: type[BaseModel]) -> str:
    return (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


def _field_rows(model: type[BaseModel], path: str, link: str = "") -> tuple[list[str], list[tuple[Any, str]]]:
    """One table row per field of `model` (sections as links to their own table), and the sub-sections."""
    rows: list[str] = []
    children: list[tuple[type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        name = field.alias or name  # the YAML name (save.async; the attribute is async_)
        full = f"{path}.{name}" if path else name
        rows.append(_field_row(field, full, link, children))
    return rows, children


def _field_row(field: Any, full: str, link: str, children: list[tuple[Any, str]]) -> str:
    sub = _model_in(field.annotation)
    if sub is None:
        kind = _type_name(field.annotation) + _constraints(field.metadata)
        return f"| `{full}` | {_cell(kind)} | {format_default(field)} | {_cell(field.description or '')} |"
    is_list = _is_list(field.annotation)
    child = f"{full}[]" if is_list else full
    children.append((sub, child))
    kind = "list of" if is_list else "section"
    default = "`[]`" if is_list else "see below" if not link else "see its table"
    target = f"[{kind} `{child}`]({link}#{section_anchor(child)})"
    return f"| `{full}` | {target} | {default} | {_cell(field.description or _summary(sub))} |"


def spec_fields_table(names: list[str]) -> str:
    """The spec reference rows of some fields or whole sections (dotted names), for a strategy page."""
    from vlmfast.spec import TrainSpec

    rows: list[str] = []
    for name in names:
        model: type[BaseModel] = TrainSpec
        *parents, leaf = name.split(".")
        for part in parents:
            model = _model_in(model.model_fields[part].annotation)
        by_yaml_name = {f.alias or n: f for n, f in model.model_fields.items()}
        if leaf not in by_yaml_name:
            raise KeyError(f"spec-fields: no field {name!r} in TrainSpec")
        field = by_yaml_name[leaf]
        sub = _model_in(field.annotation)
        if sub is not None and not _is_list(field.annotation):
            rows += _field_rows(sub, name, link=SPEC_PAGE)[0]
        else:
            rows.append(_field_row(field, name, SPEC_PAGE, []))
    return "\n".join([TABLE_HEAD, "|---|---|---|---|", *rows])


def format_default(field: Any) -> str:
    """A field's default as YAML in backticks (``required`` when there is none)."""
    default = field.get_default(call_default_factory=True)
    if default is PydanticUndefined:
        return "required"
    return f"`{yaml_value(to_jsonable_python(default))}`"


def yaml_value(value: Any) -> str:
    """A value as one line of flow-style YAML, the way ``vlmfast spec --defaults`` writes it."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return item if isinstance(item, type) and issubclass(item, BaseModel) else None
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return ", ".join(f"`{yaml_value(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or `null`" if type(None) in args else "")
    if origin is list:
        item = _type_name(args[0])
        return f"list of ({item})" if typing.get_origin(args[0]) is typing.Literal else f"list of {item}"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin is dict:
        return "mapping"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(metadata: list[Any]) -> str:
    signs = {Gt: (">", "gt"), Ge: (">=", "ge"), Lt: ("<", "lt"), Le: ("<=", "le")}
    parts = []
    for item in metadata:
        for kind, (sign, attr) in signs.items():
            if isinstance(item, kind):
                parts.append(f"{sign} {getattr(item, attr)}")
        if isinstance(item, MinLen):
            parts.append(f"at least {item.min_length} item(s)")
        if isinstance(item, MaxLen):
            parts.append(f"at most {item.max_length} item(s)")
    return f", {', '.join(parts)}" if parts else ""
