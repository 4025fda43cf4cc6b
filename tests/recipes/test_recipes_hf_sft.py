"""The Hugging Face SFT recipe on 2 CPU processes (gloo): a transformers model under enable_context_parallel and
FSDP2 trains with the losses and gradient norms of a plain single-process loop that uses the model's own attention
and loss (cp = 2 with activation checkpointing, tiled MLP and tiled loss; dp = 2 with the model's logits)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

import hf_sft  # noqa: E402
import launch  # noqa: E402
from recipe_metrics import assert_steps_close, step_metrics  # noqa: E402

STEPS = 3
BASE = launch.tiny_args(STEPS)


def reference(corpus, *extra):
    return hf_sft.reference_run(hf_sft.parse_args(BASE + ["--data", str(corpus), *extra]))


@pytest.mark.timeout(300)
def test_hf_sft_cp2_matches_single_process(tmp_path, corpus):
    out = launch.torchrun("hf_sft.py", BASE + [
        "--data", corpus, "--cp", "2", "--activation-checkpointing", "--tile-mlp", "48", "--loss-chunk", "40",
        "--metrics-out", tmp_path / "m.jsonl"])
    s = launch.summary(out.stdout)
    assert (s["recipe"], s["dp"], s["cp"], s["loss"]) == ("hf_sft", 1, 2, "tiled")
    assert s["tokens_per_s"] > 0 and s["peak_mem_gib"] > 0
    want = reference(corpus)
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "loss"), want["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), want["grad_norm"])


@pytest.mark.timeout(300)
def test_hf_sft_cp_invariant_trains_as_the_single_process_loop_and_says_so(tmp_path, corpus):
    """--cp-invariant ran in no test, and its SUMMARY line left the mode out (the other recipes' record it)."""
    out = launch.torchrun("hf_sft.py", BASE + ["--data", corpus, "--cp", "2", "--cp-invariant",
                                               "--metrics-out", tmp_path / "m.jsonl"])
    assert "cp_invariant: the attention's outputs and gradients have the same bits" in out.stdout
    s = launch.summary(out.stdout)
    assert (s["cp"], s["cp_invariant"]) == (2, True)
    want = reference(corpus)
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "loss"), want["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), want["grad_norm"])


def test_the_help_says_the_hybrid_strategy_is_refused(capsys):
    """The shared --strategy help offered hybrid "with --ulysses-degree", both of which this recipe refuses."""
    with pytest.raises(SystemExit):
        hf_sft.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text[text.index("parallelism:"):]  # the options' help, not the usage line
    strategy = text[text.index("--strategy {auto,ring,ulysses,hybrid} "):text.index("--ulysses-degree ULYSSES")]
    assert "hybrid is refused" in strategy and "with --ulysses-degree" not in strategy, strategy
    assert "--ulysses-degree ULYSSES_DEGREE not used by this recipe (refused)" in text


@pytest.mark.timeout(300)
def test_hf_sft_qwen2_dp2_logits_loss_matches_single_process(tmp_path, corpus):
    launch.torchrun("hf_sft.py", BASE + [
        "--data", corpus, "--arch", "qwen2", "--cp", "1", "--loss", "logits", "--metrics-out", tmp_path / "m.jsonl"])
    want = reference(corpus, "--arch", "qwen2")
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "loss"), want["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), want["grad_norm"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("extra", [
    ["--arch", "gemma2", "--sliding-window", "32"],
    ["--arch", "gemma3", "--sliding-window", "32"],
    ["--arch", "gpt_oss", "--sliding-window", "32"],
    ["--arch", "llama4", "--attention-chunk", "24", "--experts", "2", "--experts-per-token", "1"],
], ids=["gemma2", "gemma3", "gpt_oss", "llama4"])
def test_hf_sft_windowed_and_chunked_archs_cp2_match_single_process(tmp_path, corpus, extra):
    """At cp = 2 with the tiled loss, against the model's own attention and loss: Gemma 2 (attention and
    final-logit soft-capping, every other layer a 32-token window), Gemma 3 (local and global layers), GPT-OSS
    (sinks, MoE), and Llama 4 (chunks of 24 tokens in its chunked layers, a global NoPE layer, MoE; its reference
    runs sdpa one document at a time)."""
    launch.torchrun("hf_sft.py", BASE + [
        "--data", corpus, "--cp", "2", "--loss-chunk", "40", "--metrics-out", tmp_path / "m.jsonl", *extra])
    want = reference(corpus, *extra)
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "loss"), want["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), want["grad_norm"])


@pytest.mark.timeout(300)
def test_hf_sft_with_a_local_tokenizer_matches_single_process(tmp_path, corpus):
    """--tokenizer: the data tokenized by a local transformers tokenizer (a small BPE trained here), the model's
    vocabulary its own (rounded up to 64); cp = 2 against the single-process reference on the same tokens."""
    from tiny_tokenizer import make_hf_tokenizer

    from fa4dist.data import collect_documents

    texts = collect_documents([corpus])[:40]
    extra = ["--tokenizer", make_hf_tokenizer(tmp_path / "tok", texts, vocab_size=400)]
    args = hf_sft.parse_args(BASE + ["--data", str(corpus), *extra])
    assert hf_sft.data_vocab(args) == 400 and hf_sft.hf_config(args).vocab_size == 448
    launch.torchrun("hf_sft.py", BASE + [
        "--data", corpus, "--cp", "2", "--loss-chunk", "40", "--metrics-out", tmp_path / "m.jsonl", *extra])
    want = reference(corpus, *extra)
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "loss"), want["loss"])
    assert_steps_close(step_metrics(tmp_path / "m.jsonl", "grad_norm"), want["grad_norm"])
    with pytest.raises(SystemExit, match=r"checkpoint's vocabulary \(300\) is smaller than --tokenizer .*'s \(400\)"):
        hf_sft.check_vocab(300, args, "the checkpoint's")


@pytest.mark.parametrize("bad", [["--arch", "llama", "--sliding-window", "32"],
                                 ["--arch", "gpt_oss", "--tile-mlp", "8"],
                                 ["--arch", "llama4", "--tile-mlp", "8"],
                                 ["--arch", "llama4", "--attention-chunk", "0"],
                                 ["--arch", "gpt_oss", "--experts", "2", "--experts-per-token", "3"],
                                 ["--strategy", "hybrid"], ["--ulysses-degree", "2"],
                                 ["--checkpoint", "/nonexistent/checkpoint"], ["--tile-mlp", "-1"],
                                 ["--loss-chunk", "0"]])
def test_hf_sft_refuses_options_its_arch_lacks(bad):
    with pytest.raises(SystemExit):
        hf_sft.parse_args(BASE + bad)


def test_an_unknown_model_is_refused_by_name_and_the_llama3_shapes_parse(capsys):
    with pytest.raises(SystemExit):
        hf_sft.parse_args(["--model", "bogus"])
    err = capsys.readouterr().err
    # the refusal lists every name the recipe takes: fa4dist's presets and its own Llama-3 shapes (it listed only
    # the presets), and so does --help
    assert "--model: model size must be one of" in err and "also takes llama3.2-1b, llama3-8b" in err, err
    assert hf_sft.parse_args(["--model", "llama3.2-1b"]).model == "llama3.2-1b"
    with pytest.raises(SystemExit):
        hf_sft.parse_args(["--help"])
    assert re.search(r"size preset: tiny,.*1b,\s+llama3\.2-1b,\s+llama3-8b", capsys.readouterr().out)


@pytest.mark.timeout(200)
def test_a_local_checkpoint_trains_and_is_reported_with_its_own_architecture(tmp_path, corpus):
    """--checkpoint DIR of a Qwen2 model: the header and SUMMARY name qwen2, not the unused --arch default."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "qwen2")
    run = [a for a in launch.tiny_args(1) if a not in ("--model", "tiny")]  # the checkpoint is the model
    out = launch.python("hf_sft.py", run + ["--data", corpus, "--checkpoint", tmp_path / "qwen2"])
    assert " arch=qwen2 " in out.stdout
    assert launch.summary(out.stdout)["arch"] == "qwen2"


@pytest.mark.parametrize("flag", [["--arch", "qwen2"], ["--arch", "llama"], ["--model", "small"], ["--layers", "2"],
                                  ["--sliding-window", "32"], ["--experts", "4"], ["--experts-per-token", "1"],
                                  ["--attention-chunk", "64"], ["--init", "sharded"]])
def test_options_a_checkpoint_makes_unused_are_refused_by_name(tmp_path, flag, capsys):
    """--checkpoint DIR: the checkpoint's config defines the model and from_pretrained loads its weights, so the
    options that shape or initialize a model were ignored (--arch was even reported); now each is refused naming it,
    at parse time, even at its default value."""
    with pytest.raises(SystemExit):
        hf_sft.parse_args(["--checkpoint", str(tmp_path)] + flag)
    assert f"{flag[0]} is not used with --checkpoint: " in capsys.readouterr().err
    assert hf_sft.parse_args(["--checkpoint", str(tmp_path), "--seqlen", "64"]).checkpoint == str(tmp_path)


def test_the_checkpoint_help_names_every_option_it_refuses(capsys):
    """--checkpoint's help listed the refused options by hand and missed --attention-chunk; it now lists them from
    the table the refusal reads."""
    with pytest.raises(SystemExit):
        hf_sft.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help, hyphenated names included
    start = text.index("--checkpoint CHECKPOINT a local")  # its help, not the usage line
    listed = text[start:text.index("are refused with it", start)].replace("- ", "-")
    for dest in hf_sft.UNUSED_WITH_CHECKPOINT:
        assert f"--{dest.replace('_', '-')}" in listed, (dest, listed)


@pytest.mark.parametrize("bad, message", [
    (["--arch", "llama", "--experts", "4"],
     "--experts is not used by --arch llama: only gpt_oss and llama4 have MoE layers"),
    (["--arch", "gemma2", "--attention-chunk", "64"],
     "--attention-chunk is not used by --arch gemma2: only llama4 has chunked attention layers"),
    (["--arch", "qwen2", "--experts-per-token", "1"], "--experts-per-token is not used by --arch qwen2"),
    (["--loss", "logits", "--loss-chunk", "40"], "--loss-chunk is not used by --loss logits"),
    # were refused as "--experts-per-token must be in [1, --experts], got 2 of 0", naming the other option
    (["--arch", "gpt_oss", "--experts", "0"], "argument --experts: must be a positive integer, got 0"),
    (["--arch", "gpt_oss", "--experts-per-token", "-1"], "argument --experts-per-token: must be a positive integer"),
    (["--arch", "qwen2", "--model", "llama3.2-1b"], "--model llama3.2-1b is a Llama shape; use --arch llama"),
    # was "--strategy hybrid needs --ulysses-degree", and with one: refused for the hybrid strategy itself
    (["--cp", "2", "--strategy", "hybrid"], "enable_context_parallel takes the hybrid strategy from a 2-D mesh"),
    (["--cp", "2", "--ulysses-degree", "2"], "enable_context_parallel takes the hybrid strategy from a 2-D mesh"),
])
def test_options_the_chosen_arch_or_loss_ignores_are_refused_by_name(bad, message, capsys):
    """--experts / --experts-per-token outside gpt_oss and --loss-chunk with --loss logits were ignored; a Llama-3
    shape with another --arch failed on every rank after the process group existed; --experts 0 was refused as a
    problem of --experts-per-token."""
    with pytest.raises(SystemExit):
        hf_sft.parse_args(bad)
    assert message in capsys.readouterr().err


def test_offload_checkpoints_on_a_cpu_device_runs_as_plain_checkpointing():
    """--offload-checkpoints on a CPU run (the README's recipes run on CPUs too): the checkpoints are in host memory
    already, and transformers' offload pins memory, which needs an accelerator; the recipe checkpoints plainly, with
    the gradients of the model without checkpointing."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 64, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    hf_sft.enable_activation_checkpointing(model, offload=True, device=torch.device("cpu"))
    model(input_ids=ids, labels=ids).loss.backward()
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w)


def test_a_checkpoint_directory_it_cannot_load_is_refused_before_the_process_group(tmp_path,
                                                                                  launched_without_a_rendezvous):
    """--checkpoint DIR without a transformers config (a ValueError on every rank once the process group was up),
    or whose vocabulary is smaller than the byte tokens (refused after from_pretrained loaded the weights): refused
    by name from the config alone, before the process group and the weights."""
    import hf_sft
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=100).save_pretrained(tmp_path / "small")
    (tmp_path / "empty").mkdir()
    launched_without_a_rendezvous(1)
    for where, message in ((tmp_path / "empty", f"--checkpoint {tmp_path / 'empty'}: not a transformers checkpoint"),
                           (tmp_path / "small", r"the checkpoint's vocabulary \(100\) is smaller than the byte")):
        with pytest.raises(SystemExit, match=message):
            hf_sft.main(["--checkpoint", str(where), "--seqlen", "64"])


def test_a_ulysses_degree_a_llama3_shape_or_checkpoint_cannot_split_is_refused_before_the_process_group(
        tmp_path, capsys, launched_without_a_rendezvous):
    """--strategy ulysses over --cp 3 with a Llama-3 shape's 32 query heads, or a --checkpoint's 4: the preset's
    heads are checked at parse time (as fa4dist's presets' are), the checkpoint's from its config before the
    process group; both failed in the first attention call, the sharded model built."""
    from transformers import Qwen2Config

    with pytest.raises(SystemExit):
        hf_sft.parse_args(["--model", "llama3.2-1b", "--cp", "3", "--strategy", "ulysses"])
    assert ("--strategy ulysses runs a Ulysses degree of 3 over --model llama3.2-1b's 32 query heads / 8 key/value "
            "heads: Ulysses degree 3 is impossible") in capsys.readouterr().err
    hf_sft.parse_args(["--model", "llama3.2-1b", "--cp", "4", "--strategy", "ulysses"])  # 32 / 8 split over 4
    Qwen2Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path / "qwen2")
    launched_without_a_rendezvous(3)
    with pytest.raises(SystemExit, match=rf"--strategy ulysses runs a Ulysses degree of 3 over --checkpoint "
                                         rf"{tmp_path / 'qwen2'}'s 4 query heads / 2 key/value heads"):
        hf_sft.main(["--checkpoint", str(tmp_path / "qwen2"), "--seqlen", "64", "--cp", "3", "--strategy", "ulysses",
                     "--batch-size", "3"])


def test_a_checkpoint_the_tiled_loss_cannot_take_is_refused_before_the_process_group(tmp_path,
                                                                                     launched_without_a_rendezvous):
    """--checkpoint DIR of a Phi-3 model (or one whose config adds a router aux loss) with the default --loss tiled:
    TiledCausalLMLoss refused it with a traceback on every rank once the process group was up and the weights
    loaded, naming an API call instead of the option.  Now refused from the config alone, naming --loss logits."""
    from transformers import GptOssConfig, Phi3Config

    Phi3Config(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, pad_token_id=0, bos_token_id=None, eos_token_id=None
               ).save_pretrained(tmp_path / "phi3")
    GptOssConfig(vocab_size=320, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, num_local_experts=2, output_router_logits=True
                 ).save_pretrained(tmp_path / "router")
    launched_without_a_rendezvous(1)
    for where, why in (("phi3", "not 'phi3'"), ("router", "router aux loss")):
        with pytest.raises(SystemExit, match=rf"--loss tiled \(the default\) with --checkpoint {tmp_path / where}: "
                                             rf".*{why}.*; pass --loss logits"):
            hf_sft.main(["--checkpoint", str(tmp_path / where), "--seqlen", "64"])


def test_a_checkpoint_with_attention_dropout_is_refused_before_the_process_group(tmp_path,
                                                                               launched_without_a_rendezvous):
    """--checkpoint DIR whose config has attention_dropout > 0: every rank raised the integration's UnsupportedMask
    with a traceback once the group was up and the weights loaded.  Now refused from the config alone, naming the
    value and what to change."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, attention_dropout=0.1).save_pretrained(tmp_path / "dropout")
    launched_without_a_rendezvous(1)
    with pytest.raises(SystemExit, match=rf"--checkpoint {tmp_path / 'dropout'}: its config has attention_dropout = "
                                         r"0.1, which fa4dist's attention does not compute; set it to 0"):
        hf_sft.main(["--checkpoint", str(tmp_path / "dropout"), "--seqlen", "64"])


def test_a_checkpoint_without_weights_is_refused_before_the_process_group(tmp_path, launched_without_a_rendezvous):
    """--checkpoint DIR holding a config but no weight files: every rank raised from_pretrained's OSError once the
    group was up.  Now refused before it, naming the files looked for."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path / "config_only")
    launched_without_a_rendezvous(1)
    with pytest.raises(SystemExit, match=rf"--checkpoint {tmp_path / 'config_only'}: a config but no weights \(none "
                                         r"of model.safetensors, "):
        hf_sft.main(["--checkpoint", str(tmp_path / "config_only"), "--seqlen", "64"])


def test_the_reference_loss_of_a_window_without_targets_is_the_cp_loss_zero():
    """A packed window whose documents are all one token long has no next-token target.  The recipe's loss
    (handle.loss, cp_cross_entropy: documented) gives 0 with zero gradients there at every cp size; its
    single-process reference (per_document_loss, the model's own loss per document) raised a TypeError (None / 0)
    instead.  Now it gives the same 0, with zero gradients."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fa4dist.data.packing import IGNORE, Sample, positions_from_cu_seqlens
    from fa4dist.integrations.hf import enable_context_parallel

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    cu = torch.arange(0, 9, dtype=torch.int32)
    sample = Sample(torch.randint(0, 64, (8,)), torch.full((8,), IGNORE), positions_from_cu_seqlens(cu), cu)
    want = hf_sft.per_document_loss(model, sample)
    want.backward()
    assert want.item() == 0.0 and all(p.grad is None or not p.grad.any() for p in model.parameters())
    with enable_context_parallel(model) as handle:
        local = handle.shard_batch(hf_sft.hf_batch(sample))
        assert handle.loss(model(**local).logits, local).item() == want.item()


@pytest.mark.parametrize("packing", ["documents", "stream"])
def test_every_target_of_a_window_is_trained_on(packing):
    """hf_batch rebuilt the labels from the window's tokens, so the last token's target (the next window's first
    token, as fa4dist.data's windows hold it) was -100: one target per window never trained, in both packings, where
    the other recipes train on it.  The window's own targets go through shard_batch as shift_labels now, and the
    reference counts them too."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fa4dist.data import PackedTokenStream
    from fa4dist.data.packing import IGNORE
    from fa4dist.data.tokenizer import VOCAB_SIZE
    from fa4dist.integrations.hf import enable_context_parallel

    texts = [f"document {i}: " + "text " * (3 + 7 * i) for i in range(12)]
    stream = PackedTokenStream(texts, 48, packing=packing)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    samples, losses = [stream.window(i) for i in range(3)], []
    with enable_context_parallel(model) as handle:
        for sample in samples:
            local = handle.shard_batch(hf_sft.hf_batch(sample))
            assert torch.equal(local["shift_labels"][0], sample.labels)
            assert int(sample.labels[-1]) != IGNORE  # the target the unshifted labels could not hold
            logits = model(**{k: v for k, v in local.items() if k != "shift_labels"}).logits
            losses.append(handle.loss(logits, local))
    for sample, loss in zip(samples, losses):  # (the model's own attention again)
        torch.testing.assert_close(loss, hf_sft.per_document_loss(model, sample), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gemma3", "gpt_oss", "llama4"])
def test_a_sharded_init_gives_the_buffers_and_norms_of_the_models_own_init(arch):
    """--init sharded builds on the meta device, so after to_empty every buffer and weight is uninitialized memory
    (NaN here, to be sure): init_shards must leave none of it. Gemma's embedding scale (sqrt(hidden), a buffer) was
    left so (a Gemma 3 run trained with gradient norms of 1e-13), and its norms, x * (1 + weight), were set to
    ones: twice the identity. The buffers and the norms must be what the model's own (full) init gives."""
    import torch

    cpu = torch.device("cpu")
    full, _ = hf_sft.build_model(hf_sft.parse_args(["--arch", arch, "--seqlen", "64", "--init", "full"]), cpu)
    model, sharded = hf_sft.build_model(hf_sft.parse_args(["--arch", arch, "--seqlen", "64", "--init", "sharded"]),
                                        cpu)
    assert sharded
    model.to_empty(device=cpu)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))
    hf_sft.init_shards(model, 0, 0, cpu)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(t).all(), f"{name} left uninitialized"
    want = dict(full.named_buffers())
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, want[name], rtol=0, atol=0, msg=f"buffer {name}")
    norms = [(n, p) for n, p in full.named_parameters() if "norm" in n]
    assert norms
    got = dict(model.named_parameters())
    for name, p in norms:
        torch.testing.assert_close(got[name], p, rtol=0, atol=0, msg=f"norm weight {name}")


def test_a_seqlen_shorter_than_cp_is_refused_by_name(capsys):
    """enable_context_parallel's shard_batch needs a token of each sequence on every cp rank: --seqlen 3 --cp 4
    failed on every rank with a ValueError traceback from the first step, the model built and sharded. Every
    --seqlen of at least --cp tokens gives each rank some (the plans' rule)."""
    with pytest.raises(SystemExit):
        hf_sft.parse_args(["--seqlen", "3", "--cp", "4"])
    assert "--seqlen 3 is shorter than --cp 4" in capsys.readouterr().err
    assert hf_sft.parse_args(["--seqlen", "4", "--cp", "4"]).seqlen == 4


def test_training_flops_is_the_models_formula():
    """hf_sft's MFU counts with fa4dist.models.causal_training_flops (it kept its own copy of the formula, which
    raised on a list of boundaries and counted decreasing ones as negative tokens)."""
    import torch

    from fa4dist.models import FA4Llama, get_config

    model = FA4Llama(get_config("tiny"))
    c = model.config
    facts = dict(matmul_params=model.num_parameters(matmul_only=True), layers=c.n_layers, heads=c.n_heads,
                 head_dim=c.resolved_head_dim)
    samples = [torch.tensor([0, 10, 30], dtype=torch.int32), [0, 7]]
    facts["layer_masks"] = [(None, None)] * c.n_layers
    assert hf_sft.training_flops(facts, samples) == model.training_flops(samples)
    with pytest.raises(ValueError):
        hf_sft.training_flops(facts, [[0, 30, 10]])


@pytest.mark.parametrize("arch, masks", [("llama", [(None, None)] * 2), ("mistral", [(32, None)] * 2),
                                         ("gemma2", [(32, None), (None, None)]),
                                         ("llama4", [(None, 24), (None, 24), (None, 24), (None, None)])])
def test_the_flop_count_sees_each_layers_window_or_chunks(arch, masks):
    """Sliding-window and chunked layers attend to fewer pairs: the MFU counts each layer's (the formula counted
    every layer as full causal, overstating windowed models' MFU)."""
    extra = {"mistral": ["--sliding-window", "32"], "gemma2": ["--sliding-window", "32"],
             "llama4": ["--attention-chunk", "24", "--layers", "4"]}.get(arch, [])
    config = hf_sft.hf_config(hf_sft.parse_args(BASE + ["--arch", arch, *extra]))
    assert hf_sft.layer_masks(config) == masks


def test_offload_checkpoints_is_reported_as_checkpointing():
    """--offload-checkpoints alone checkpoints every layer (its checkpoints in host memory), but the SUMMARY said
    activation_checkpointing false and the MEMORY line's estimate left the checkpoints out for the wrong reason;
    now the option implies --activation-checkpointing, and only offloaded checkpoints leave the device estimate."""
    import torch

    facts = dict(params=1000, head_dim=16, heads=4, kv_heads=2, ffn=128, layers=2, hidden=64, vocab=320)
    offloaded = hf_sft.parse_args(["--offload-checkpoints"])
    assert offloaded.activation_checkpointing and offloaded.offload_checkpoints
    assert hf_sft.memory_estimates(facts, 64, 2, offloaded, torch.bfloat16)["checkpoints"] is None
    plain = hf_sft.parse_args(["--activation-checkpointing"])
    assert hf_sft.memory_estimates(facts, 64, 2, plain, torch.bfloat16)["checkpoints"] == 2 * 64 * 64 * 2 / 2**30
    assert not hf_sft.parse_args([]).activation_checkpointing


def test_the_llama4_reference_scales_its_queries_by_the_index_in_the_packed_row():
    """Llama 4's NoPE layers scale each query by a function of its token's index in the row (temperature tuning,
    from floor_scale tokens on: 8192 by default, within --seqlen 65536).  The recipe's run (enable_context_parallel,
    as the model on the packed row) takes the index in the packed window; the single-process reference ran each
    document alone, from index 0, so from the second document on it computed another model (here a loss ~1e-3
    apart).  It now runs such a model on the packed row.  fp64, no MoE layers (their fp32 router rounds apart with
    the token count)."""
    import torch
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    from fa4dist.data.packing import Sample, positions_from_cu_seqlens
    from fa4dist.integrations.hf import enable_context_parallel

    config = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, intermediate_size_mlp=48,
                              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              attention_chunk_size=6, moe_layers=[], floor_scale=4, attn_scale=2.0,
                              initializer_range=0.5)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    cu = torch.tensor([0, 9, 23, 30], dtype=torch.int32)
    sample = Sample(torch.randint(0, 64, (30,)), torch.zeros(30, dtype=torch.long), positions_from_cu_seqlens(cu),
                    cu)
    want = hf_sft.per_document_loss(model, sample)
    with enable_context_parallel(model) as handle:
        local = handle.shard_batch(hf_sft.hf_batch(sample))
        got = handle.loss(model(**local).logits, local)
    # (the model's own loss is computed in fp32)
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item()), (got.item(), want.item())
