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


@pytest.fixture
def launched_without_a_rendezvous(monkeypatch):
    """The environment of a rank torchrun launched (RANK, WORLD_SIZE: call it with the world size), without the
    rendezvous address: a recipe's main() that reaches the process group fails there at once (a ValueError from
    init_process_group), so a SystemExit from main() is a refusal made before any process group existed."""
    def launch(world: int):
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.delenv("MASTER_ADDR", raising=False)
        monkeypatch.delenv("MASTER_PORT", raising=False)

    return launch
