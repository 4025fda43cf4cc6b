"""PTX snapshots of the CuTe DSL kernels, to check that a refactor leaves the generated code byte-identical.

    python bench/cute_ptx_dev.py DIR            # CPU: compile the representative variants, write DIR/<variant>.ptx
    diff -r BEFORE AFTER                        # no output: behaviour unchanged

Each variant is compiled for sm_90a with fake tensors (no GPU needed). The kernel's symbol name (which spells the
Python module and class) is replaced by a fixed token, so moving code between modules does not count as a change.
The variants are the compile tests' subsets and their EXTRA lists (measurement knobs): every static option of the
forward and the backward at least once.
"""

from __future__ import annotations

import os
import re
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "kernels"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # (the compile tests' helpers, as tests/conftest.py adds them)


def normalize(ptx: str) -> str:
    names = sorted(set(re.findall(r"\.entry\s+(\w+)\(", ptx)), key=len, reverse=True)
    for i, name in enumerate(names):
        ptx = ptx.replace(name, f"KERNEL{i}")
    return ptx


def variants():
    """(file stem, compile thunk) for every representative variant."""
    import test_cute_bwd_compile as tb
    import test_cute_fwd_compile as tf

    from fa4dist.kernels.cute import forward as fwd
    from fa4dist.kernels.cute import host

    out = []
    for v in tf.SUBSET + tf.EXTRA:
        dt, d, causal, varlen, acc, extra = v
        cfg = fwd.make_config(dt, d, causal=causal, varlen=varlen, accumulate=acc, **extra)
        out.append(("fwd-" + tf._id(v), cfg))
    for v in tb.SUBSET + tb.EXTRA:
        for part, cfg in zip(("pre", "main", "post"), tb._configs(v)):
            out.append((f"bwd-{part}-" + tb._id(v), cfg))
    return [(name, (lambda c=cfg: host.compile_config(c, extra_options="--keep-ptx"))) for name, cfg in out]


def main():
    folder = os.path.abspath(sys.argv[1])
    os.makedirs(folder, exist_ok=True)
    only = sys.argv[2:]
    t0 = time.time()
    cwd = os.getcwd()
    os.chdir(folder)  # --keep-ptx drops files into the working directory
    try:
        for name, build in variants():
            if only and not any(o in name for o in only):
                continue
            ptx = normalize(build().artifacts.PTX)
            with open(os.path.join(folder, name + ".ptx"), "w") as f:
                f.write(ptx)
            print(f"{time.time() - t0:6.1f}s {name}", flush=True)
        for junk in os.listdir(folder):
            if not junk.endswith(".ptx") or junk.startswith("cutlass_"):
                os.remove(os.path.join(folder, junk))
    finally:
        os.chdir(cwd)


if __name__ == "__main__":
    main()
