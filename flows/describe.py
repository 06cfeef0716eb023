"""A resolved config shown with its documentation: the docstring under each dataclass field.

The docstrings are read from the source with ``ast`` (Python keeps no runtime record of a string
under a field), so the text shown is the one written once in stages/config.py.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any

import yaml

__all__ = ["field_docs", "describe_config", "config_keys"]

_WIDTH = 100  # comment lines wrap here


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass, for the fields whose next statement is a string."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # the class statement
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            # RST literals (``x``) read as noise in a terminal; the names stand on their own.
            docs[node.target.id] = inspect.cleandoc(after.value.value).replace("``", "")
    return docs


def _scalar(value: Any) -> str:
    """A value the way YAML writes it inline (null, true, [a, b], 'quoted')."""
    if isinstance(value, tuple):
        value = list(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def _comment(text: str, indent: str) -> list[str]:
    """``text`` as comment lines wrapped at :data:`_WIDTH`: a line that goes on the sentence of the
    one before is joined to it first (so a source line break never leaves a one-word line); blank
    lines, list items and indented lines start lines of their own."""
    paras: list[str] = []
    for line in text.splitlines() or [""]:
        starts_own = not line.strip() or line.lstrip().startswith(("-", "*")) or line.startswith(" ")
        if paras and paras[-1].strip() and not starts_own:
            paras[-1] += " " + line.strip()
        else:
            paras.append(line)
    lines = []
    for para in paras:
        lines.extend(textwrap.wrap(para, _WIDTH - len(indent) - 2, break_on_hyphens=False, break_long_words=False)
                     or [""])
    return [f"{indent}# {line}".rstrip() for line in lines]


def _notes(cfg: Any) -> dict[str, str]:
    """Notes a section gives on its own fields as resolved (``describe_notes()``: e.g. keys not in
    effect), shown above the field."""
    notes = getattr(cfg, "describe_notes", None)
    return notes() if callable(notes) else {}


def describe_config(cfg: Any, indent: str = "") -> str:
    """``cfg`` as YAML that loads back to the same config, each key preceded by its documentation."""
    docs = field_docs(type(cfg))
    notes = _notes(cfg)
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in notes:
            out.extend(_comment(notes[f.name], indent))
        if f.name in docs:
            out.extend(_comment(docs[f.name], indent))
        if dataclasses.is_dataclass(value):
            cls_doc = inspect.getdoc(type(value))
            if f.name not in docs and cls_doc and not cls_doc.startswith(type(value).__name__ + "("):
                out.extend(_comment(cls_doc.splitlines()[0], indent))
            out.append(f"{indent}{f.name}:")
            out.append(describe_config(value, indent + "  "))
        else:
            out.append(f"{indent}{f.name}: {_scalar(value)}")
    return "\n".join(out)


def config_keys(cfg: Any, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, value, docstring on one line)`` of every leaf field: the keys that
    ``key=value`` overrides take."""
    docs = field_docs(type(cfg))
    rows: list[tuple[str, str, str]] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(config_keys(value, f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", _scalar(value), " ".join(docs.get(f.name, "").split())))
    return rows
