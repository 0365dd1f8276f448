"""Between steps `ferry.simulate` and `ferry.compare` free the gradients by default, as torch's
`optimizer.zero_grad()` has since 2.0 (`set_to_none=True`), and as the Hugging Face `Trainer`'s
`model.zero_grad()` does; `set_to_none=False` (`--keep-grads`) keeps them from set-up on, a
higher peak; Megatron-Core keeps them in its buffers whatever is asked (docs/offload.md)."""

import json
import os
import subprocess

import pytest

import ferry
from ferry_cli import cli

MODEL = "tiny-gpt"
MEGATRON = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def allocated(**options):
    return ferry.simulate(MODEL, **options)["result"]["peak_allocated_bytes"]


def test_the_default_frees_the_gradients_and_keep_grads_keeps_them():
    freed = allocated(policy="none")
    assert freed == allocated(policy="none", set_to_none=True)
    assert allocated(policy="none", set_to_none=False) > freed
    rows = {r["name"]: r for r in ferry.compare(MODEL)["rows"]}
    kept = {r["name"]: r for r in ferry.compare(MODEL, set_to_none=False)["rows"]}
    assert rows["none"]["peak_allocated_bytes"] == freed
    assert kept["none"]["peak_allocated_bytes"] > freed


def test_the_cli_defaults_as_python_does():
    def run(*flags):
        out = subprocess.run(
            [cli(), "simulate", "--model", MODEL, "--policy", "none", "--json", *flags],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["result"]["peak_allocated_bytes"]

    assert run() == allocated(policy="none")
    assert run("--keep-grads") == allocated(policy="none", set_to_none=False)


@pytest.mark.parametrize("set_to_none", [None, True, False])
def test_megatron_keeps_its_gradient_buffers(set_to_none):
    options = {"trainer": "megatron", "trainer_flags": MEGATRON, "set_to_none": set_to_none}
    kept = allocated(trainer="megatron", trainer_flags=MEGATRON, set_to_none=False)
    assert allocated(**options) == kept


def test_the_hf_trainer_frees_them():
    flags = "--activation_checkpointing false"
    freed = allocated(trainer="hf", trainer_flags=flags)
    assert freed == allocated(policy="none")
    assert allocated(trainer="hf", trainer_flags=flags, set_to_none=False) > freed


# --- the peak against torch's own allocations (torch.profiler on the CPU) -------------------
# Two-layer models of several families whose vocabulary (32,000 x 64 or 128 of float32) outweighs
# the rest, so that the step's peak is at the end of backward, where the embedding's gradient
# arrives. Tied, torch holds the head's gradient of the shared weight, the embedding's and their
# sum at once (Note [A parameter's gradients] in sim/src/autograd/trainer_backward.cpp); untied,
# the two weights'. T5 shares its embedding between encoder and decoder as well: three nodes.

VOCAB = 32000


def _model(family):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    small = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    if family in ("llama tied", "llama untied"):
        config = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            num_hidden_layers=2,
            tie_word_embeddings=family == "llama tied",
            **small,
        )
        model = tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    elif family == "qwen2 tied":
        config = tf.Qwen2Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, tie_word_embeddings=True, **small
        )
        model = tf.Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")
    elif family == "gpt2":
        config = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        model = tf.GPT2LMHeadModel(config)
    else:  # t5
        config = tf.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        )  # fmt: skip
        model = tf.T5ForConditionalGeneration(config)
        ids = torch.randint(0, VOCAB, (1, 16))
        return model.train(), {"input_ids": ids, "labels": torch.randint(0, VOCAB, (1, 8))}
    ids = torch.randint(0, VOCAB, (1, 16))
    return model.train(), {"input_ids": ids, "labels": ids}


def _measured_peak(model, inputs, set_to_none):
    """The step's peak allocated bytes: what is live before it (weights, inputs and, kept, the
    gradients) and the most the profiler's allocation records add over that."""
    from torch.profiler import ProfilerActivity, profile

    def step():
        model(**inputs).loss.backward()
        model.zero_grad(set_to_none=set_to_none)

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = over = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        over = max(over, live)
    weights = sum({p.data_ptr(): p.nbytes for p in model.parameters()}.values())
    before = weights * (1 if set_to_none else 2) + sum(t.nbytes for t in inputs.values())
    return before + over


@pytest.fixture(scope="module")
def no_workspace_device(tmp_path_factory):
    """The H100 profile without cuBLAS workspaces, which the CPU has not."""
    from ferry_cli import REPO

    with open(os.path.join(REPO, "scenarios", "devices", "h100-sxm-pcie5.json")) as f:
        profile = json.load(f)
    profile["blas_workspace_bytes"] = 0
    path = tmp_path_factory.mktemp("device") / "cpu-like.json"
    path.write_text(json.dumps(profile))
    return str(path)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["freed", "kept"])
@pytest.mark.parametrize("family", ["llama tied", "llama untied", "qwen2 tied", "gpt2", "t5"])
def test_the_peak_at_the_end_of_backward_is_torchs(no_workspace_device, family, set_to_none):
    model, inputs = _model(family)
    traced = ferry.trace(model, **inputs)
    simulated = ferry.simulate(
        traced, device=no_workspace_device, steps=2, set_to_none=set_to_none
    )["result"]["peak_allocated_bytes"]
    measured = _measured_peak(model, inputs, set_to_none)
    assert abs(simulated - measured) / measured < 0.04, (simulated, measured)
