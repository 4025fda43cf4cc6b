"""Which parts of a whole training step keep their bits when the cp size changes (cp_invariant attention on)?

    torchrun --nproc-per-node 1 bench/cp_invariance_model.py run      # writes $OUT/model-cp1.pt
                                        # (--invariant-grads 1: parameter gradients in int64 fixed point)
    torchrun --nproc-per-node 2 bench/cp_invariance_model.py run      # ... cp2
    torchrun --nproc-per-node 4 bench/cp_invariance_model.py run      # ... cp4
    python bench/cp_invariance_model.py compare                       # the table; $OUT/<date>-cp-invariance.json

One training step of the recipes' Llama-style model (``--model tiny``; fp32 on CPUs, bf16 on GPUs) on one packed
sample, every rank a cp rank (dp = 1), attention with ``cp_invariant=True`` and row-invariant matrix products
(``FA4Llama.set_row_invariant``).  Saved per cp size: the logits of every token (gathered in global order), the loss
(the cp ranks' shares summed by an all-reduce), and every parameter's gradient after the cp all-reduce.  ``compare``
reports, against cp = 1, whether each is the same bytes and, where not, the largest relative difference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

OUT = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["run", "compare"])
    p.add_argument("--model", default="tiny")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--docs", type=int, default=5)
    p.add_argument("--strategy", default="ring")
    p.add_argument("--row-invariant", type=int, default=1, help="1: row-invariant matrix products (default)")
    p.add_argument("--invariant-grads", type=int, default=0,
                   help="1: parameter gradients in int64 fixed point (FA4Llama.set_invariant_grads)")
    return p.parse_args(argv)


def _gather(t: torch.Tensor, world: int) -> list:
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    longest = int(max(sizes))
    padded = torch.cat([t, t.new_zeros(longest - t.shape[0], *t.shape[1:])])
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [p[: int(s)] for p, s in zip(parts, sizes)]


def run(args):
    from fa4dist.data.packing import IGNORE
    from fa4dist.data.sharding import shard_sample
    from fa4dist.data.packing import Sample, positions_from_cu_seqlens
    from fa4dist.models import FA4Llama, cp_cross_entropy, get_config

    cuda = torch.cuda.is_available()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    config = get_config(args.model)
    with torch.device(device):
        model = FA4Llama(config, dist.group.WORLD if world > 1 else None, strategy=args.strategy, cp_invariant=True)
    model.set_row_invariant(bool(args.row_invariant))
    model.to(dtype)
    if args.invariant_grads:
        model.set_invariant_grads(True)
    gen = torch.Generator().manual_seed(1)
    cuts = sorted(torch.randperm(args.tokens - 1, generator=gen)[: args.docs - 1] + 1)
    cu = torch.tensor([0] + [int(c) for c in cuts] + [args.tokens], dtype=torch.int32)
    tokens = torch.randint(0, config.vocab_size, (args.tokens,), generator=gen)
    labels = torch.roll(tokens, -1).clone()
    labels[cu[1:] - 1] = IGNORE  # no target across a document boundary
    sample = Sample(tokens, labels, positions_from_cu_seqlens(cu), cu)
    plan = model.make_plan(cu)
    local = shard_sample(sample, plan, model.cp_rank, device=device)
    logits = model(local.tokens, local.positions, plan)
    loss = cp_cross_entropy(logits, local.labels, dist.group.WORLD if world > 1 else None).loss
    loss.backward()
    if args.invariant_grads:
        model.invariant_grads.finish()  # summed over the ranks already
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if world > 1 and not args.invariant_grads:
            dist.all_reduce(g)
        grads[name] = g.cpu()
    loss_total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(loss_total)
    parts = _gather(logits.detach().float(), world)
    if rank == 0:
        full = plan.unshard([p.cpu() for p in parts], seq_dim=0) if world > 1 else parts[0].cpu()
        os.makedirs(OUT, exist_ok=True)
        torch.save(dict(cp=world, dtype=str(dtype), logits=full, loss=loss_total.cpu(), grads=grads,
                        row_invariant=bool(args.row_invariant), invariant_grads=bool(args.invariant_grads)),
                   os.path.join(OUT, f"model-cp{world}.pt"))
        print(f"cp={world}: saved logits {tuple(full.shape)}, loss {float(loss_total):.6f}, {len(grads)} grads",
              flush=True)
    dist.destroy_process_group()


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    same = torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    rel = float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
    return dict(same_bytes=same, max_rel_diff=0.0 if same else rel)


def compare(args):
    files = sorted(f for f in os.listdir(OUT) if f.startswith("model-cp") and f.endswith(".pt"))
    runs = {torch.load(os.path.join(OUT, f))["cp"]: torch.load(os.path.join(OUT, f)) for f in files}
    if 1 not in runs:
        raise SystemExit(f"no cp=1 run in {OUT}")
    base = runs[1]
    report = []
    for cp in sorted(runs):
        if cp == 1:
            continue
        r = runs[cp]
        row = dict(cp=cp, dtype=r["dtype"], row_invariant=r["row_invariant"],
                   invariant_grads=r.get("invariant_grads", False), logits=_compare(r["logits"], base["logits"]),
                   loss=_compare(r["loss"], base["loss"]))
        grads = {n: _compare(g, base["grads"][n]) for n, g in r["grads"].items()}
        row["grads_same"] = sum(g["same_bytes"] for g in grads.values())
        row["grads_total"] = len(grads)
        row["grads_worst"] = sorted(((g["max_rel_diff"], n) for n, g in grads.items()), reverse=True)[:5]
        report.append(row)
        print(f"cp={cp} vs cp=1 ({r['dtype']}): logits {'same bytes' if row['logits']['same_bytes'] else 'differ'}"
              f" (max rel {row['logits']['max_rel_diff']:.1e}); loss "
              f"{'same bytes' if row['loss']['same_bytes'] else 'differs'} ({row['loss']['max_rel_diff']:.1e}); "
              f"gradients: {row['grads_same']}/{row['grads_total']} parameters the same bytes, worst "
              + ", ".join(f"{n} {d:.1e}" for d, n in row["grads_worst"][:3]), flush=True)
    date = datetime.date.today().isoformat()
    with open(os.path.join(OUT, f"{date}-cp-invariance.json"), "w") as f:
        json.dump(dict(date=date, rows=report), f, indent=1)


if __name__ == "__main__":
    a = parse_args()
    run(a) if a.mode == "run" else compare(a)
