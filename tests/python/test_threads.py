"""Regions survive thread hops: a forward run on one thread and its backward on another (as
CUDA runs backward on its device threads) give the gradients of plain training, with offload,
checkpoint and both, and leave nothing in the session."""

import threading

import pytest
import torch

import ferry
from models import TinyLM, assert_same_grads, loss_of, twin


def on_thread(fn):
    result, error = [], []

    def run():
        try:
            result.append(fn())
        except BaseException as e:  # surfaced on the calling thread
            error.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if error:
        raise error[0]
    return result[0] if result else None


def checkpointed(model, x):
    for block in model.blocks:
        x = ferry.checkpoint(block, x, use_reentrant=False)
    return model.lm_head(model.ln_f(x))


@pytest.mark.parametrize(
    "mode,policy",
    [
        ("offload", "ferry"),
        ("offload", "trl"),
        ("checkpoint", None),
        ("offload+checkpoint", "ferry"),
        ("offload+checkpoint", "trl"),
    ],
)
def test_forward_and_backward_on_different_threads(mode, policy):
    ref, model, ref_x, x = twin(TinyLM, lambda: torch.randn(2, 16, 32))
    ctx = None
    if "offload" in mode:
        ctx = ferry.offload(
            policy=policy, loopback=True, min_bytes=0, window_bytes=0, max_fwd_stash_size=1
        )
        ctx.update_model_params(model)
    forward = checkpointed if "checkpoint" in mode else (lambda m, v: m(v))
    for _ in range(2):
        for m, v in ((ref, ref_x), (model, x)):
            m.zero_grad(set_to_none=True)
            v.grad = None
        loss_of(ref(ref_x)).backward()

        def run_forward():
            if ctx is None:
                return loss_of(forward(model, x))
            with ctx:
                return loss_of(forward(model, x))

        loss = on_thread(run_forward)
        on_thread(loss.backward)
        assert_same_grads(ref, model, [ref_x], [x])
        if ctx is not None:
            assert ctx.tracked() == 0
            assert ctx.live_device_buffers() == 0
