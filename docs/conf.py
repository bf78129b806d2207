import os
import sys

# Document the packages of this source tree (a worktree's), not whichever copy is installed.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

project = "torchmb"
author = "the torchmb developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
# The integrations subclass classes of these optional extras; their reference is read without them
autodoc_mock_imports = ["lightning", "transformers"]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence"]
exclude_patterns = ["_build"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
html_theme = "alabaster"
suppress_warnings = ["myst.xref_missing"]
nitpicky = False


def setup(app):
    # Tutorial blocks fenced as python-gpu are shown as Python but not executed by tests/test_docs.py.
    from pygments.lexers import PythonLexer

    app.add_lexer("python-gpu", PythonLexer)
