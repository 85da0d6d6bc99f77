"""Sphinx configuration: MyST markdown pages plus autodoc API reference.

Every ``>>>`` example in docs/*.md is executed by ``nox -s docs`` (pytest
--doctest-glob). Leave a blank line between an example's expected output and
the closing code fence, otherwise doctest reads the fence as expected output.
"""

project = "JAX quantization toolkit"
author = "the project's developers"
copyright = "the project's developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Google-style docstrings only.
napoleon_google_docstring = True
napoleon_numpy_docstring = False

autodoc_typehints = "description"
autodoc_member_order = "bysource"

html_theme = "alabaster"
