"""Small random-initialised Hugging Face models (Llama, GPT-2, Qwen2, BERT, from configs: no
downloads), with and without LoRA, under fp32 and bf16 autocast: every configuration of ferry
(offload with either policy, checkpoint reentrant or not, selective checkpoint with offloaded
matmuls, offload + checkpoint) trains 3 optimizer steps with the losses and gradients of the
same configuration done by torch alone, bit for bit, and leaves nothing in the session after
each step: no tracked tensor, no device buffer, no host buffer in use, no checkpoint state."""

import contextlib
import functools
import warnings

import peft  # test dependencies, installed by scripts/setup.sh: missing is an error
import pytest
import torch
import transformers

import ferry

SEQ, BATCH, VOCAB = 16, 2, 64


def make(arch):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
    )
    if arch == "llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, num_key_value_heads=2, max_position_embeddings=SEQ)
        ), ["q_proj", "v_proj"]
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, num_key_value_heads=2, max_position_embeddings=SEQ)
        ), ["q_proj", "v_proj"]
    if arch == "gpt2":
        return transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ
            )
        ), ["c_attn"]
    if arch == "bert":
        return transformers.BertForMaskedLM(
            transformers.BertConfig(**common, max_position_embeddings=SEQ)
        ), ["query", "value"]
    raise ValueError(arch)


def build(arch, lora):
    torch.manual_seed(0)
    model, targets = make(arch)
    model.config.use_cache = False
    if lora:
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        )
    model.train()
    return model


def _selective_policy(ctx, op, *args, **kwargs):
    """The matmuls' outputs are offloaded (torch recomputes them in eager mode), the rest is
    recomputed."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return torch.utils.checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


SELECTIVE = functools.partial(
    torch.utils.checkpoint.create_selective_checkpoint_contexts, _selective_policy
)


def session(policy):
    # A zero window and a one-tensor stash: every offloaded tensor comes back from the host.
    return dict(policy=policy, loopback=True, min_bytes=0, window_bytes=0, max_fwd_stash_size=1)


class Empty:
    """Checks that nothing is left in a session between steps: no tracked tensor, no device
    buffer, no host buffer in use (ferry's pool keeps its buffers for the next step: it must
    not grow; trl's host copies are gone), and no checkpoint state alive."""

    def __init__(self, ctx, policy):
        self.ctx, self.policy = ctx, policy
        self.states = ferry._C._live_checkpoint_states()
        self.pool = None

    def check(self, step):
        assert ferry._C._live_checkpoint_states() == self.states, f"step {step}"
        if self.ctx is None:
            return
        ctx = self.ctx
        assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0, f"step {step}"
        pool = (ctx.live_host_buffers(), ctx.telemetry()["pinned_bytes"])
        if self.policy == "trl":
            assert pool[0] == 0, f"step {step}: trl holds host copies"
        elif self.pool is None:
            self.pool = pool
        else:
            assert pool == self.pool, f"step {step}: the host pool grew"


def train(arch, lora, autocast, checkpoint=None, offload=None, by_ferry=False):
    """Losses and gradients of 3 SGD steps. checkpoint: None, "non-reentrant", "reentrant" or
    "selective" (non-reentrant, the matmuls' outputs offloaded), done by ferry.checkpoint when
    by_ferry else torch's; offload: None or a ferry policy."""
    model = build(arch, lora)
    ctx = selective = None
    if checkpoint is not None:
        kwargs = {"use_reentrant": checkpoint == "reentrant"}
        if checkpoint == "selective":
            kwargs["context_fn"] = SELECTIVE
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if by_ferry:
                if checkpoint == "selective":
                    selective = ferry.offload(**session("ferry"))
                    kwargs["offload"] = selective
                ferry.enable_gradient_checkpointing(model, **kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if offload is not None:
        ctx = ferry.offload_model(model, **session(offload))
    checks = [Empty(ctx, offload), Empty(selective, "ferry")]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.05)
    generator = torch.Generator().manual_seed(1)
    losses, grads = [], []
    torch.manual_seed(2)  # dropout
    for step in range(3):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        opt.zero_grad(set_to_none=True)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with amp, ctx if ctx is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in params])
        del loss  # the graph goes: what the session still holds now is left over
        for check in checks:
            check.check(step)
        opt.step()
    for used in (ctx, selective):
        if used is not None:
            assert used.telemetry()["offloaded"] > 0
            assert used.telemetry()["bytes_h2d"] > 0  # really back from the host
    return losses, grads


def assert_bitwise(want, got):
    (want_losses, want_grads), (got_losses, got_grads) = want, got
    for step, (a, b) in enumerate(zip(want_losses, got_losses)):
        assert torch.equal(a, b), f"loss of step {step}: {a.item()} vs {b.item()}"
    for step, (ga, gb) in enumerate(zip(want_grads, got_grads)):
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), f"gradient {i} of step {step} differs"


CONFIGS = {
    "offload-ferry": dict(offload="ferry"),
    "offload-trl": dict(offload="trl"),
    "checkpoint": dict(checkpoint="non-reentrant"),
    "checkpoint-reentrant": dict(checkpoint="reentrant"),
    "selective+offload": dict(checkpoint="selective"),
    "offload+checkpoint": dict(offload="ferry", checkpoint="non-reentrant"),
}


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "bert"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_equals_torch(arch, lora, autocast, config, monkeypatch):
    options = CONFIGS[config]
    want = train(arch, lora, autocast, checkpoint=options.get("checkpoint"))
    # Every checkpointed layer call goes through ferry's checkpoint, none through torch's.
    regions = []
    for name in ("_non_reentrant", "_reentrant"):
        real = getattr(ferry._checkpoint, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            regions.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ferry._checkpoint, name, spy)
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", None)  # any call would fail
    got = train(arch, lora, autocast, by_ferry=True, **options)
    assert_bitwise(want, got)
    if "checkpoint" in options:
        kind = "_reentrant" if options["checkpoint"] == "reentrant" else "_non_reentrant"
        assert regions == [kind] * 6  # 2 layers x 3 steps
    else:
        assert regions == []
