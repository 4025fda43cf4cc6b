"""What ptxas said about a compiled kernel (the compile tests capture its `remarks{ptx}` output): spills within a
budget, and no serialized wgmma."""

import re

# ptxas's advisory C7512: too few registers to keep the async wgmma operands live, so it brackets every wgmma with
# warpgroup syncs (the fifteenth session's backward knob try_waits hit it at hdim 64: 9 -> 64 WARPGROUP
# instructions per step, 10-13% slower on the H200)
SERIALIZED = "wgmma.mma_async instructions are serialized"


def assert_ptxas_clean(text: str, spill_budget: int = 0) -> None:
    spills = re.findall(r"(\d+) bytes spill stores", text)
    assert spills and all(int(s) <= spill_budget for s in spills), "ptxas spills registers:\n" + text[-2000:]
    assert SERIALIZED not in text, "ptxas serializes wgmma:\n" + text[-2000:]
