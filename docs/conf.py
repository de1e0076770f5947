"""Sphinx configuration for the trainkit documentation.

Build (warnings are errors, as in CI's ``tests/test_docs.py``)::

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # the trainkit package, even without an install
sys.path.insert(0, str(DOCS / "_ext"))

import trainkit  # noqa: E402

project = "trainkit"
author = "trainkit contributors"
copyright = "trainkit contributors"
release = trainkit.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.viewcode",
    "trainkit_docs",  # docs/_ext/trainkit_docs.py: the config key table, attrs signatures
]

exclude_patterns = ["_build"]
root_doc = "index"

# Docstrings are plain reST (:param:/:returns:/:raises:); types come from the annotations only.
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_member_order = "bysource"
python_use_unqualified_type_names = True

# Every cross-reference must resolve, so a renamed method or a typo in a docstring fails the build.
# Types from outside trainkit have no target here (no intersphinx: the build must work offline);
# builtins (int, ValueError, ...) never warn.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|attr|attrs|wandb|tqdm)(\..*)?"),
    (r"py:.*", r"(typing|collections\.abc|contextlib|types|pathlib|os|abc|datetime|socket|enum)\..*"),
    (r"py:.*", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Path|PathLike|MappingProxyType|TypeVar|ClassVar)"),
    (r"py:.*", r"(Module|Parameter|Tensor|device|Optimizer|DistributedDataParallel|Figure)"),  # Figure: matplotlib's
    (r"py:.*", r"~?(trainkit\.[\w.]+\.)?(T|R|C)"),  # TypeVars (Sphinx 7.0 writes type[C] as ~C)
]

html_theme = "alabaster"
html_theme_options = {
    "description": "A functional training engine for PyTorch",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_title = f"trainkit {release}"
html_show_sourcelink = False
