"""Checks shared by the tests that train a trainer's steps with and without ferry's offload:
equal runs, every offloaded tensor back and nothing left, and the losses and gradients a
transformers Trainer computed."""

import torch
import transformers

import ferry


def assert_equal_runs(want, got, steps):
    """`want` and `got` are (losses, gradients by step, _): `steps` steps each, bit for bit."""
    (want_losses, want_grads, _), (got_losses, got_grads, _) = want, got
    assert len(got_losses) == len(want_losses) == steps
    for step, (a, b) in enumerate(zip(want_losses, got_losses)):
        assert torch.equal(a, b), f"loss of step {step}"
    assert len(got_grads) == len(want_grads) == steps
    for step, (ga, gb) in enumerate(zip(want_grads, got_grads)):
        assert len(ga) == len(gb)
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), f"gradient {i} of step {step}"


def assert_every_offload_came_back(ctx, states):
    """`ctx`, a ferry.offload session after its run, offloaded, brought each tensor back and
    holds nothing; the live checkpoint states are `states` again."""
    counts = ctx.telemetry()
    assert counts["offloaded"] > 0
    # Each came back: from the host, or (the last ones of a forward, still on the device when
    # backward begins) from the original.
    from_host = counts["prefetched"] + counts["on_demand"]
    assert from_host + counts["stash_hits"] == counts["offloaded"]
    assert 0 < counts["bytes_h2d"] < counts["bytes_d2h"]
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0
    assert ferry._C._live_checkpoint_states() == states


class KeepsLosses:
    """Mixed into a transformers Trainer class: keeps each step's loss tensor in `losses` (the
    logged one is rounded)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(loss.detach().clone())
        return loss


class Grads(transformers.TrainerCallback):
    """The gradients of each step, before the optimizer uses them."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
