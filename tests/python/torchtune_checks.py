"""torchtune 0.6.1's recipe flag ``enable_activation_offloading`` switched to ferry: run by
``test_integrations.py`` in a process of its own, with torchao 0.14.1 on the path (peft, which
the other tests import, refuses that torchao). A recipe gets its offload context from
``training.get_act_offloading_ctx_manager(model, flag)``; after
``ferry.integrations.torchtune.install()`` a tiny torchtune Llama 3 trains 3 SGD steps in
ferry's offloader on the asynchronous loopback device, with the losses and gradients of the run
without offloading, bit for bit (torchtune's own offloader takes CUDA's default stream when it is
made: on a machine without CUDA it cannot run), and ``uninstall()`` gives torchtune's back."""

import pytest
import torch
import torchtune.models.llama3
import torchtune.training
from torchtune.training import _activation_offloading as torchtune_offloading

import ferry
from ferry.integrations import torchtune as ferry_torchtune
from offload_runs import assert_equal_runs, assert_every_offload_came_back

SEQ, BATCH, VOCAB, STEPS = 16, 2, 64, 3


@pytest.fixture(autouse=True)
def leave_it_as_it_was():
    yield
    ferry_torchtune.uninstall()
    assert (
        torchtune.training.get_act_offloading_ctx_manager
        is torchtune_offloading.get_act_offloading_ctx_manager
    )


def torchtune_steps(offloading):
    """Losses and gradients of 3 SGD steps of a tiny torchtune Llama 3, the forward inside the
    context a recipe gets from ``training.get_act_offloading_ctx_manager``, and the context."""
    torch.manual_seed(0)
    model = torchtune.models.llama3.llama3(
        vocab_size=VOCAB,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=32,
        max_seq_len=SEQ,
        intermediate_dim=64,
    )
    ctx = offloading(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for batch in ids:
        with ctx:
            logits = model(batch)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1)
        )
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, ctx


def test_torchtune_recipe_flag_offloads_with_ferry_once_installed():
    def recipe(model):  # as the recipes call it: training.get_act_offloading_ctx_manager
        return torchtune.training.get_act_offloading_ctx_manager(model, True)

    plain = torchtune_steps(
        lambda model: torchtune.training.get_act_offloading_ctx_manager(model, False)
    )
    states = ferry._C._live_checkpoint_states()
    ferry_torchtune.install(loopback=True, window_bytes=0)
    assert ferry_torchtune.installed()
    ours = torchtune_steps(recipe)
    ctx = ours[2]
    assert isinstance(ctx, ferry.offload)
    assert_equal_runs(plain, ours, STEPS)
    assert_every_offload_came_back(ctx, states)

    ferry_torchtune.uninstall()
    assert not ferry_torchtune.installed()
    assert (
        torchtune.training.get_act_offloading_ctx_manager
        is torchtune_offloading.get_act_offloading_ctx_manager
    )


def test_the_flag_off_keeps_torchtune_null_context():
    ferry_torchtune.install(loopback=True)
    ctx = torchtune.training.get_act_offloading_ctx_manager(torch.nn.Linear(2, 2), False)
    assert not isinstance(ctx, ferry.offload)
    with ctx:
        pass
