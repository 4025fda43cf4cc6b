"""Context parallelism on every GPU of one host, one process per GPU over NCCL (run by test_cp_multigpu.py):

    torchrun --nproc-per-node <gpus> tests/cp/multigpu_check.py

For ring, Ulysses and hybrid (where the GPU count allows), causal one-sequence and packed-document inputs with GQA,
with and without a sliding window, bf16: every rank's local out/dq/dk/dv against single-GPU attention of the whole
sequence (the same backend) at bf16 tolerance, and a second deterministic run compared byte for byte.  Prints one
line per case and exits non-zero on any failure.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

TOL = 2e-2  # relative, bf16 inputs against the same backend's single-GPU result


def _cases(world: int):
    strategies = [("ring", None), ("ulysses", None)]
    if world >= 4 and world % 2 == 0:
        strategies.append(("hybrid", 2))
    no_window = (-1, -1)
    for strategy, u in strategies:
        for docs, window in ((None, no_window), (7, no_window), (None, (1499, 0)), (7, (299, 0))):
            yield strategy, u, docs, window


def _run(module, plan, tensors, packed):
    sd = 0 if packed else 1
    leaves = [module.shard(t, plan, seq_dim=sd).detach().requires_grad_() for t in tensors[:3]]
    out = module(*leaves, plan=plan)
    out.backward(module.shard(tensors[3], plan, seq_dim=sd))
    return [out.detach()] + [t.grad for t in leaves]


def main() -> int:
    import fa4dist
    from fa4dist.modules import FA4ContextParallelAttention

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(minutes=5)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
        total, heads, kv_heads, d = 8192 * world, 16, 4, 128
    else:  # a smoke run of the script itself on CPUs (gloo, reference backend, small)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        total, heads, kv_heads, d = 192 * world, 4, 2, 16
    failures = 0
    for strategy, u, docs, window in _cases(world):
        gen = torch.Generator(device=device).manual_seed(1)
        packed = docs is not None
        lead = (total,) if packed else (1, total)
        tensors = [torch.randn(*lead, h, d, device=device, dtype=torch.bfloat16, generator=gen)
                   for h in (heads, kv_heads, kv_heads, heads)]
        module = FA4ContextParallelAttention(dist.group.WORLD, strategy=strategy, ulysses_degree=u, causal=True,
                                             window=window, deterministic=True)
        if packed:
            cuts = sorted(torch.randperm(total - 1, generator=torch.Generator().manual_seed(docs))[:docs - 1] + 1)
            cu = [0] + [int(c) for c in cuts] + [total]
            plan = module.make_plan(cu)
        else:
            plan = module.make_plan(total)
        got = _run(module, plan, tensors, packed)
        again = _run(module, plan, tensors, packed)
        same = all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
                   for a, b in zip(got, again))
        leaves = [t.detach().clone().requires_grad_() for t in tensors[:3]]
        cut = plan.cu_seqlens_tensor(device) if packed else None
        ref = fa4dist.attention(*leaves, causal=True, window=window, cu_seqlens_q=cut, cu_seqlens_k=cut,
                                deterministic=True)
        ref.backward(tensors[3])
        refs = [ref.detach()] + [t.grad for t in leaves]
        errors = []
        for g, r in zip(got, refs):
            r = module.shard(r, plan, seq_dim=0 if packed else 1).float()
            errors.append(float((g.float() - r).norm() / r.norm().clamp_min(1e-30)))
        ok = all(e < TOL for e in errors) and same
        flag = torch.tensor([0 if ok else 1], device=device)
        dist.all_reduce(flag)
        failures += int(flag.item() > 0)
        if rank == 0 or not ok:
            name = (f"{strategy}{'' if u is None else f'(u={u})'} {'packed' if packed else 'dense'}"
                    + (f" w{window[0] + 1}" if window[0] >= 0 else ""))
            print(f"rank {rank} {name:<28} rel. errors out/dq/dk/dv "
                  + " ".join(f"{e:.1e}" for e in errors)
                  + f"  deterministic={'bytes equal' if same else 'DIFFERENT'}  {'ok' if ok else 'FAILED'}",
                  flush=True)
    failures += _invariant_cases(rank, world, device, total, heads, kv_heads, d)
    dist.destroy_process_group()
    if rank == 0:
        print("PASS" if not failures else f"FAIL: {failures} case(s)", flush=True)
    return 1 if failures else 0


def _invariant_cases(rank, world, device, total, heads, kv_heads, d) -> int:
    """cp_invariant=True: every rank's local out/dq/dk/dv bytes equal the single-GPU cp_invariant result's rows."""
    import fa4dist
    from fa4dist.modules import FA4ContextParallelAttention

    failures = 0
    dtype = torch.bfloat16
    for strategy, docs in (("ring", None), ("ulysses", None), ("ring", 5)):
        gen = torch.Generator(device=device).manual_seed(2)
        packed = docs is not None
        lead = (total,) if packed else (1, total)
        tensors = [torch.randn(*lead, h, d, device=device, dtype=dtype, generator=gen)
                   for h in (heads, kv_heads, kv_heads, heads)]
        module = FA4ContextParallelAttention(dist.group.WORLD, strategy=strategy, causal=True, cp_invariant=True)
        cu = [0] + sorted(int(c) for c in torch.randperm(total - 1, generator=torch.Generator().manual_seed(docs or 1))
                          [:(docs or 1) - 1] + 1) + [total] if packed else None
        plan = module.make_plan(cu if packed else total)
        got = _run(module, plan, tensors, packed)
        leaves = [t.detach().clone().requires_grad_() for t in tensors[:3]]
        cut = plan.cu_seqlens_tensor(device) if packed else None
        ref = fa4dist.attention(*leaves, causal=True, cu_seqlens_q=cut, cu_seqlens_k=cut, cp_invariant=True)
        ref.backward(tensors[3])
        refs = [module.shard(r.detach(), plan, seq_dim=0 if packed else 1) for r in [ref] + [t.grad for t in leaves]]
        same = [torch.equal(g.contiguous().view(torch.uint8), r.contiguous().view(torch.uint8))
                for g, r in zip(got, refs)]
        flag = torch.tensor([0 if all(same) else 1], device=device)
        dist.all_reduce(flag)
        failures += int(flag.item() > 0)
        if rank == 0 or not all(same):
            name = f"cp_invariant {strategy} {'packed' if packed else 'dense'}"
            print(f"rank {rank} {name:<30} bytes equal to one GPU out/dq/dk/dv: {same}  "
                  f"{'ok' if all(same) else 'FAILED'}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
