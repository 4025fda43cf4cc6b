"""What the recipe tests share: the recipes folder on the import path (``common``, ``launch`` and the recipes
themselves import as modules) and one frozen corpus of this repository's text for the whole session."""

import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    import launch

    return launch.snapshot_corpus(tmp_path_factory.mktemp("corpus"))
