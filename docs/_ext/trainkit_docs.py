"""Sphinx helpers for the trainkit docs.

- ``.. trainkit-config-keys:: trainkit.Config``: a table of every config key, its type and default read
  from the attrs records themselves, and its meaning from the directive's content (``key: text`` entries).
  A key without a meaning, or a meaning for a key that does not exist, is a build warning (an error under
  ``-W``), so the table can neither miss a key nor show a stale default.
- attrs classes whose fields default to a factory show ``val=ValConfig()`` in their signature instead of
  attrs' ``val=NOTHING``.
- A constant re-exported by a package (``trainkit.bookkeeping.RESERVED_NAMES``) shows the docstring written
  under its definition in the submodule, not the docstring of its type (``frozenset``, ``str``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import typing
from typing import Any

import attrs
from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

_ENTRY = re.compile(r"^([A-Za-z_][\w.]*)\s*:\s*(.*)$")


def _import(dotted: str) -> Any:
    module_name, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module_name), attr)


def _type_text(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return repr(tp).replace("typing.", "").replace("NoneType", "None")


def config_keys(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """Return ``(dotted key, type, default)`` for every leaf key of an attrs config record, in field order."""
    hints = typing.get_type_hints(cls)
    rows = []
    for field in attrs.fields(cls):
        tp = hints.get(field.name, Any)
        name = prefix + field.name
        if attrs.has(tp):
            rows.extend(config_keys(tp, name + "."))
            continue
        if field.default is attrs.NOTHING:
            default = "required"
        elif isinstance(field.default, attrs.Factory):
            default = f"``{_factory_text(field.default)}``"
        else:
            default = f"``{field.default!r}``"
        rows.append((name, f"``{_type_text(tp)}``", default))
    return rows


def _factory_text(factory: Any) -> str:
    """A Python expression that shows what an attrs factory default builds."""
    if attrs.has(factory.factory):
        return f"{factory.factory.__name__}()"
    if not factory.takes_self:
        try:
            text = repr(factory.factory())
            ast.parse(text, mode="eval")
            return text
        except Exception:  # noqa: BLE001 - fall back to an ellipsis for anything unusual
            pass
    return "..."


class ConfigKeysDirective(SphinxDirective):
    """``.. trainkit-config-keys:: dotted.path.ToConfig`` with ``key: meaning`` entries as content."""

    required_arguments = 1
    has_content = True
    option_spec = {"widths": directives.unchanged}

    def _meanings(self) -> dict[str, tuple[list[str], int]]:
        meanings: dict[str, tuple[list[str], int]] = {}
        current: str | None = None
        for offset, line in enumerate(self.content):
            lineno = self.content_offset + offset + 1
            if not line.strip():
                continue
            match = _ENTRY.match(line)
            if match and not line[0].isspace():
                current = match.group(1)
                if current in meanings:
                    logger.warning("config key %r is described twice", current, location=(self.env.docname, lineno))
                meanings[current] = ([match.group(2)], lineno)
            elif current is not None and line[0].isspace():
                meanings[current][0].append(line.strip())
            else:
                logger.warning(
                    "expected 'key: meaning' in trainkit-config-keys, got %r", line, location=(self.env.docname, lineno)
                )
        return meanings

    def run(self) -> list[nodes.Node]:
        cls = _import(self.arguments[0])
        rows = config_keys(cls)
        meanings = self._meanings()
        known = {key for key, _, _ in rows}
        for key, (_, lineno) in meanings.items():
            if key not in known:
                logger.warning(
                    "trainkit-config-keys describes %r, which %s does not have",
                    key,
                    self.arguments[0],
                    location=(self.env.docname, lineno),
                )
        lines = [
            ".. list-table::",
            "   :header-rows: 1",
            f"   :widths: {self.options.get('widths', '22 14 16 48')}",
            "   :class: config-keys",
            "",
            "   * - Key",
            "     - Type",
            "     - Default",
            "     - Meaning",
        ]
        for key, type_text, default in rows:
            if key not in meanings:
                logger.warning(
                    "config key %r of %s has no meaning in the trainkit-config-keys table; add a '%s: ...' entry",
                    key,
                    self.arguments[0],
                    key,
                    location=(self.env.docname, self.lineno),
                )
            text = " ".join(meanings.get(key, (["(undocumented)"], 0))[0])
            lines += [f"   * - ``{key}``", f"     - {type_text}", f"     - {default}", f"     - {text}"]
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source=self.env.docname), self.content_offset, container)
        return container.children


def _attrs_signature(
    app: Any, what: str, name: str, obj: Any, options: Any, signature: str | None, return_annotation: str | None
) -> tuple[str | None, str | None] | None:
    """Show factory defaults of attrs classes as the expression they build, not as ``NOTHING``."""
    if what != "class" or not signature or "NOTHING" not in signature or not attrs.has(obj):
        return None
    by_alias = {getattr(field, "alias", None) or field.name.lstrip("_"): field for field in attrs.fields(obj)}

    def replace(match: re.Match[str]) -> str:
        field = by_alias.get(match.group(1))
        if field is None or not isinstance(field.default, attrs.Factory):
            return match.group(0)
        return f"{match.group(1)}={_factory_text(field.default)}"

    return re.sub(r"(\w+)=NOTHING", replace, signature), return_annotation


def _reexported_constant_doc(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Give a re-exported constant the docstring under its definition instead of its type's docstring."""
    if what != "data" or type(obj).__doc__ is None:
        return
    type_doc = inspect.cleandoc(type(obj).__doc__).splitlines()
    if [line for line in lines if line.strip()] != [line for line in type_doc if line.strip()]:
        return
    package, _, attr = name.rpartition(".")
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith(package + ".") or getattr(module, attr, None) is not obj:
            continue
        try:
            doc = ModuleAnalyzer.for_module(module_name).find_attr_docs().get(("", attr))
        except Exception:  # noqa: BLE001 - a module without source: keep looking
            continue
        if doc:
            lines[:] = [line.rstrip("\n") for line in doc]
            return
    lines[:] = []


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("trainkit-config-keys", ConfigKeysDirective)
    app.connect("autodoc-process-signature", _attrs_signature)
    app.connect("autodoc-process-docstring", _reexported_constant_doc)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
