"""``ferry.enable_gradient_checkpointing`` and the checkpointing flag of ``transformers.Trainer``:
the Trainer enables the model's checkpointing again when ``train()`` starts (with its
``gradient_checkpointing_kwargs``), and the model keeps ferry's checkpoint. A tiny random Llama,
with and without LoRA, trains with the losses and gradients of the same Trainer run with
torch's checkpoint, bit for bit, every checkpointed layer call going through ferry's."""

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

SEQ, BATCH, VOCAB, STEPS, LAYERS = 16, 2, 64, 3, 2


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


class Grads(transformers.TrainerCallback):
    """The gradients of each step, before the optimizer uses them."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append([p.grad.clone() for p in model.parameters() if p.requires_grad])


class Losses(transformers.Trainer):
    """A Trainer that keeps each step's loss tensor (the logged one is rounded)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(loss.detach().clone())
        return loss


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


def train(tmp_path, lora, by_ferry, flags):
    model = llama(lora)
    if by_ferry:
        ferry.enable_gradient_checkpointing(model)
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
    return trainer.losses, grads.steps


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
    (want_losses, want_grads), (got_losses, got_grads) = want, got
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
    assert len(funcs) == 1 and funcs[0].func is ferry.checkpoint
    assert funcs[0].keywords == {
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


def test_the_trainer_offload_flag_is_refused_with_the_way_to_offload():
    model = llama()
    ferry.enable_gradient_checkpointing(model)
    with pytest.raises(ValueError, match="offload=True.*ferry.offload_model"):
        model.activation_checkpointing_enable(offload=True)


def test_a_model_without_checkpointing_is_refused():
    with pytest.raises(ValueError, match="no gradient_checkpointing_enable"):
        ferry.enable_gradient_checkpointing(torch.nn.Linear(2, 2))
