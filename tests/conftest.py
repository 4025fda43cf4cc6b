import atexit
import os
import shutil
import tempfile

import pytest
import torch

# CuTe DSL writes --keep-ptx files into one dump folder per process (the working directory at its first compile,
# cached): the repository root for most runs, shared by pytest-xdist workers, whose same-named kernel files then
# overwrite each other's between write and read-back. A folder of this process's own, set before cutlass loads
# (always: workers inherit the controller's environment, so an inherited value would be shared again).
os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(
    prefix=f"fa4dist-cute-dump-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-")
atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
