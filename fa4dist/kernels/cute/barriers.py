"""Named-barrier ids of the Hopper kernels (0 is __syncthreads; the hardware has 16).

One IntEnum per kernel, so two roles of one kernel can never pick the same id by accident; a barrier that exists
once per warpgroup takes ``FIRST + warpgroup``, with room left for every warpgroup.
"""

from enum import IntEnum


class FwdBarrier(IntEnum):
    EPILOGUE = 1  # every consumer warpgroup is past its last read of sQ (O is staged in the Q buffer)
    SCHED_WG0 = 2  # + consumer warpgroup (0..2): the warpgroups take turns issuing their wgmmas
    SANITIZE = 5  # the sanitizer warps of the producer warpgroup among themselves


class BwdBarrier(IntEnum):
    PDS = 1  # both MMA warpgroups: the dS tile is complete in smem
    DQ_FULL_WG0 = 2  # + MMA warpgroup (0..1): its dQ tile is in smem (MMA warpgroup -> dQ writer warp)
    DQ_EMPTY_WG0 = 4  # + MMA warpgroup (0..1): its dQ smem buffer is free again (dQ writer warp -> MMA warpgroup)
    SANITIZE = 6  # both MMA warpgroups: non-finite rows of a tile found and cleared
    DKV_EPILOGUE = 7  # both MMA warpgroups: the dK / dV staging tile is free, then written (TMA store)
