"""What the recipes share: arguments, process groups, data, the context-parallel loss step, logging, and a plain
single-process reference loop (the tests compare the distributed recipes against it).

Loss semantics (every recipe and the reference): a step trains on ``--batch-size`` packed sequences; a sequence's
loss is the mean cross entropy over its label tokens; the step's loss is the mean over its sequences.  A sequence
is split over the cp ranks of one data-parallel replica (each rank's share is its local summed loss divided by the
sequence's label-token count, so the shares add up to the sequence's loss), and the dp replicas split the sequences.
Gradients are therefore *summed* over cp and *averaged* over dp.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import hashlib
import json
import math
import os
import resource
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from fa4dist.context_parallel.ulysses import HeadSplit
from fa4dist.data import PackedTokenStream, collect_documents, make_sample_plan, shard_sample
from fa4dist.demo import error_line, exit_process, free_port
from fa4dist.kernels.problem import check_seed
from fa4dist.kernels.registry import check_backend
from fa4dist.models import FA4Llama, cp_cross_entropy, get_config

def run_main(main) -> None:
    """A recipe's ``__main__``: runs ``main()`` and ends the process through ``exit_process``, also when main refuses
    its options with SystemExit after the process group is up (a resume whose schedule differs, ...) or fails with
    any other exception (printed with its traceback, exit code 1, as the interpreter would). The interpreter's
    teardown could otherwise abort a rank on a joinable gloo thread ("terminate called without an active
    exception", SIGABRT, about one failing run in three on 2 CPU ranks) after the message, and torchrun then
    reported the SIGABRT as the root cause. The message and exit code are SystemExit's own."""
    try:
        main()
    except SystemExit as stop:
        code = stop.code
        if code is not None and not isinstance(code, int):
            error_line(str(code))  # (one write: the ranks' lines do not run together)
            code = 1
        exit_process(code or 0)
    except Exception:
        traceback.print_exc()
        exit_process(1)
    exit_process()


H200_PEAK_BF16 = 989.4e12  # dense bf16 FLOP/s of an H100/H200 SXM


# ---------------------------------------------------------------------------------------------------------------
# arguments


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The recipes' ``--help``: the module docstring as written, and each option's default where it has one (not
    None or False, and not already named in its help)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if self._shows_default(action) and "default" not in text:
            text += " (default: %(default)s)"
        return text

    def _format_action(self, action):
        # argparse expands (and so reaches _get_help_string) only a non-empty help: an option without one would
        # print no default
        if not action.help and self._shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    @staticmethod
    def _shows_default(action) -> bool:
        default = action.default  # (by identity: 0 is a default to show, False a store_true's absence)
        return bool(action.option_strings) and default is not None and default is not False \
            and default != argparse.SUPPRESS


def require(module: str, extra: str, what: str) -> None:
    """Exits naming the install command when ``module`` (an optional dependency: the package's ``extra``) is not
    installed, before any process group or model exists (every rank alike)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise SystemExit(f"{what} needs {module}, which is not installed: pip install -e \".[{extra}]\" (from the "
                         "repository root)")


def _int_at_least(minimum: int, wanted: str, name: str):
    """An argparse type: an int of at least ``minimum``, refused by name ("must be <wanted>") otherwise."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
        return value

    parse.__name__ = name  # argparse names the type in "invalid <name> value"
    return parse


positive_int = _int_at_least(1, "a positive integer", "positive_int")  # a count
non_negative_int = _int_at_least(0, ">= 0", "non_negative_int")
sequence_length = _int_at_least(2, "at least 2 tokens", "sequence_length")  # one input and its next-token label


def add_common_args(p: argparse.ArgumentParser, unused: Optional[dict] = None,
                    models=()) -> argparse.ArgumentParser:
    """The options every recipe shares.  ``unused`` maps the destinations of those a recipe does not use to why
    (their help says so; :func:`refuse_unused` refuses them when given); ``models``: the recipe's own --model names
    beside fa4dist's presets (its help lists them)."""
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="tiny", help="size preset: tiny, small (~100M), base (~380M), 1b"
                   + "".join(f", {name}" for name in models))
    g.add_argument("--layers", type=positive_int, default=None, help="override the preset's layer count")
    g.add_argument("--seqlen", type=sequence_length, default=256,
                   help="tokens per packed sequence (the context length)")
    g.add_argument("--batch-size", type=positive_int, default=2, help="packed sequences per step, over all dp replicas")
    g.add_argument("--packing", choices=["documents", "stream"], default="documents",
                   help="documents: causal within each document (cu_seqlens); stream: one causal sequence")
    g.add_argument("--data", nargs="+", default=None, help="files/directories of text (default: this repository)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--cp", type=positive_int, default=1, help="context-parallel size (dp = world size / cp)")
    g.add_argument("--strategy", choices=["auto", "ring", "ulysses", "hybrid"], default="auto",
                   help="context-parallel strategy (hybrid: with --ulysses-degree; auto: the largest Ulysses degree "
                        "the heads allow, ring over the rest)")
    g.add_argument("--ulysses-degree", type=positive_int, default=None,
                   help="Ulysses degree of the hybrid strategy (it divides --cp; ring over cp / degree)")
    g.add_argument("--balancer", choices=["lpt", "zigzag", "contiguous"], default="lpt",
                   help="sharding plan balancer")
    g.add_argument("--backend", default="auto", help="attention backend (fa4dist.kernels): auto, sdpa, cute, ...")
    g.add_argument("--deterministic", action="store_true", help="deterministic attention and torch algorithms")
    g.add_argument("--cp-invariant", action="store_true", default=env_cp_invariant(p),
                   help="attention, gradients and weights whose bits do not depend on the cp size "
                        "(fa4dist.kernels.invariant); FA4DIST_CP_INVARIANT=1 turns the same mode on")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=positive_int, default=10,
                   help="training steps: the length of the LR schedule (stored in checkpoints)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    g.add_argument("--warmup", type=non_negative_int, default=2, help="linear warmup steps (then cosine to 10%%)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    g.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data")
    g.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="compute dtype (auto: bf16 on GPU, fp32 on CPU); master weights stay fp32")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in the backward instead of keeping them")
    g = p.add_argument_group("logging")
    g.add_argument("--log-every", type=positive_int, default=1)
    g.add_argument("--metrics-out", default=None,
                   help="write one JSON line per step (rank 0); a new run starts the file afresh, a resumed one "
                        "keeps the lines of the steps before its checkpoint and continues them")
    g.add_argument("--timing-warmup", type=non_negative_int, default=1, help="steps left out of tokens/s and MFU")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense FLOP/s per device for MFU in TFLOP/s (default: 989.4 on CUDA, none on CPU)")
    for action in p._actions:
        if unused and action.dest in unused:
            action.help = f"not used by this recipe (refused): {unused[action.dest]}".replace("%", "%%")
    return p


def env_cp_invariant(p: argparse.ArgumentParser) -> bool:
    """--cp-invariant's default: FA4DIST_CP_INVARIANT, read as the kernels read it (fa4dist.kernels.invariant), so
    that the variable turns on the recipe's whole mode (invariant gradients, the weights hash), not the attention
    alone; a value it does not take is a usage error naming it."""
    from fa4dist.kernels import invariant

    try:
        return invariant.enabled(None)
    except ValueError as err:
        p.error(str(err))


def parse_given(p: argparse.ArgumentParser, argv=None) -> tuple[argparse.Namespace, set]:
    """``p.parse_args(argv)``, and the destinations of the options the command line gives (whatever their values,
    defaults included): a second parse into a namespace whose every attribute is a marker, which argparse then
    leaves in place for the options not given."""
    args = p.parse_args(argv)
    marker = object()
    probe = p.parse_args(argv, argparse.Namespace(**{dest: marker for dest in vars(args)}))
    return args, {dest for dest, value in vars(probe).items() if value is not marker}


def option_name(dest: str) -> str:
    """``seqlen`` -> ``--seqlen``, ``batch_size`` -> ``--batch-size`` (the recipes' options are spelled so)."""
    return "--" + dest.replace("_", "-")


def refuse_unused(p: argparse.ArgumentParser, given: set, unused: dict, where: str) -> None:
    """Refuses, by name, the first option of ``unused`` (destination -> why) that the command line gives: an
    option a recipe would silently ignore (``where``: "by rl_deterministic", "with --checkpoint", ...)."""
    for dest, why in unused.items():
        if dest in given:
            p.error(f"{option_name(dest)} is not used {where}: {why}")


def lr_at(step: int, args) -> float:
    """Linear warmup to ``lr``, then cosine to 10% of it at the last step (a pure function of the step)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(1, args.steps - args.warmup)
    progress = min(1.0, (step - args.warmup) / span)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer, step: int, args) -> float:
    """Puts the schedule's learning rate of ``step`` (:func:`lr_at`) into every group of ``optimizer``; returns it."""
    lr = lr_at(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def add_checkpoint_args(p: argparse.ArgumentParser, resume_help: str) -> None:
    g = p.add_argument_group("checkpoints")
    g.add_argument("--ckpt-dir", default=None,
                   help="where --save-every and --stop-at save checkpoints and --resume finds them (refused without "
                        "one of those: it would be ignored)")
    g.add_argument("--save-every", type=non_negative_int, default=0,
                   help="save every N steps (0: never; at most --steps)")
    g.add_argument("--resume", default=None, help=resume_help)
    g.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step, saving a checkpoint there (as a preemption would); a later --resume "
                        "with the same --steps continues exactly as if the run had not stopped")


def check_common_args(p: argparse.ArgumentParser, args, models=()) -> None:
    """The common options that only make sense together, refused before any process group or model exists
    (``models``: the recipe's own --model names beside fa4dist's presets)."""
    if args.model not in models:
        try:
            get_config(args.model)
        except ValueError as err:
            p.error(f"--model: {err}" + (f"; this recipe also takes {', '.join(models)}" if models else ""))
    u = args.ulysses_degree
    if u is not None and args.cp % u:
        p.error(f"--ulysses-degree {u} must divide --cp {args.cp}")
    if args.strategy == "hybrid" and args.cp > 1 and u is None:
        p.error("--strategy hybrid needs --ulysses-degree (the Ulysses group size; the ring takes the rest of --cp)")
    if args.strategy == "ring" and u not in (None, 1):
        p.error(f"--strategy ring runs no Ulysses group: --ulysses-degree {u} contradicts it")
    if args.strategy == "ulysses" and u not in (None, args.cp):
        p.error(f"--strategy ulysses spans the whole cp group: --ulysses-degree must be --cp ({args.cp}), got {u}")
    if args.model not in models and getattr(args, "checkpoint", None) is None:  # (hf_sft checks its own shapes)
        config = model_config(args)
        problem = ulysses_heads_problem(args, config.n_heads, config.n_kv_heads, f"--model {args.model}")
        if problem:
            p.error(problem)
    try:  # (past torch's range: an OverflowError in manual_seed once the group was up)
        check_seed("--seed", args.seed)
    except ValueError as err:
        p.error(str(err))
    for dest in ("lr", "weight_decay"):  # AdamW refuses some (without naming the option), trains to NaN on inf
        if not 0 <= getattr(args, dest) < math.inf:
            p.error(f"{option_name(dest)} must be finite and >= 0, got {getattr(args, dest)}")
    try:  # (a misspelt or unavailable one failed in the first attention call, the model built and sharded)
        check_backend(args.backend, local_device())
    except (TypeError, ValueError) as err:
        p.error(f"--backend: {err}")
    if args.peak_tflops is not None and not 0 < args.peak_tflops < math.inf:  # a negative MFU, silently
        p.error(f"--peak-tflops must be finite and > 0, got {args.peak_tflops}")
    if not args.grad_clip >= 0:  # a negative max norm makes clip_grad_norm_ flip the gradients' sign
        p.error(f"--grad-clip must be >= 0 (0: no clipping), got {args.grad_clip}")
    missing = [d for d in args.data or () if not os.path.exists(d)]
    if missing:  # (failed once the process group and the model existed)
        p.error(f"--data: these paths do not exist: {missing}")
    if args.metrics_out and not os.path.isdir(os.path.dirname(os.path.abspath(args.metrics_out))):
        p.error(f"--metrics-out {args.metrics_out!r}: its directory does not exist")
    if args.metrics_out and os.path.isdir(args.metrics_out):  # rank 0 failed to open it once the run was set up
        p.error(f"--metrics-out {args.metrics_out!r} is a directory; give a file to write the JSON lines to")
    steps, warmup = getattr(args, "steps", None), getattr(args, "warmup", None)
    if steps is not None and warmup is not None and warmup > steps:  # (taken: a run may mean it, but rarely)
        warnings.warn(f"--warmup {warmup} is longer than --steps {steps}: the learning rate stops at "
                      f"{steps / warmup:.0%} of --lr, rising (it reaches --lr after {warmup} steps)", stacklevel=2)


def ulysses_heads_problem(args, heads_q: int, heads_kv: int, model: str) -> Optional[str]:
    """Why the Ulysses degree --strategy runs (--cp for ulysses, else a given --ulysses-degree; auto without one
    picks a degree the heads allow) cannot split ``model``'s query and key/value heads over its ranks, or None.
    Checked before the process group: it failed in the first attention call, the sharded model built."""
    degree = args.cp if args.strategy == "ulysses" else args.ulysses_degree
    if args.cp == 1 or degree in (None, 1):
        return None
    try:
        HeadSplit.check(heads_q, heads_kv, degree, args.cp)
    except ValueError as err:
        return (f"--strategy {args.strategy} runs a Ulysses degree of {degree} over {model}'s {heads_q} query heads "
                f"/ {heads_kv} key/value heads: {err}")
    return None


def check_checkpoint_args(p: argparse.ArgumentParser, args) -> None:
    """Options that save a checkpoint need somewhere to save it; a --ckpt-dir that nothing saves to or resumes from,
    and a --save-every that no step of the run reaches, would be ignored: refused by name."""
    if (args.stop_at is not None or args.save_every) and not args.ckpt_dir:
        p.error("--stop-at and --save-every save checkpoints: give --ckpt-dir")
    if args.ckpt_dir and not (args.save_every or args.stop_at is not None or args.resume):
        p.error(f"--ckpt-dir {args.ckpt_dir}: no checkpoint would be saved there or resumed from it; add "
                f"--save-every N and/or --stop-at N (or --resume)")
    if args.ckpt_dir:  # a file on the path failed in mkdir at the first save, the steps before it lost
        existing = Path(os.path.abspath(args.ckpt_dir))
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            p.error(f"--ckpt-dir {args.ckpt_dir}: {str(existing)!r} is not a directory")
    if args.save_every > args.steps:
        p.error(f"--save-every {args.save_every} is past --steps {args.steps}: no step would save a checkpoint")
    if args.stop_at is not None and not 0 < args.stop_at <= args.steps:  # before any process group exists
        p.error(f"--stop-at must be in [1, --steps={args.steps}], got {args.stop_at}")


SCHEDULE_FIELDS = ("steps", "warmup", "lr")


def schedule_state(args) -> dict:
    """What decides the LR at every step: stored with every checkpoint, checked on resume."""
    return {f: getattr(args, f) for f in SCHEDULE_FIELDS}


def check_resumed_schedule(saved: dict, args) -> None:
    """Refuses a resume whose LR schedule differs from the checkpoint's (its losses would not continue the run)."""
    now = schedule_state(args)
    diffs = [f"--{f} {saved[f]!r} in the checkpoint, {now[f]!r} now" for f in SCHEDULE_FIELDS if saved[f] != now[f]]
    if diffs:
        raise SystemExit(
            "resume: the LR schedule differs from the checkpoint's (" + "; ".join(diffs) + "), so the run would not "
            "continue the one that was stopped.  Pass the same values (--stop-at stops a run early without changing "
            "its schedule)."
        )


# what else decides the run a checkpoint continues: the model's shape, the data each step reads (seed, windows, corpus)
# and the optimizer's settings.  Written beside each checkpoint (RUN_FILE), checked on resume.
RUN_FIELDS = ("model", "layers", "seqlen", "batch_size", "packing", "data", "seed", "weight_decay", "grad_clip",
              "dtype", "cp_invariant")
RUN_FILE = "fa4dist_run.json"


def run_settings(args) -> dict:
    """The RUN_FIELDS of ``args`` as JSON values (--data as absolute paths: the same corpus from any directory), and
    the digest of the tokens the run trains on (:func:`build_stream` sets it; checked there on resume)."""
    out = {f: getattr(args, f, None) for f in RUN_FIELDS}
    if out["data"] is not None:
        out["data"] = [os.path.abspath(d) for d in out["data"]]
    out["data_digest"] = getattr(args, "data_digest", None)
    return out


def save_run_settings(checkpoint: Path, args, step: Optional[int] = None) -> None:
    """Writes :func:`run_settings`, the LR schedule (:func:`schedule_state`) and ``step`` (the steps the checkpoint
    has trained) into the checkpoint directory ``checkpoint`` (call it on one rank): what a resume checks before
    any process group or model exists."""
    checkpoint = Path(checkpoint)
    checkpoint.mkdir(parents=True, exist_ok=True)
    record = {**run_settings(args), "schedule": schedule_state(args), "step": step}
    (checkpoint / RUN_FILE).write_text(json.dumps(record, sort_keys=True))


def check_resumed_run(checkpoint: Path, args) -> Optional[int]:
    """Refuses a resume whose model, data or optimizer settings differ from those the checkpoint was saved with
    (another --seed, --batch-size, --seqlen, --packing or --data reads other windows; another --model or --layers
    failed deep inside the checkpoint loader), naming them; then one whose LR schedule differs
    (:func:`check_resumed_schedule`), a checkpoint at the end of --steps and a --stop-at it has passed
    (:func:`last_step`).  Reads only the record :func:`save_run_settings` wrote, so the recipes call it before the
    process group and the model exist.  Returns the checkpoint's step (None where the record has none).  A
    checkpoint saved without the record (an older one) is not checked."""
    path = Path(checkpoint) / RUN_FILE
    if not path.is_file():
        return None
    saved, now = json.loads(path.read_text()), run_settings(args)
    diffs = [f"{option_name(f)} {saved[f]!r} in the checkpoint, {now[f]!r} now" for f in RUN_FIELDS
             if f in saved and saved[f] != now[f]]
    if diffs:
        raise SystemExit(
            f"resume from {checkpoint}: the run's settings differ from the checkpoint's (" + "; ".join(diffs) + "), "
            "so the run would not continue the one that was stopped.  Pass the same values.")
    if saved.get("schedule") is not None:
        check_resumed_schedule(saved["schedule"], args)
    step = saved.get("step")
    if step is not None:
        last_step(args, step)
    return step


def last_step(args, start: int = 0) -> int:
    """One past the last step this invocation runs (``start``: the step a resumed checkpoint is at)."""
    if start >= args.steps:  # a finished run: it would train nothing and print a SUMMARY as if it had
        raise SystemExit(f"--resume: the checkpoint is at step {start}, the end of --steps {args.steps}: the run "
                         f"is finished, nothing is left to train (a longer run is another LR schedule: start it "
                         f"afresh)")
    if args.stop_at is None:
        return args.steps
    if not 0 < args.stop_at <= args.steps:
        raise SystemExit(f"--stop-at must be in [1, --steps={args.steps}], got {args.stop_at}")
    if args.stop_at <= start:  # the run would train nothing and save nothing
        raise SystemExit(f"--stop-at {args.stop_at}: the resumed checkpoint is at step {start} already; stop later "
                         f"(up to --steps {args.steps})")
    return args.stop_at


def saves_checkpoint(args, done: int, stop: int) -> bool:
    """Whether the step that brings the run to ``done`` steps ends with a checkpoint: every --save-every steps, and
    where --stop-at stops the run (also at --steps: its help promises a checkpoint there)."""
    if not args.ckpt_dir:
        return False
    return bool(args.save_every and done % args.save_every == 0) or (args.stop_at is not None and done == stop)


def model_config(args):
    return get_config(args.model, n_layers=args.layers)


# ---------------------------------------------------------------------------------------------------------------
# processes


def local_device() -> torch.device:
    """The device this rank computes on: its LOCAL_RANK's GPU where there are GPUs, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(timeout_s: float = 300.0,
                     args: Optional[argparse.Namespace] = None) -> tuple[int, int, torch.device]:
    """Joins the job torchrun started (or makes a world of one); returns (rank, world size, device).  ``args``: the
    recipe's parsed options, checked to be the same on every rank (:func:`check_ranks_agree`)."""
    if "RANK" not in os.environ:  # plain `python recipe.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if args is not None:
        check_ranks_agree(args)
    return dist.get_rank(), dist.get_world_size(), device


def check_ranks_agree(args: argparse.Namespace) -> None:
    """Every rank must run with the same options: ranks started with different ones (another --steps, --seed,
    --batch-size, --lr, ... on one node) would wait for each other's collectives until the timeout, or train a
    silent mix (FSDP shards of differently seeded models, other data per replica).  One all-gather of the options
    before anything else; where they differ, every rank raises the same error naming the options and the ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = {k: repr(v) for k, v in sorted(vars(args).items())}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    diffs = []
    for dest in sorted(set().union(*everyone)):
        by_value: dict = {}
        for r, options in enumerate(everyone):
            by_value.setdefault(options.get(dest, "(not given)"), []).append(r)
        if len(by_value) > 1:
            diffs.append(f"{option_name(dest)} " + ", ".join(f"{v} on ranks {rs}" for v, rs in by_value.items()))
    if diffs:
        raise SystemExit("the ranks were started with different options (every rank must run the same command): "
                         + "; ".join(diffs))


def finish_distributed() -> None:
    """Leaves the job: every rank meets at a barrier, then destroys the process group. Without the barrier a rank
    that is done tears down its gloo pairs while another still prints its summary, and gloo can abort that
    process at exit ("terminate called without an active exception", seen once in CI, 2026-12-01)."""
    dist.barrier()
    dist.destroy_process_group()


@dataclass
class Layout:
    """Where this rank sits: dp x cp, cp innermost (consecutive ranks share a sequence)."""

    rank: int
    world: int
    dp: int
    cp: int
    dp_rank: int
    cp_rank: int
    mesh: object  # DeviceMesh ("dp", "cp")
    cp_group: object
    dp_group: object
    batch_size: int  # packed sequences per step, all dp replicas together

    @property
    def sequences_per_rank(self) -> int:
        return self.batch_size // self.dp


def launched_world() -> int:
    """The world size the job is launched with, known before any process group exists: torchrun's WORLD_SIZE, or
    1 for a plain ``python recipe.py`` (:func:`init_distributed` makes a world of one then)."""
    return int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1


def check_layout(world: int, cp: int, batch_size: Optional[int] = None) -> int:
    """Refuses a --cp that does not divide the world size, or a --batch-size dp does not divide (None: not
    checked); returns dp.  The recipes call it with :func:`launched_world` before the process group exists (every
    rank alike), and :func:`make_layout` with the group's size."""
    if world % cp:
        # (a plain `python recipe.py --cp 2` is a world of one: say where the ranks come from)
        launcher = " (a plain python run is one process: start the ranks with torchrun --nproc-per-node N)" \
            if world == 1 else ""
        raise SystemExit(f"--cp {cp} must divide the world size {world}{launcher}")
    dp = world // cp
    if batch_size is not None and batch_size % dp:
        raise SystemExit(f"--batch-size {batch_size} must be a multiple of dp = {dp}")
    return dp


def make_layout(rank: int, world: int, cp: int, batch_size: int, device: torch.device) -> Layout:
    from torch.distributed.device_mesh import init_device_mesh

    dp = check_layout(world, cp, batch_size)
    mesh = init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    return Layout(rank, world, dp, cp, rank // cp, rank % cp, mesh, mesh.get_group("cp"), mesh.get_group("dp"),
                  batch_size)


def compute_dtype(args, device) -> torch.dtype:
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]


def set_determinism(args):
    torch.manual_seed(args.seed)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def build_model(args, cp_group, device, *, deterministic: Optional[bool] = None) -> FA4Llama:
    """The model, identically initialized on every rank (seeded), on ``device``, fp32 master weights."""
    gen_seed = args.seed
    torch.manual_seed(gen_seed)
    with torch.device(device):
        model = FA4Llama(model_config(args), cp_group if args.cp > 1 else None, strategy=args.strategy,
                         deterministic=deterministic if deterministic is not None else (args.deterministic or None),
                         backend=args.backend, cp_invariant=True if args.cp_invariant else None,
                         ulysses_degree=args.ulysses_degree)
    if args.activation_checkpointing:
        model.set_activation_checkpointing(True)
    model.set_row_invariant(args.cp_invariant)  # a token's logits then do not depend on the shard either
    return model


def cp_invariant_scope(invariant: str, rest: Optional[str] = None) -> str:
    """The line a recipe prints with --cp-invariant: what has the same bits at every cp size, and what does not."""
    if rest is None:
        return f"cp_invariant: {invariant} have the same bits at every cp size: so do the weights after each step"
    return (f"cp_invariant: {invariant} have the same bits at every cp size; {rest} do not, so the weights after a "
            f"step do not (recipes/fsdp2_train.py, deepspeed_train.py and rl_deterministic.py make the whole step "
            f"invariant)")


def install_invariant_grads(model, zero_weight_grads: bool = False):
    """``model.set_invariant_grads(True)`` (every rank's sum), checking that it covers every parameter: one left to
    the wrapper's float reduction would break the step's invariance and its scale (the loop then skips the cp
    factor FSDP's average needs). ``zero_weight_grads``: for DeepSpeed (FixedPointGrads)."""
    grads = model.set_invariant_grads(True, zero_weight_grads=zero_weight_grads)
    covered = {id(s.param) for s in grads.sites}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise SystemExit(f"--cp-invariant: no int64 gradient for parameters {missing}")
    return grads


def weights_hash(model) -> str:
    """sha256 over the model's whole weights (DTensor shards gathered: every rank must call it), by name."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def build_stream(args, tokenizer=None, resumed: Optional[Path] = None) -> PackedTokenStream:
    """The packed windows of ``--data``, tokenized by ``tokenizer`` (None: fa4dist.data's byte tokens).  Sets
    ``args.data_digest`` (sha256 of the stream's tokens and documents, which the checkpoints record) and, for a run
    ``resumed`` from a checkpoint directory, refuses text other than the one it was trained on: the record holds
    the --data paths, whose files (this repository's, by default) may have changed since, and a resume on other
    text reads other windows silently, not the stopped run's."""
    try:
        documents = collect_documents(args.data)
    except (OSError, ValueError) as err:  # a --data without text files: the same on every rank
        raise SystemExit(f"--data: {err}") from None
    stream = PackedTokenStream(documents, args.seqlen, packing=args.packing, seed=args.seed, tokenizer=tokenizer)
    digest = hashlib.sha256(stream.tokens.numpy().tobytes())
    digest.update(stream.doc_ids.numpy().tobytes())
    args.data_digest = digest.hexdigest()
    record = Path(resumed) / RUN_FILE if resumed is not None else None
    if record is not None and record.is_file():
        saved = json.loads(record.read_text()).get("data_digest")
        if saved is not None and saved != args.data_digest:
            raise SystemExit(f"--resume: the training text differs from the text the checkpoint {resumed} was trained "
                             f"on (token digest {saved[:12]}... then, {args.data_digest[:12]}... now: the files of "
                             f"{'--data' if args.data else 'this repository (the default data)'} changed), so the run "
                             "would not continue the one that was stopped.  Restore that text.")
    return stream


# ---------------------------------------------------------------------------------------------------------------
# one step's forward/backward (any wrapper: FSDP2 module, DeepSpeed engine, plain module)


def forward_backward(model, samples, layout: Layout, args, device, *, backward=None, before_last=None,
                     loss_scale: float = 1.0):
    """Runs this rank's sequences of one step; returns (summed sequence losses of this dp replica, label tokens).

    ``backward(loss, n)`` does the backward of one sequence's share (default ``(loss / n).backward()``, n the
    sequences per rank); ``before_last()`` is called before the last micro-batch (to turn gradient sync back on).
    ``loss_scale`` multiplies what goes into the backward (not the reported loss): a wrapper that averages
    gradients over dp x cp ranks needs ``cp`` to turn the cp average into the sum."""
    backward = backward or (lambda loss, n: (loss / n).backward())
    n = len(samples)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    raw = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    invariant = bool(getattr(args, "cp_invariant", False))
    for i, sample in enumerate(samples):
        plan = raw.make_plan(sample.cu_seqlens, balancer=args.balancer)
        local = shard_sample(sample, plan, layout.cp_rank, device=device)
        if i == n - 1 and before_last is not None:
            before_last()
        logits = model(local.tokens, local.positions, plan)
        res = cp_cross_entropy(logits, local.labels, layout.cp_group if layout.cp > 1 else None,
                               exact_value=invariant)
        backward(res.loss * loss_scale if loss_scale != 1.0 else res.loss, n)
        # --cp-invariant logs the sequence's loss with the same bits at every cp size, as its weights have
        loss_sum += res.value if invariant else res.loss.detach().double()
        tokens += local.tokens.numel()
    if layout.cp > 1 and not invariant:  # the shares of each sequence add up over cp
        dist.all_reduce(loss_sum, group=layout.cp_group)
    return loss_sum, tokens


def step_loss(loss_sum: torch.Tensor, layout: Layout) -> float:
    """The step's loss: mean over the global batch of sequence losses."""
    if layout.dp > 1:
        dist.all_reduce(loss_sum, group=layout.dp_group)
    return float(loss_sum) / layout.batch_size


# ---------------------------------------------------------------------------------------------------------------
# logging


def peak_memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # CPU: the process's peak resident set (Linux reports KiB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Progress:
    """A progress bar on rank 0 (a live bar on a terminal, plain lines in a log) and JSON metrics lines."""

    def __init__(self, total: int, rank: int, metrics_out: Optional[str], log_every: int = 1, start: int = 0):
        self.total, self.rank, self.log_every = total, rank, max(1, log_every)
        self.tty = sys.stderr.isatty()
        self.metrics = open_metrics(metrics_out, start) if (metrics_out and rank == 0) else None
        self.start = start

    def update(self, step: int, **fields):
        if self.rank != 0:
            return
        if self.metrics:
            self.metrics.write(json.dumps({"step": step, **fields}) + "\n")
            self.metrics.flush()
        done = step + 1
        width = 30
        filled = int(width * done / max(1, self.total))
        bar = "#" * filled + "." * (width - filled)
        text = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items())
        line = f"[{bar}] {done}/{self.total} {text}"
        if self.tty:
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
        elif done % self.log_every == 0 or done == self.total or step == self.start:
            print(line, flush=True)

    def close(self):
        if self.metrics:
            self.metrics.close()
        if self.rank == 0 and self.tty:  # a run stopped early leaves its bar without a line end
            sys.stderr.write("\n")


def open_metrics(path, start: int):
    """The metrics file, opened for appending the lines of steps ``start`` on.  It then holds the lines of the
    steps before ``start`` that it held (a resumed run's, from the run that saved the checkpoint) and nothing else:
    a new run (start 0) begins it empty, and a run stopped past its last checkpoint leaves lines of steps the
    resumed run takes again, which would otherwise appear twice.  A line that is not a step's JSON (a crash in the
    middle of writing one) is dropped."""
    path = Path(path)
    kept = []
    if start > 0 and path.is_file():
        for line in path.read_text().splitlines():
            try:
                step = json.loads(line)["step"]
            except (ValueError, TypeError, KeyError):
                continue
            if isinstance(step, int) and step < start:
                kept.append(line + "\n")
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)  # (never a half-written file where the old one was)
    return open(path, "a")


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.6g}" if abs(v) < 1e5 else f"{v:.4g}"
    return str(v)


class Throughput:
    """tokens/s and MFU over the steps from ``warmup`` on (a step index: a resumed run's start plus
    --timing-warmup)."""

    def __init__(self, warmup: int, device):
        self.warmup, self.device = warmup, device
        self.tokens = 0
        self.flops = 0.0
        self.seconds = 0.0
        self.steps = 0

    @classmethod
    def for_run(cls, args, device, start: int, stop: int) -> "Throughput":
        """The meter of an invocation that trains steps ``start`` to ``stop`` - 1, leaving out the first
        --timing-warmup of them; warns where that leaves none (the SUMMARY's tokens/s and MFU are then null)."""
        if start + args.timing_warmup >= stop:
            warnings.warn(f"--timing-warmup {args.timing_warmup} leaves out every one of the {stop - start} steps "
                          f"this run trains: its SUMMARY will have no tokens/s or MFU (null)", stacklevel=2)
        return cls(start + args.timing_warmup, device)

    def add(self, step_index: int, seconds: float, tokens: int, flops: float):
        if step_index < self.warmup:
            return
        self.tokens += tokens
        self.flops += flops
        self.seconds += seconds
        self.steps += 1

    def tokens_per_s(self) -> Optional[float]:
        return self.tokens / self.seconds if self.seconds > 0 else None

    def mfu(self, peak_flops: Optional[float], world: int) -> Optional[float]:
        if not peak_flops or self.seconds <= 0:
            return None
        return self.flops / self.seconds / (peak_flops * world)

    def summary(self, peak_flops: Optional[float], world: int) -> dict:
        """The SUMMARY line's throughput fields (None where nothing was timed or no peak is known).  MFU and
        TFLOP/s keep 3 significant digits: rounded to decimal places, a CPU run's 4e-4 TFLOP/s read 0.0."""
        tps, mfu = self.tokens_per_s(), self.mfu(peak_flops, world)
        return dict(
            steps_timed=self.steps,
            tokens_per_s=round(tps, 1) if tps else None,
            tokens_per_s_per_device=round(tps / world, 1) if tps else None,
            mfu=_significant(mfu) if mfu is not None else None,
            peak_tflops_per_device=peak_flops / 1e12 if peak_flops else None,
            achieved_tflops_per_device=_significant(self.flops / self.seconds / world / 1e12) if self.seconds else None,
        )


def _significant(x: float, digits: int = 3) -> float:
    return float(f"{x:.{digits}g}")


def max_peak_memory_gib(device) -> float:
    """The largest peak memory of any rank, in GiB (one all-reduce: every rank must call it)."""
    mem = torch.tensor([peak_memory_gib(device)], device=device)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    return round(float(mem), 3)


def peak_flops(args, device) -> Optional[float]:
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    return H200_PEAK_BF16 if device.type == "cuda" else None


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


FLOP_FORMULA = ("MFU = (6*N*T + 12*L*H*D*P) / (seconds * peak * devices); N = matmul parameters (all Linear "
                "weights incl. LM head), T = tokens, L = layers, H = query heads, D = head dim, P = (query, key) "
                "pairs visible under the causal mask within documents (sum l(l+1)/2; for sliding-window or chunked "
                "layers under their window or chunks, L*P summed per layer); backward = 2x forward; "
                "activation-checkpoint recompute not counted")


def summary_line(**fields) -> str:
    return "SUMMARY " + json.dumps(fields, sort_keys=True)


# ---------------------------------------------------------------------------------------------------------------
# the single-process reference


def reference_run(args, device=torch.device("cpu")) -> dict:
    """``{"loss": [...], "grad_norm": [...]}`` per step of the plain single-process loop of FA4Llama."""
    set_determinism(args)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = FA4Llama(model_config(args), None, backend=args.backend,
                         deterministic=args.deterministic or None)

    def sample_loss(sample):
        plan = make_sample_plan(sample, 1)
        local = shard_sample(sample, plan, 0, device=device)
        return cp_cross_entropy(model(local.tokens, local.positions, plan), local.labels).loss

    return reference_loop(model, sample_loss, args)


def reference_loop(model, sample_loss, args, tokenizer=None) -> dict:
    """The plain single-process training loop every recipe must reproduce: AdamW, the same schedule and clipping,
    ``sample_loss(sample)`` (a scalar) averaged over each step's samples (the data tokenized by ``tokenizer``, as
    :func:`build_stream` takes it).  Returns ``{"loss": [...], "grad_norm": [...]}``; the gradient norm (before
    clipping) checks the gradient's scale, which the losses alone cannot (AdamW is invariant to it)."""
    optimizer = make_optimizer(model, args)
    stream = build_stream(args, tokenizer)
    losses, norms = [], []
    for step in range(args.steps):
        set_lr(optimizer, step, args)
        samples = stream.batch(step, args.batch_size)
        total = 0.0
        for sample in samples:
            loss = sample_loss(sample)
            (loss / len(samples)).backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / len(samples))
        norms.append(float(norm))
    return {"loss": losses, "grad_norm": norms}


def clip_and_step(params, optimizer, args, norm: Optional[torch.Tensor] = None):
    """Gradient clipping (``--grad-clip``; its norm as a plain tensor, also for DTensor gradients, or None when
    off), then the optimizer step. ``norm``: the gradients' norm, given (FixedPointGrads.finish: the same bits at
    every cp size, where a norm over DTensor shards is not)."""
    grad_norm = None
    if args.grad_clip and norm is not None:
        from fa4dist.models.invariant_grads import clip_by_norm

        clip_by_norm(list(params), args.grad_clip, norm)
        grad_norm = norm
    elif args.grad_clip:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def make_optimizer(model, args) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm weights excluded)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def read_metrics(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def now() -> float:
    return time.perf_counter()
