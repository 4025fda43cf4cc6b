"""Another script of bench/ as a module, loaded by its path.

A bare ``import kernels`` finds whichever module of that name the process met first: Hugging Face's ``kernels``
package once transformers is imported (CI's test processes), not bench/kernels.py. Scripts that reuse a sibling's
functions take it from here:

    import sibling
    kbench = sibling.load("kernels")
"""

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name: str):
    """bench/<name>.py, imported once per process as ``fa4dist_bench_<name>``."""
    key = f"fa4dist_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(HERE, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[key]
            raise
    return sys.modules[key]
