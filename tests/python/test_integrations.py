"""Trainers' own activation-offloading flags switched to ferry (``ferry.integrations``).

TRL 1.16's ``SFTTrainer`` with ``activation_offloading=True``, after
``ferry.integrations.trl.install()``, trains a tiny Llama on the asynchronous loopback device
with ferry's offloader (its telemetry shows the copies out and back), with the losses and
gradients of TRL's own offloader and of the run without offloading, bit for bit; nothing is
left tracked afterwards; ``uninstall()`` gives TRL's back. Its ``RewardTrainer`` the same way,
against the run without offloading. torchtune 0.6.1's recipe flag
(``enable_activation_offloading``, through ``torchtune.training.get_act_offloading_ctx_manager``)
the same way, with the losses and gradients of the run without offloading (torchtune's own
offloader takes CUDA's default stream when it is made: on a machine without CUDA it cannot run).
accelerate's FSDP2 checkpointing step with its offload flag (``fsdp2_apply_ac``, as
``Accelerator.prepare`` calls it) checkpoints with ferry and offloads each layer's inputs through
a ferry session, with the losses and gradients of accelerate's own (torch's checkpoint inside
``save_on_cpu``). The trainer packages are test dependencies, installed by scripts/setup.sh:
missing is an error."""

import functools
import os
import subprocess
import sys
import types

import accelerate.accelerator
import accelerate.utils
import datasets
import peft
import pytest
import tokenizers
import torch
import transformers
import trl
import trl.models.activation_offloading as trl_offloading
import trl.trainer.sft_trainer
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as checkpoint_wrapper_module

import ferry
from ferry.integrations import accelerate as ferry_accelerate
from ferry.integrations import torchtune as ferry_torchtune
from ferry.integrations import trl as ferry_trl
from offload_runs import Grads, KeepsLosses, assert_equal_runs, assert_every_offload_came_back

SEQ, BATCH, VOCAB, STEPS = 16, 2, 64, 3
HAVE_CUDA = torch.cuda.is_available()
TRL_MODULES = ferry_trl.TRAINER_MODULES
#: torchao for torchtune (scripts/setup.sh), kept off the path of the tests that import peft.
TORCHAO = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", ".venv", "torchtune-torchao"
)


@pytest.fixture(autouse=True)
def leave_them_as_they_were():
    """Every test leaves TRL, torchtune and accelerate with their own offloaders."""
    yield
    ferry_trl.uninstall()
    ferry_torchtune.uninstall()
    ferry_accelerate.uninstall()
    assert accelerate.accelerator.fsdp2_apply_ac is accelerate.utils.fsdp2_apply_ac
    for name in TRL_MODULES:
        module = __import__(name, fromlist=["_"])
        assert (
            module.get_act_offloading_ctx_manager is trl_offloading.get_act_offloading_ctx_manager
        )


def tokenizer():
    """A word-level tokenizer of VOCAB words, made here (nothing is downloaded)."""
    words = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0")
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="w0", pad_token="w1", eos_token="w2"
    )


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            pad_token_id=1,
            eos_token_id=2,
            bos_token_id=3,
        )
    )


class SFTLosses(KeepsLosses, trl.SFTTrainer):
    """An SFTTrainer that keeps each step's loss tensor."""


def sft(tmp_path, activation_offloading, lora=False):
    """The losses and gradients of 3 SFTTrainer steps on token ids, and the trainer."""
    ids = torch.randint(4, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=0.05,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        activation_offloading=activation_offloading,
    )
    grads = Grads()
    trainer = SFTLosses(
        model=llama(),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"input_ids": ids.tolist()}),
        processing_class=tokenizer(),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        if lora
        else None,
        callbacks=[grads],
    )
    trainer.losses = []
    trainer.train()
    return trainer.losses, grads.steps, trainer


def trl_own(monkeypatch):
    """TRL's own offloader as SFTTrainer builds it. Without a CUDA device its copy stream
    cannot be made (torch's CUDA error at construction), so there it runs without streams,
    keeping the host tensors where they are, as TRL does with tensors off the accelerator."""
    if not HAVE_CUDA:
        monkeypatch.setattr(
            trl.trainer.sft_trainer,
            "get_act_offloading_ctx_manager",
            functools.partial(trl_offloading.get_act_offloading_ctx_manager, use_streams=False),
        )


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_trainer_offloads_with_ferry_once_installed(tmp_path, monkeypatch, lora):
    plain = sft(tmp_path, False, lora)
    with monkeypatch.context() as patch:
        trl_own(patch)
        theirs = sft(tmp_path, True, lora)
    assert type(theirs[2].maybe_activation_offload_context) is trl_offloading.OffloadActivations
    assert_equal_runs(plain, theirs, STEPS)

    states = ferry._C._live_checkpoint_states()
    # A zero window: every offloaded tensor comes back through its host copy.
    ferry_trl.install(loopback=True, window_bytes=0)
    assert ferry_trl.installed()
    ours = sft(tmp_path, True, lora)
    ctx = ours[2].maybe_activation_offload_context
    assert isinstance(ctx, ferry.offload)
    assert_equal_runs(theirs, ours, STEPS)
    assert_every_offload_came_back(ctx, states)

    ferry_trl.uninstall()
    assert not ferry_trl.installed()
    with monkeypatch.context() as patch:
        trl_own(patch)
        again = sft(tmp_path, True, lora)
    assert type(again[2].maybe_activation_offload_context) is trl_offloading.OffloadActivations
    assert_equal_runs(theirs, again, STEPS)


class RewardLosses(KeepsLosses, trl.RewardTrainer):
    """A RewardTrainer that keeps each step's loss tensor."""


def reward(tmp_path, activation_offloading):
    """The losses and gradients of 3 RewardTrainer steps on chosen and rejected token ids, and
    the trainer."""
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            pad_token_id=1,
            eos_token_id=2,
            bos_token_id=3,
            num_labels=1,
        )
    )
    ids = torch.randint(
        4, VOCAB, (2, BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1)
    )
    args = trl.RewardConfig(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=0.05,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
        seed=0,
        activation_offloading=activation_offloading,
    )
    grads = Grads()
    trainer = RewardLosses(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict(
            {"chosen_ids": ids[0].tolist(), "rejected_ids": ids[1].tolist()}
        ),
        processing_class=tokenizer(),
        callbacks=[grads],
    )
    trainer.losses = []
    trainer.train()
    return trainer.losses, grads.steps, trainer


def test_reward_trainer_offloads_with_ferry_once_installed(tmp_path):
    plain = reward(tmp_path, False)
    ferry_trl.install(loopback=True)
    ours = reward(tmp_path, True)
    ctx = ours[2].maybe_activation_offload_context
    assert isinstance(ctx, ferry.offload)
    assert_equal_runs(plain, ours, STEPS)
    assert ctx.telemetry()["offloaded"] > 0
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


def test_install_takes_trl_arguments_and_ferry_options():
    ferry_trl.install(loopback=True, policy="trl")
    ctx = trl.trainer.sft_trainer.get_act_offloading_ctx_manager(
        llama(), min_offload_size=1 << 30, warn_if_no_head=False
    )
    with ctx:
        loss = llama()(torch.randint(0, VOCAB, (BATCH, SEQ))).logits.sum()
    loss.backward()
    assert ctx.telemetry()["offloaded"] == 0 and ctx.telemetry()["kept"] > 0  # all under 1 GiB
    ferry_trl.install(loopback=True, min_bytes=0)  # ferry's name for the threshold
    ctx = trl.trainer.sft_trainer.get_act_offloading_ctx_manager(llama())
    with ctx:
        loss = llama()(torch.randint(0, VOCAB, (BATCH, SEQ))).logits.sum()
    loss.backward()
    assert ctx.telemetry()["offloaded"] > 0


def test_every_trainer_with_the_flag_is_switched_and_uninstall_restores_trl():
    ferry_trl.install(loopback=True)
    ferry_trl.install(loopback=True, window_bytes=0)  # again: the options replaced
    for name in ferry_trl.TRAINER_MODULES:
        module = __import__(name, fromlist=["_"])
        ours = module.get_act_offloading_ctx_manager
        assert ours is not trl_offloading.get_act_offloading_ctx_manager
        assert ours.__wrapped__ is trl_offloading.get_act_offloading_ctx_manager
    ferry_trl.uninstall()
    for name in ferry_trl.TRAINER_MODULES:
        module = __import__(name, fromlist=["_"])
        assert (
            module.get_act_offloading_ctx_manager is trl_offloading.get_act_offloading_ctx_manager
        )
    ferry_trl.uninstall()  # a second time: nothing to do


def test_uninstall_leaves_a_name_replaced_since_by_someone_else(monkeypatch):
    ferry_trl.install(loopback=True)

    def theirs(model, **kwargs):
        return None

    monkeypatch.setattr(trl.trainer.sft_trainer, "get_act_offloading_ctx_manager", theirs)
    ferry_trl.uninstall()
    assert trl.trainer.sft_trainer.get_act_offloading_ctx_manager is theirs
    assert not ferry_trl.installed()
    monkeypatch.undo()


def test_install_without_the_package_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(ferry_trl, "TRAINER_MODULES", ("trl.trainer.no_such_trainer",))
    with pytest.raises(ImportError, match=r"ferry.integrations.trl.install\(\): trl.trainer.no_"):
        ferry_trl.install(loopback=True)


def test_torchtune_recipe_flag_offloads_with_ferry_once_installed():
    # torchtune 0.6.1 imports torchao names that torchao 0.16 removed, and peft 0.21.2 refuses
    # a torchao older than 0.16 in the same process: torchtune's checks run in a process of
    # their own, with torchao 0.14.1 from the folder scripts/setup.sh installs it to.
    assert os.path.isdir(TORCHAO), f"{TORCHAO}: missing; run scripts/setup.sh"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TORCHAO, env.get("PYTHONPATH", "")])
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "torchtune_checks.py"],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 passed" in run.stdout, run.stdout


def accelerate_steps(offload_flag):
    """Losses and gradients of 3 SGD steps of a tiny Llama whose decoder layers were
    checkpointed by ``Accelerator.prepare``'s FSDP2 step (``accelerate.accelerator.fsdp2_apply_ac``,
    the name it calls), and the model."""
    plugin = accelerate.utils.FullyShardedDataParallelPlugin(
        fsdp_version=2,
        activation_checkpointing=True,
        activation_checkpointing_offload=offload_flag,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    model = llama()
    plugin.set_auto_wrap_policy(model)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin))
    model = accelerate.accelerator.fsdp2_apply_ac(accelerator, model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for batch in ids:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, model


def test_accelerate_fsdp2_checkpoint_offload_flag_runs_ferry_once_installed():
    theirs = accelerate_steps(True)
    assert isinstance(theirs[2].model.layers[0], checkpoint_wrapper_module.OffloadWrapper)
    states = ferry._C._live_checkpoint_states()
    ferry_accelerate.install(loopback=True, window_bytes=0)
    assert ferry_accelerate.installed()
    ours = accelerate_steps(True)
    assert_equal_runs(theirs, ours, STEPS)
    session = ferry_accelerate.checkpoint_offload(ours[2])
    assert isinstance(session, ferry.offload)
    counts = session.telemetry()
    layers = 2
    assert counts["offloaded"] == layers * STEPS
    assert counts["bytes_d2h"] == layers * STEPS * BATCH * SEQ * 32 * 4
    # Each came back: from the host, or (the last layer's, still on the device when backward
    # begins) from the original.
    from_host = counts["prefetched"] + counts["on_demand"]
    assert from_host + counts["stash_hits"] == counts["offloaded"]
    assert counts["bytes_h2d"] == from_host * BATCH * SEQ * 32 * 4 > 0
    assert session.tracked() == 0 and session.live_device_buffers() == 0
    assert ferry._C._live_checkpoint_states() == states
    # Without the offload flag: ferry's checkpoint alone, no session.
    plain_theirs = accelerate_steps(False)
    wrapped = accelerate_steps(False)
    assert ferry_accelerate.checkpoint_offload(wrapped[2]) is None
    layer = wrapped[2].model.layers[0]
    assert layer.checkpoint_fn.func is ferry.checkpoint
    assert_equal_runs(plain_theirs, wrapped, STEPS)

    ferry_accelerate.uninstall()
    assert not ferry_accelerate.installed()
    again = accelerate_steps(True)
    assert isinstance(again[2].model.layers[0], checkpoint_wrapper_module.OffloadWrapper)
