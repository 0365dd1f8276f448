"""``ferry.enable_gradient_checkpointing`` and the checkpointing flag of ``transformers.Trainer``:
the Trainer enables the model's checkpointing again when ``train()`` starts (with its
``gradient_checkpointing_kwargs``), and the model keeps ferry's checkpoint. A tiny random Llama,
with and without LoRA, trains with the losses and gradients of the same Trainer run with
torch's checkpoint, bit for bit, every checkpointed layer call going through ferry's. With the
Trainer's (or the model's) offload flag, each checkpointed layer's input goes through a ferry
offload session, with the losses and gradients of torch's checkpoint without offload, and
nothing is left of the session or the checkpoints after the run."""

import copy
import functools

import peft  # test dependencies, installed by scripts/setup.sh: missing is an error
import pytest
import torch
import transformers
import transformers.modeling_utils
from transformers.modeling_layers import GradientCheckpointingLayer

import ferry
from ferry import _checkpoint
from ferry.testing import planted_offload
from offload_runs import Grads, KeepsLosses

SEQ, BATCH, VOCAB, STEPS, LAYERS = 16, 2, 64, 3, 3


def llama(lora=False):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
    )
    model.config.use_cache = False
    if lora:
        model = peft.get_peft_model(
            model,
            peft.LoraConfig(
                r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0
            ),
        )
    return model


class Losses(KeepsLosses, transformers.Trainer):
    """A Trainer that keeps each step's loss tensor."""


@pytest.fixture
def calls(monkeypatch):
    """Counts the checkpointed calls that go through ferry's checkpoint and through torch's."""
    counts = {"_non_reentrant": 0, "_reentrant": 0, "torch": 0}

    def spy(real, name):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return call

    for name in ("_non_reentrant", "_reentrant"):
        monkeypatch.setattr(_checkpoint, name, spy(getattr(_checkpoint, name), name))
    # What the model's own enable binds (transformers.modeling_utils imports torch's checkpoint).
    monkeypatch.setattr(
        transformers.modeling_utils,
        "checkpoint",
        spy(transformers.modeling_utils.checkpoint, "torch"),
    )
    return counts


def train(tmp_path, lora, by_ferry, flags, **ferry_kwargs):
    """The losses and gradients of 3 Trainer steps, and the model."""
    model = llama(lora)
    if by_ferry:
        ferry.enable_gradient_checkpointing(model, **ferry_kwargs)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=0.05,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        **flags,
    )
    ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    grads = Grads()
    trainer = Losses(
        model=model,
        args=args,
        train_dataset=[{"input_ids": t, "labels": t} for t in ids],
        callbacks=[grads],
    )
    trainer.losses = []
    trainer.train()
    return trainer.losses, grads.steps, model


FLAGS = {
    "gradient_checkpointing": dict(gradient_checkpointing=True),
    "activation_checkpointing-reentrant": dict(
        activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True}
    ),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("flags", list(FLAGS))
def test_the_trainer_flag_keeps_ferry_checkpoint(tmp_path, calls, lora, flags):
    want = train(tmp_path, lora, False, FLAGS[flags])
    assert calls == {"_non_reentrant": 0, "_reentrant": 0, "torch": LAYERS * STEPS}
    calls["torch"] = 0
    got = train(tmp_path, lora, True, FLAGS[flags])
    kind = "_reentrant" if "reentrant" in flags else "_non_reentrant"
    assert calls[kind] == LAYERS * STEPS and calls["torch"] == 0
    assert_equal_runs(want, got)


def assert_equal_runs(want, got):
    """The losses and gradients of two runs are equal, bit for bit."""
    (want_losses, want_grads, _), (got_losses, got_grads, _) = want, got
    assert len(got_losses) == len(want_losses) == STEPS
    for step, (a, b) in enumerate(zip(want_losses, got_losses)):
        assert torch.equal(a, b), f"loss of step {step}"
    assert len(got_grads) == len(want_grads) == STEPS
    for step, (ga, gb) in enumerate(zip(want_grads, got_grads)):
        for i, (a, b) in enumerate(zip(ga, gb)):
            assert torch.equal(a, b), f"gradient {i} of step {step}"


def checkpoint_funcs(model):
    """The checkpoint function of each layer that checkpoints."""
    return [
        m._gradient_checkpointing_func
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
    ]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_enabling_again_merges_its_keywords_over_ferry_ones(lora):
    model = llama(lora)
    session = ferry.offload(loopback=True)
    ferry.enable_gradient_checkpointing(model, context_fn=_checkpoint._no_context, offload=session)
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False}
    )
    funcs = checkpoint_funcs(model)
    assert len(funcs) == LAYERS
    for func in funcs:
        assert isinstance(func, functools.partial) and func.func is ferry.checkpoint
        assert func.keywords == {
            "use_reentrant": False,
            "context_fn": _checkpoint._no_context,
            "offload": session,
            "preserve_rng_state": False,
        }
    # The Trainer's way, every other layer; then without keywords: ferry's own again.
    model.activation_checkpointing_enable(every_n_layers=2)
    funcs = checkpoint_funcs(model)
    assert len(funcs) == 2
    for func in funcs:
        assert func.func is ferry.checkpoint
        assert func.keywords == {
            "use_reentrant": False,
            "context_fn": _checkpoint._no_context,
            "offload": session,
        }
    # Disabled the model's way, enabled again: ferry's.
    model.gradient_checkpointing_disable()
    assert checkpoint_funcs(model) == []
    model.gradient_checkpointing_enable()
    assert [f.func for f in checkpoint_funcs(model)] == [ferry.checkpoint] * LAYERS


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_copy_of_the_model_keeps_ferry_checkpoint_as_its_own(lora):
    model = ferry.enable_gradient_checkpointing(llama(lora))
    twin = copy.deepcopy(model)
    for m in twin.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._gradient_checkpointing_func = None
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    for copied, use_reentrant in ((twin, True), (model, False)):
        funcs = checkpoint_funcs(copied)
        assert [f.func for f in funcs] == [ferry.checkpoint] * LAYERS
        assert [f.keywords for f in funcs] == [{"use_reentrant": use_reentrant}] * LAYERS


#: The Trainer's offload flag, each with the same run without it (torch's checkpoint, nothing
#: offloaded) and the number of layers that checkpoint.
OFFLOAD_FLAGS = {
    "gradient_checkpointing": (
        dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"offload": True}),
        dict(gradient_checkpointing=True),
        LAYERS,
    ),
    "activation_checkpointing-reentrant": (
        dict(
            activation_checkpointing=True,
            activation_checkpointing_kwargs={"offload": True, "use_reentrant": True},
        ),
        dict(
            activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True}
        ),
        LAYERS,
    ),
    "every_n_layers": (
        dict(
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"offload": True, "every_n_layers": 2},
        ),
        dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 2}),
        2,  # layers 0 and 2
    ),
}

#: Bytes of one layer's input: the hidden states, fp32.
INPUT_BYTES = BATCH * SEQ * 32 * 4


def assert_offloaded(counts, first_kept, layers, reloads):
    """Each checkpointed layer's input went through the session: offloaded and brought back
    (``reloads``: the counters that count it coming back). ``first_kept``: under LoRA the
    first layer's input is the embeddings' output made a leaf that requires grad (transformers'
    enable_input_require_grads, the embeddings being frozen), and the non-reentrant checkpoint
    hands it to the session as it is: the session keeps such a tensor, as it keeps parameters
    (copying it out would free nothing: its gradient accumulator, which the graph holds, holds
    it; docs/real.md, "Hugging Face Trainer"). The reentrant one saves it through its autograd
    Function, an input like any other."""
    kept = STEPS if first_kept else 0
    assert counts["packed"] == layers * STEPS
    assert counts["kept"] == kept
    assert counts["offloaded"] == layers * STEPS - kept
    assert counts["bytes_d2h"] == counts["offloaded"] * INPUT_BYTES
    assert sum(counts[name] for name in reloads) == counts["offloaded"]


def assert_left_empty(session, states):
    """Nothing is left of the run: no tracked tensor, no device buffer, no checkpoint state."""
    assert session.tracked() == 0
    assert session.live_device_buffers() == 0
    assert ferry._C._live_checkpoint_states() == states


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("flags", list(OFFLOAD_FLAGS))
def test_the_trainer_offload_flag_offloads_each_checkpointed_layer_input(
    tmp_path, calls, lora, flags
):
    with_offload, without, layers = OFFLOAD_FLAGS[flags]
    states = ferry._C._live_checkpoint_states()
    want = train(tmp_path, lora, False, without)
    calls["torch"] = 0
    got = train(tmp_path, lora, True, with_offload)
    kind = "_reentrant" if "reentrant" in flags else "_non_reentrant"
    assert calls[kind] == layers * STEPS and calls["torch"] == 0
    assert_equal_runs(want, got)
    # The session the model owns took each checkpointed layer's input, and gave it back.
    session = ferry.gradient_checkpointing_offload(got[2])
    assert isinstance(session, ferry.offload)
    first_kept = lora and "reentrant" not in flags
    reloads = ("prefetched", "on_demand", "stash_hits")
    assert_offloaded(session.telemetry(), first_kept, layers, reloads)
    assert_left_empty(session, states)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_offload_flag_uses_the_session_given_to_ferry(tmp_path, lora):
    # A zero window: an input whose copy is done leaves the device, and comes back from the
    # host (all but the last one of each forward, still on the device when backward begins).
    session = ferry.offload(loopback=True, window_bytes=0)
    with_offload, without, layers = OFFLOAD_FLAGS["gradient_checkpointing"]
    states = ferry._C._live_checkpoint_states()
    want = train(tmp_path, lora, False, without)
    got = train(tmp_path, lora, True, with_offload, offload=session)
    assert_equal_runs(want, got)
    assert ferry.gradient_checkpointing_offload(got[2]) is None  # the model made none
    counts = session.telemetry()
    assert_offloaded(counts, lora, layers, ("prefetched", "on_demand", "stash_hits"))
    from_host = counts["prefetched"] + counts["on_demand"]
    assert from_host > 0 and counts["bytes_h2d"] == from_host * INPUT_BYTES
    assert_left_empty(session, states)


def sgd_steps(model, ids):
    """Losses and gradients of plain SGD steps, one batch a step."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    losses, grads = [], []
    for batch in ids.split(BATCH):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, model


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "enable",
    [
        lambda m: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"offload": True}),
        lambda m: m.activation_checkpointing_enable(offload=True),
        lambda m: m.activation_checkpointing_enable(None, 1, True),
        lambda m: ferry.enable_gradient_checkpointing(m, offload=True),
    ],
    ids=["in-kwargs", "keyword", "positional", "ferry"],
)
def test_the_model_offload_flag_in_each_spelling(enable):
    ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    reference = llama()
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want = sgd_steps(reference, ids)
    model = ferry.enable_gradient_checkpointing(llama())
    states = ferry._C._live_checkpoint_states()
    enable(model)
    got = sgd_steps(model, ids)
    assert_equal_runs(want, got)
    session = ferry.gradient_checkpointing_offload(model)
    assert session.telemetry()["offloaded"] == LAYERS * STEPS
    assert_left_empty(session, states)
    # Enabled again without the flag: ferry's checkpoint alone, the session kept for later.
    model.activation_checkpointing_enable()
    assert [f.func for f in checkpoint_funcs(model)] == [ferry.checkpoint] * LAYERS
    assert ferry.gradient_checkpointing_offload(model) is session


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_copy_of_the_model_offloads_through_a_session_of_its_own():
    ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    model = ferry.enable_gradient_checkpointing(llama(), offload=True)
    twin = copy.deepcopy(model)
    want = sgd_steps(model, ids)
    got = sgd_steps(twin, ids)
    assert_equal_runs(want, got)
    ours, theirs = (
        ferry.gradient_checkpointing_offload(model),
        ferry.gradient_checkpointing_offload(twin),
    )
    assert ours is not theirs
    assert ours.telemetry()["offloaded"] == theirs.telemetry()["offloaded"] == LAYERS * STEPS
    # A session the caller gave is the caller's: the copy uses it too.
    session = ferry.offload(loopback=True)
    model = ferry.enable_gradient_checkpointing(llama(), offload=session)
    model.activation_checkpointing_enable(offload=True)
    sgd_steps(copy.deepcopy(model), ids)
    assert session.telemetry()["offloaded"] == LAYERS * STEPS


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_planted_reload_fault_in_the_flag_session_gives_wrong_gradients():
    """The comparison with torch's checkpoint can fail for the offload flag's path: with the
    session's compute-stream wait for reloads dropped, the recomputation reads an input before
    its copy back has landed, on the asynchronous loopback device."""
    ids = torch.randint(0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    reference = llama()
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    want = sgd_steps(reference, ids)

    def run(faults, seed):
        options = dict(
            loopback=True,
            window_bytes=0,
            loopback_streams="async",
            loopback_seed=seed,
            loopback_max_delay_us=20000,
        )
        session = planted_offload(faults=faults, **options) if faults else ferry.offload(**options)
        model = ferry.enable_gradient_checkpointing(llama(), offload=session)
        model.activation_checkpointing_enable(offload=True)
        return sgd_steps(model, ids)

    def right(got):
        return all(torch.equal(a, b) for a, b in zip(want[0], got[0])) and all(
            torch.equal(a, b) for ga, gb in zip(want[1], got[1]) for a, b in zip(ga, gb)
        )

    for seed in range(1, 11):
        assert right(run((), seed)), f"seed {seed} without the fault"
        if not right(run(("skip_reload_wait",), seed)):
            return
    pytest.fail("skip_reload_wait gave torch's gradients with ten seeds")


def test_an_offload_flag_that_is_not_a_bool_is_refused():
    model = ferry.enable_gradient_checkpointing(llama())
    with pytest.raises(TypeError, match=r"offload=\.\.\.\) is the model's flag, True or False"):
        model.activation_checkpointing_enable(offload="yes")


def test_the_session_of_a_model_without_ferry_checkpointing_is_refused():
    with pytest.raises(ValueError, match="call ferry.enable_gradient_checkpointing"):
        ferry.gradient_checkpointing_offload(llama())


def test_a_model_without_checkpointing_is_refused():
    with pytest.raises(ValueError, match="no gradient_checkpointing_enable"):
        ferry.enable_gradient_checkpointing(torch.nn.Linear(2, 2))
