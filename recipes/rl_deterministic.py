"""Deterministic GRPO-style RL fine-tuning of the fa4dist model on a verifiable toy task (string reversal).

    torchrun --nproc-per-node 2 recipes/rl_deterministic.py --cp 2 --steps 20

The task: the prompt is ``<BOS>abca=`` and the answer must be ``acba<EOS>``; the reward is 1 for an exact match
(up to and including EOS), else 0.  A few supervised warm-up steps (``--sft-steps``) teach the format so the
rewards are not all zero; then every RL step

1. syncs the policy's weights into a separate *rollout* model (no context parallelism, like an inference engine)
   on rank 0, which samples ``--group-size`` completions for each of ``--prompts`` prompts with a seeded generator
   and records each sampled token's log-probability;
2. scores them, and computes group-relative advantages ``(r - mean(group)) / (std(group) + eps)``;
3. broadcasts tokens, masks, advantages and rollout log-probs to every rank;
4. updates the policy with context parallelism in deterministic mode: all completions are packed as documents
   into one stream per dp replica, split over the cp ranks by the LPT plan, and the clipped policy-gradient loss
   ``-min(ratio * A, clip(ratio, 1 +- eps) * A)`` (ratio against the rollout log-probs) is averaged over all
   completion tokens of the batch; gradients are summed over all ranks in one fixed-order all-reduce.

The log reports, per step, the mean reward and the largest |rollout log-prob - training log-prob| of the same
tokens under the same weights (the two paths differ: batched sampling without CP vs. packed CP attention).  At the
end every rank hashes its weights (they must agree) and rank 0 prints ``weights_sha256=<hex>``: two runs with the
same seed print the same hash.  The SUMMARY line has the mean reward of the first and last 10 RL steps.

``--cp-invariant``: cp_invariant attention, row-invariant matrix products and parameter gradients in int64 fixed
point (:mod:`fa4dist.models.invariant_grads`, in place of the fp32 all-reduce): the whole training step, and so the
final hash, is the same at every cp size (``--cp 1`` and ``--cp 2`` print the same hash).

Of the options the recipes share, this one always runs deterministic (``--deterministic`` is implied) and refuses,
by name, those it has no use for: ``--seqlen`` (a completion's sequence is its prompt and answer, 2 x
``--task-len`` + 3 tokens), ``--batch-size`` (a step trains on ``--prompts`` x ``--group-size`` completions),
``--packing`` (the completions are always packed as documents), ``--data`` (the prompts are generated, no text is
read), ``--dtype`` (the policy and the rollout model compute in fp32) and ``--timing-warmup`` / ``--peak-tflops``
(no tokens/s or MFU is reported).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from fa4dist.data import BOS, EOS, IGNORE, ByteTokenizer, SingleRankPlan, shard_sample  # noqa: E402
from fa4dist.data.packing import Sample, positions_from_cu_seqlens  # noqa: E402
from fa4dist.models import FA4Llama, invariant_sum  # noqa: E402

TOK = ByteTokenizer()


# ---------------------------------------------------------------------------------------------------------------
# the task


class ReversalTask:
    """Reverse a string of ``length`` letters from ``alphabet``; exact match of answer + EOS."""

    def __init__(self, length: int = 3, alphabet: str = "abcd"):
        self.length, self.alphabet = length, alphabet
        self.prompt_len = 1 + length + 1  # BOS, letters, "="
        self.answer_len = length + 1  # reversed letters, EOS

    def sample_prompts(self, n: int, gen: torch.Generator) -> list[str]:
        idx = torch.randint(0, len(self.alphabet), (n, self.length), generator=gen)
        return ["".join(self.alphabet[i] for i in row) for row in idx.tolist()]

    def prompt_ids(self, s: str) -> list[int]:
        return [BOS] + TOK.encode(s + "=", bos=False, eos=False)

    def answer_ids(self, s: str) -> list[int]:
        return TOK.encode(s[::-1], bos=False, eos=False) + [EOS]

    def reward(self, s: str, completion: list[int]) -> float:
        target = self.answer_ids(s)
        return 1.0 if completion[: len(target)] == target else 0.0


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator of one step's prompts and samples: seeded with seed * 1_000_003 + step, wrapped to 64 bits
    (torch takes seeds in [-2**63, 2**64), a negative one as its 64-bit two's complement: the same generator)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**64)


def completion_mask(tokens: torch.Tensor) -> torch.Tensor:
    """(N, T) completions -> mask of the tokens up to and including the first EOS."""
    is_eos = tokens == EOS
    after = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()  # EOS seen strictly before this token
    return after == 0


# ---------------------------------------------------------------------------------------------------------------
# rollouts (no context parallelism)


@torch.no_grad()
def rollout(model: FA4Llama, prompts: torch.Tensor, max_new: int, gen: torch.Generator, temperature: float):
    """Samples ``max_new`` tokens for every row of ``prompts`` (N, P) -> (completions (N, max_new), their
    log-probs (N, max_new), fp32).  All rows have the same length, so each forward packs them as N documents."""
    device = next(model.parameters()).device
    seqs = prompts.to(device)
    n = seqs.shape[0]
    new_tokens, logps = [], []
    for _ in range(max_new):
        length = seqs.shape[1]
        cu = torch.arange(0, (n + 1) * length, length, dtype=torch.int32)
        logits = model(seqs.flatten(), positions_from_cu_seqlens(cu).to(device), SingleRankPlan(cu))
        last = logits.view(n, length, -1)[:, -1].float()
        logp = torch.log_softmax(last / temperature, dim=-1).cpu()
        nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
        new_tokens.append(nxt)
        logps.append(logp.gather(1, nxt[:, None]).squeeze(1))
        seqs = torch.cat([seqs, nxt[:, None].to(device)], dim=1)
    return torch.stack(new_tokens, 1), torch.stack(logps, 1)


@torch.no_grad()
def prefill_scores(model: FA4Llama, prompts: torch.Tensor, comps: torch.Tensor, temperature: float) -> torch.Tensor:
    """The completions' log-probs from one forward over the finished sequences, packed as documents (what an
    inference engine's scoring prefill computes): (N, A), fp32."""
    device = next(model.parameters()).device
    seqs = torch.cat([prompts, comps], dim=1)
    n, length = seqs.shape
    cu = torch.arange(0, (n + 1) * length, length, dtype=torch.int32)
    logits = model(seqs.flatten().to(device), positions_from_cu_seqlens(cu).to(device), SingleRankPlan(cu))
    logp = torch.log_softmax(logits.float() / temperature, dim=-1).view(n, length, -1).cpu()
    cols = torch.arange(comps.shape[1]) + prompts.shape[1] - 1  # position t predicts token t + 1
    return logp[:, cols].gather(2, comps[:, :, None]).squeeze(2)


# ---------------------------------------------------------------------------------------------------------------
# the update (context parallel, deterministic)


def pack(tokens: torch.Tensor, comp_mask: torch.Tensor, prompt_len: int, per_token: dict):
    """Rows (N, P + A) -> one packed sample with N documents; labels only on completion tokens.

    ``per_token`` maps names to (N, A) tensors aligned with the completions; they come back as flat (N*(P+A),)
    tensors aligned with the labels (zero where there is no label)."""
    n, length = tokens.shape
    labels = torch.full_like(tokens, IGNORE)
    # position t predicts token t + 1: completion token a sits at prompt_len + a and is predicted at + a - 1
    cols = torch.arange(comp_mask.shape[1]) + prompt_len - 1
    labels[:, cols] = torch.where(comp_mask, tokens[:, cols + 1], torch.full_like(comp_mask, IGNORE, dtype=torch.long))
    aligned = {}
    for name, t in per_token.items():
        full = torch.zeros(n, length, dtype=t.dtype)
        full[:, cols] = torch.where(comp_mask, t, torch.zeros_like(t))
        aligned[name] = full.flatten()
    cu = torch.arange(0, (n + 1) * length, length, dtype=torch.int32)
    sample = Sample(tokens.flatten(), labels.flatten(), positions_from_cu_seqlens(cu), cu)
    return sample, aligned


def policy_loss(model, sample, aligned, layout, total_tokens: float, clip_eps: float, device, args):
    """This rank's share of the clipped policy-gradient loss; returns (loss, its per-token terms (detached: loss is
    their sum over total_tokens), max |logp diff| of local tokens)."""
    plan = model.make_plan(sample.cu_seqlens, balancer=args.balancer)
    local = shard_sample(sample, plan, layout.cp_rank, device=device)
    adv = plan.shard(aligned["adv"], seq_dim=0, rank=layout.cp_rank).to(device)
    old = plan.shard(aligned["old_logp"], seq_dim=0, rank=layout.cp_rank).to(device)
    logits = model(local.tokens, local.positions, plan).float() / args.temperature
    mask = local.labels != IGNORE
    logp = torch.log_softmax(logits, dim=-1).gather(1, local.labels.clamp(min=0)[:, None]).squeeze(1)
    ratio = torch.exp(logp - old)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    terms = -(surrogate * mask)
    loss = terms.sum() / total_tokens
    diff = ((logp.detach() - old).abs() * mask).max() if mask.any() else torch.zeros((), device=device)
    return loss, terms.detach(), diff


def sft_loss(model, sample, layout, total_tokens: float, device, args):
    """This rank's share of the SFT loss; returns (loss, its per-token terms (detached: loss is their sum over
    total_tokens))."""
    plan = model.make_plan(sample.cu_seqlens, balancer=args.balancer)
    local = shard_sample(sample, plan, layout.cp_rank, device=device)
    logits = model(local.tokens, local.positions, plan).float()
    terms = F.cross_entropy(logits, local.labels, ignore_index=IGNORE, reduction="none")
    return terms.sum() / total_tokens, terms.detach()


def allreduce_grads(model):
    """Sum of the gradients over all ranks, one flat buffer, one collective (a fixed reduction order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.flatten() for p in params])
    if dist.get_world_size() > 1:
        dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def _mean(values):
    return sum(values) / len(values) if values else None


def broadcast(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        t = t.to(device).contiguous()
        if dist.get_world_size() > 1:
            dist.broadcast(t, src=0)
        out.append(t.cpu())
    return out


# the shared options this recipe has no use for, and why (refused by name when given: they used to be ignored)
UNUSED = {
    "seqlen": "a completion's sequence is its prompt and answer, 2 x --task-len + 3 tokens (set --task-len)",
    "batch_size": "a step trains on --prompts x --group-size completions (set those)",
    "packing": "the completions are always packed as documents, one per completion",
    "data": "the prompts are generated (string reversal over --alphabet); no text is read",
    "dtype": "the policy and the rollout model always compute in fp32",
    "timing_warmup": "this recipe reports no tokens/s or MFU",
    "peak_tflops": "this recipe reports no tokens/s or MFU",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=common.HelpFormatter)
    common.add_common_args(p, unused=UNUSED)
    g = p.add_argument_group("rl")
    g.add_argument("--sft-steps", type=common.non_negative_int, default=150,
                   help="supervised warm-up steps on the task")
    g.add_argument("--prompts", type=common.positive_int, default=8, help="prompts per RL step")
    g.add_argument("--group-size", type=common.positive_int, default=8,
                   help="completions per prompt (GRPO group; at least 2: advantages are within-group z-scores)")
    g.add_argument("--task-len", type=common.positive_int, default=3, help="letters in a prompt to reverse")
    g.add_argument("--alphabet", default="abcd", help="the letters prompts are drawn from")
    g.add_argument("--temperature", type=float, default=1.0, help="the rollout's sampling temperature")
    g.add_argument("--clip-eps", type=float, default=0.2,
                   help="the policy ratio's clip range (1 +- eps) in the surrogate loss")
    g.add_argument("--score-with-prefill", action="store_true",
                   help="the rollout's log-probs come from one forward over the finished completions (a scoring "
                        "prefill) instead of the sampling steps; the sampling-vs-prefill gap is logged too")
    g.set_defaults(steps=40, lr=1e-2, warmup=10, grad_clip=1.0)
    # (its steps: RL steps after --sft-steps; the LR schedule runs over both, and no checkpoint is written)
    [steps] = [a for a in p._actions if a.dest == "steps"]
    steps.help = "RL steps after the --sft-steps warm-up (the LR schedule spans both)"
    args, given = common.parse_given(p, argv)
    common.refuse_unused(p, given, UNUSED, "by rl_deterministic")
    common.check_common_args(p, args)
    if args.group_size < 2:
        p.error(f"--group-size must be at least 2 (GRPO's advantages are z-scores within a group), got "
                f"{args.group_size}")
    if not 0 < args.temperature < math.inf:
        p.error(f"--temperature must be positive and finite, got {args.temperature}")
    if not 0 <= args.clip_eps < math.inf:
        p.error(f"--clip-eps must be >= 0, got {args.clip_eps}")
    if not args.alphabet:
        p.error("--alphabet must hold at least one letter")
    wide = [ch for ch in args.alphabet if len(TOK.encode(ch, bos=False, eos=False)) != 1]
    if wide:  # the prompts' and answers' lengths count one token per letter
        p.error(f"--alphabet letters must each be one byte (one token of the byte tokenizer), got {wide!r}")
    return args


def main(argv=None):
    args = parse_args(argv)
    args.deterministic = True
    # refused before the process group and the models exist (every rank alike)
    dp = common.check_layout(common.launched_world(), args.cp)
    n = args.prompts * args.group_size
    if n % dp:
        raise SystemExit(f"prompts x group-size ({n}) must be a multiple of dp ({dp})")

    rank, world, device = common.init_distributed(args=args)
    common.set_determinism(args)  # torch.use_deterministic_algorithms(True)
    layout = common.make_layout(rank, world, args.cp, 1 if world // args.cp == 1 else world // args.cp, device)
    task = ReversalTask(args.task_len, args.alphabet)
    total_steps = args.sft_steps + args.steps
    args_sched = argparse.Namespace(**{**vars(args), "steps": total_steps})

    policy = common.build_model(args, layout.mesh["cp"], device, deterministic=True)
    if args.cp_invariant:
        # parameter gradients in int64 fixed point, summed over every rank: the same bits at every cp size
        policy.set_invariant_grads(True)
    optimizer = common.make_optimizer(policy, args)
    if rank == 0:
        torch.manual_seed(args.seed)
        with torch.device(device):
            # no CP: the "inference engine"
            rollout_model = FA4Llama(policy.config, None, backend=args.backend,
                                     cp_invariant=True if args.cp_invariant else None)
        rollout_model.set_row_invariant(args.cp_invariant)
        rollout_model.eval()
        print(f"rl: world={world} dp={layout.dp} cp={layout.cp} params={policy.num_parameters() / 1e6:.2f}M "
              f"task=reverse {args.task_len} letters of '{args.alphabet}' sft_steps={args.sft_steps} "
              f"rl_steps={args.steps} prompts={args.prompts}x{args.group_size}", flush=True)
    progress = common.Progress(total_steps, rank, args.metrics_out, args.log_every)
    per_dp = n // layout.dp
    rows = slice(layout.dp_rank * per_dp, (layout.dp_rank + 1) * per_dp)
    rewards_log, diffs_log, sampling_gaps = [], [], []

    for step in range(total_steps):
        common.set_lr(optimizer, step, args_sched)
        gen = step_generator(args.seed, step)
        prompts_s = task.sample_prompts(args.prompts, gen)
        prompt_ids = torch.tensor([task.prompt_ids(s) for s in prompts_s]).repeat_interleave(args.group_size, 0)
        sft = step < args.sft_steps
        if sft:  # teacher forcing on the right answers
            comps = torch.tensor([task.answer_ids(s) for s in prompts_s]).repeat_interleave(args.group_size, 0)
            old_logp = torch.zeros(comps.shape, dtype=torch.float32)
            adv = torch.zeros(n)
            reward = torch.zeros(n)
        else:
            if rank == 0:
                rollout_model.load_state_dict(policy.state_dict())  # weight sync
                comps, old_logp = rollout(rollout_model, prompt_ids, task.answer_len, gen, args.temperature)
                if args.score_with_prefill:  # the log-probs an inference engine's scoring prefill reports
                    sampled_logp = old_logp
                    old_logp = prefill_scores(rollout_model, prompt_ids, comps, args.temperature)
                    mask0 = completion_mask(comps)
                    sampling_gaps.append(float(((sampled_logp - old_logp).abs() * mask0).max()))
                reward = torch.tensor([task.reward(s, c) for s, c in
                                       zip([s for s in prompts_s for _ in range(args.group_size)], comps.tolist())])
                grouped = reward.view(args.prompts, args.group_size)
                adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
            else:
                comps = torch.zeros(n, task.answer_len, dtype=torch.long)
                old_logp = torch.zeros(n, task.answer_len, dtype=torch.float32)
                reward, adv = torch.zeros(n), torch.zeros(n)
            comps, old_logp, reward, adv = broadcast([comps, old_logp, reward, adv], device)
        mask = completion_mask(comps)
        tokens = torch.cat([prompt_ids, comps], dim=1)
        total_tokens = float(mask.sum())  # every rank sees the whole batch: no count all-reduce needed
        sample, aligned = pack(tokens[rows], mask[rows], task.prompt_len,
                               {"adv": adv[rows, None].expand_as(comps[rows]).float(), "old_logp": old_logp[rows]})
        optimizer.zero_grad(set_to_none=True)
        if sft:
            loss, terms = sft_loss(policy, sample, layout, total_tokens, device, args)
            diff = torch.zeros((), device=device)
        else:
            loss, terms, diff = policy_loss(policy, sample, aligned, layout, total_tokens, args.clip_eps, device,
                                            args)
        loss.backward()
        if args.cp_invariant:
            policy.invariant_grads.finish()
        else:
            allreduce_grads(policy)
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
        optimizer.step()
        if args.cp_invariant:  # the logged loss with the same bits at every cp size, as the weights have
            loss_all = invariant_sum(terms) / total_tokens
        else:
            loss_all = loss.detach().clone()
            dist.all_reduce(loss_all)
        diff = diff.detach().clone()
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        fields = {"phase": "sft" if sft else "grpo", "loss": float(loss_all)}
        if not sft:
            fields.update(reward=float(reward.mean()), max_logp_diff=float(diff))
            rewards_log.append(float(reward.mean()))
            diffs_log.append(float(diff))
        progress.update(step, **fields)
    progress.close()

    digest = common.weights_hash(policy)
    mine = torch.tensor(list(bytes.fromhex(digest)), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    hashes = [bytes(t.cpu().tolist()).hex() for t in gathered]
    if len(set(hashes)) != 1:
        raise SystemExit(f"ranks disagree on the weights: {hashes}")
    if rank == 0:
        print(f"weights_sha256={digest}", flush=True)
        print(common.summary_line(
            recipe="rl_deterministic", world=world, dp=layout.dp, cp=layout.cp, seed=args.seed,
            sft_steps=args.sft_steps, rl_steps=args.steps,
            reward_first=_mean(rewards_log[:10]), reward_last=_mean(rewards_log[-10:]),
            max_rollout_vs_train_logp_diff=max(diffs_log) if diffs_log else None,
            rollout_logp=("prefill" if args.score_with_prefill else "sampling"), cp_invariant=args.cp_invariant,
            max_sampling_vs_prefill_logp_diff=max(sampling_gaps) if sampling_gaps else None, weights_sha256=digest,
        ), flush=True)
    common.finish_distributed()


if __name__ == "__main__":
    common.run_main(main)
