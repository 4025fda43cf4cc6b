"""Imports a script of bench/ as a module, for the CPU tests of what those scripts promise."""

import importlib.util
import os


def load(name: str):
    """bench/<name>.py as a fresh module."""
    path = os.path.join(os.path.dirname(__file__), "..", "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
