"""The module-level guard of the CuTe DSL GPU test files: on a CUDA machine without an sm_90 GPU, nvidia-cutlass-dsl
or apache-tvm-ffi the whole file is skipped (on a machine without CUDA the ``gpu`` marker skips its tests anyway)."""

import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def cute_available() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        import cutlass  # noqa: F401
        import tvm_ffi  # noqa: F401
    except Exception:
        return False
    return True


def skip_module_without_cute() -> None:
    if torch.cuda.is_available() and not cute_available():
        pytest.skip("needs an sm_90 GPU with nvidia-cutlass-dsl and apache-tvm-ffi", allow_module_level=True)


@pytest.fixture(autouse=True)
def hang_watchdog():
    """A hung kernel (a barrier that never completes) must not eat the whole GPU session: dump the stacks and exit
    after FA4DIST_TEST_WATCHDOG_S seconds (120) of one test. Autouse in the modules that import it."""
    import faulthandler

    faulthandler.dump_traceback_later(int(os.environ.get("FA4DIST_TEST_WATCHDOG_S", "120")), exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
