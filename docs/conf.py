"""Sphinx configuration: the guides (Markdown, read by MyST) and the API reference built from
the docstrings (autodoc, with sphinxcontrib-trio marking async functions and context managers
as trio's own documentation does). `nox -s docs` builds it with warnings as errors."""

from __future__ import annotations

import tskv

project = "tskv"
author = "the tskv developers"
release = version = tskv.__version__
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' "Args:" and "Raises:" sections
    "sphinxcontrib_trio",
]
root_doc = "index"
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "examples"]
myst_heading_anchors = 3  # the guides link to each other's sections by their slugs
default_role = "code"  # `name` in a docstring is code, as it is on GitHub
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"  # no types for what the docstring leaves out
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "furo"
html_title = f"tskv {version}"
nitpicky = False


def _readable_defaults(app, what, name, obj, options, signature, return_annotation):  # type: ignore[no-untyped-def]
    """A function default shows as its repr (`<built-in function monotonic>`); show its name."""
    if signature and "<built-in function monotonic>" in signature:
        signature = signature.replace("<built-in function monotonic>", "time.monotonic")
    return signature, return_annotation


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("autodoc-process-signature", _readable_defaults)
