"""Mixed precision: ferry.checkpoint replays a region under the autocast state its forward ran
in (Note [Autocast in replays] in real/src/checkpoint.cpp), so that under torch.autocast the loss
and gradients are bitwise equal to torch.utils.checkpoint's under the same autocast."""

import contextlib

import pytest
import torch
import torch.utils.checkpoint as tc

import ferry
from models import MLP, Block, TinyLM, assert_same_grads, loss_of, twin

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def torch_ckpt(fn, x):
    return tc.checkpoint(fn, x, use_reentrant=False)


def ferry_ckpt(fn, x):
    return ferry.checkpoint(fn, x, use_reentrant=False)


def blockwise(ckpt):
    """TinyLM's forward with each block checkpointed by `ckpt`."""

    def forward(model, x):
        for block in model.blocks:
            x = ckpt(block, x)
        return model.lm_head(model.ln_f(x))

    return forward


def train(model, x, forward, autocast, ctx=None, steps=3):
    """`steps` forward/backward passes under `autocast` (and `ctx`); the losses and grads."""
    losses = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(**autocast), ctx if ctx is not None else contextlib.nullcontext():
            loss = loss_of(forward(model, x).float())
        loss.backward()
        losses.append(loss.detach())
        opt.step()
    return losses


@pytest.mark.parametrize(
    "make_model,make_input",
    [(MLP, lambda: torch.randn(8, 32)), (Block, lambda: torch.randn(2, 16, 32))],
    ids=["mlp", "block"],
)
@pytest.mark.parametrize("cache_enabled", [True, False])
def test_checkpoint_under_bf16_autocast_equals_torch(make_model, make_input, cache_enabled):
    autocast = dict(BF16, cache_enabled=cache_enabled)
    ref, model, ref_x, x = twin(make_model, make_input)
    want = train(ref, ref_x, lambda m, v: torch_ckpt(m, v), autocast)
    got = train(model, x, lambda m, v: ferry_ckpt(m, v), autocast)
    assert [torch.equal(a, b) for a, b in zip(want, got)] == [True] * 3
    assert_same_grads(ref, model, [ref_x], [x])


def test_checkpoint_under_bf16_autocast_equals_plain_autocast():
    ref, model, ref_x, x = twin(Block, lambda: torch.randn(2, 16, 32))
    want = train(ref, ref_x, lambda m, v: m(v), BF16)
    got = train(model, x, lambda m, v: ferry_ckpt(m, v), BF16)
    assert [torch.equal(a, b) for a, b in zip(want, got)] == [True] * 3
    assert_same_grads(ref, model, [ref_x], [x])


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_offload_and_checkpoint_under_bf16_autocast(policy):
    ref, model, ref_x, x = twin(TinyLM, lambda: torch.randn(2, 16, 32))
    want = train(ref, ref_x, blockwise(torch_ckpt), BF16)
    ctx = ferry.offload(
        policy=policy, loopback=True, min_bytes=0, window_bytes=0, max_fwd_stash_size=1
    )
    ctx.update_model_params(model)
    got = train(model, x, blockwise(ferry_ckpt), BF16, ctx)
    assert [torch.equal(a, b) for a, b in zip(want, got)] == [True] * 3
    assert_same_grads(ref, model, [ref_x], [x])
    assert ctx.telemetry()["offloaded"] > 0
    assert ctx.tracked() == 0
    assert ctx.live_device_buffers() == 0


def test_nested_checkpoint_under_bf16_autocast():
    def outer(block):
        def run(v):
            return ferry_ckpt(block, torch.tanh(v))

        return run

    def torch_outer(block):
        def run(v):
            return torch_ckpt(block, torch.tanh(v))

        return run

    ref, model, ref_x, x = twin(Block, lambda: torch.randn(2, 16, 32))
    want = train(ref, ref_x, lambda m, v: torch_ckpt(torch_outer(m), v), BF16)
    got = train(model, x, lambda m, v: ferry_ckpt(outer(m), v), BF16)
    assert [torch.equal(a, b) for a, b in zip(want, got)] == [True] * 3
    assert_same_grads(ref, model, [ref_x], [x])


def test_region_that_disables_autocast_replays_without_it():
    # The region's own state is what counts: autocast switched off inside an autocast forward.
    def fp32_region(model):
        def run(v):
            with torch.autocast("cpu", enabled=False):
                return ferry_ckpt(model, v.float())

        return run

    def torch_fp32_region(model):
        def run(v):
            with torch.autocast("cpu", enabled=False):
                return torch_ckpt(model, v.float())

        return run

    ref, model, ref_x, x = twin(MLP, lambda: torch.randn(8, 32))
    want = train(ref, ref_x, lambda m, v: torch_fp32_region(m)(v), BF16)
    got = train(model, x, lambda m, v: fp32_region(m)(v), BF16)
    assert [torch.equal(a, b) for a, b in zip(want, got)] == [True] * 3
    assert_same_grads(ref, model, [ref_x], [x])


def test_backward_leaves_the_callers_autocast_state_as_it_was():
    model = MLP()
    x = torch.randn(8, 32, requires_grad=True)
    with torch.autocast(**BF16):
        loss = loss_of(ferry_ckpt(model, x).float())
    before = (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
    )
    loss.backward()
    after = (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
    )
    assert after == before
    assert not after[0]


def test_replayed_tensors_keep_the_forward_dtype():
    # Without the forward's autocast state the replay would save float32 tensors where the
    # forward saved bfloat16 ones, and the determinism check would refuse them.
    seen = []

    def region(v):
        out = v @ v.t()
        seen.append(out.dtype)
        return out

    x = torch.randn(8, 8, requires_grad=True)
    with torch.autocast(**BF16):  # no early stop: the replay runs to the end of the region
        out = ferry.checkpoint(region, x, use_reentrant=False, early_stop=False)
    out.float().sum().backward()
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert x.grad is not None
