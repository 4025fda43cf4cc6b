"""A cp_sim JSON's "+xfer" column again at other link rates: how much of a ring's transfers its launch groups would
leave exposed if a step's keys (and, backward, the returned fp32 dK / dV) moved at G GB/s instead of cp_sim's
400.  The measured rates between two H200s (bench/p2p.py, bench/RESULTS.md): NCCL's send/recv ~225 GB/s, the
copy-engine peer copies (FA4DIST_CP_TRANSPORT=peer) ~345-380.  No GPU: it reads the JSON, using cp_sim's own
transfer model (:func:`cp_sim.exposed_transfer_ms`, :func:`cp_sim.exposed_backward_transfer_ms`).

    python bench/cp_sim_links.py bench/results/2026-12-06-s51/call3/cp_sim-sizes_cp8.json --gbps 400 360 225
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys


def _cp_sim():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)  # (cp_sim imports bench/timing.py)
    spec = importlib.util.spec_from_file_location("cp_sim", os.path.join(here, "cp_sim.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launch_groups(steps_per_launch: int, remote_steps: int) -> list[int]:
    """The sizes of the launch groups of `remote_steps` remote steps, `steps_per_launch` at a time (0: all)."""
    if steps_per_launch <= 0:
        return [remote_steps] if remote_steps else []
    return [min(steps_per_launch, remote_steps - at) for at in range(0, remote_steps, steps_per_launch)]


def remodel(rows: list[dict], rates: list[float]) -> list[dict]:
    """Per row: its efficiency of medians and, per rate, the efficiency with the modeled exposed transfers.  A
    backward row's keys are its forward rows' bytes per step (the rest of its bytes are the returned dK / dV)."""
    sim = _cp_sim()
    keys_bytes = {(r["seqlen"], r["cp"]): r["bytes_per_step"] for r in rows if r["direction"].startswith("fwd")}
    out = []
    for r in rows:
        if r["window"] != [-1, -1]:  # (a window's steps differ per member: the model's inputs are not in the JSON)
            continue
        sizes = launch_groups(r["steps_per_launch"], r["cp"] - 1)
        slowest, eff = r["max_rank_ms"], r["efficiency_of_medians"]
        modeled = {}
        for gbps in rates:
            comm_ms = r["bytes_per_step"] / (gbps * 1e9) * 1e3
            if r["direction"].startswith("fwd"):
                exposed = sim.exposed_transfer_ms(sizes, comm_ms, r["step_compute_ms"])
            else:
                keys = keys_bytes.get((r["seqlen"], r["cp"]))
                if keys is None:
                    continue
                keys_ms = keys / (gbps * 1e9) * 1e3
                exposed = sim.exposed_backward_transfer_ms(sizes, keys_ms, comm_ms - keys_ms, r["step_compute_ms"])
            modeled[gbps] = eff * slowest / (slowest + exposed)
        out.append(dict(direction=r["direction"], seqlen=r["seqlen"], cp=r["cp"], groups=sizes, efficiency=eff,
                        with_transfers=modeled))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="a cp_sim JSON (bench/results/...)")
    p.add_argument("--gbps", type=float, nargs="+", default=[400.0, 360.0, 225.0])
    args = p.parse_args(argv)
    with open(args.json) as f:
        rows = json.load(f)["rows"]
    table = remodel(rows, args.gbps)
    print(f"{'direction':<10} {'seqlen':>7} {'cp':>3} {'groups':<14} {'eff~':>6} "
          + " ".join(f"{f'+xfer@{g:g}':>11}" for g in args.gbps))
    for row in table:
        print(f"{row['direction']:<10} {row['seqlen']:>7} {row['cp']:>3} {str(row['groups']):<14} "
              f"{row['efficiency']:6.3f} " + " ".join(f"{row['with_transfers'].get(g, float('nan')):11.3f}"
                                                     for g in args.gbps))
    return table


if __name__ == "__main__":
    main()
