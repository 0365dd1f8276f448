"""ferry's predictions against a published GPU measurement (docs/validation.md, "Against
published GPU measurements"): torchtune's Llama 3.2 3B on one A100, batch 2, sequence 4096.

The config (as Llama-3.2-3B's model card gives it) is traced here, `ferry compare` runs it on
the a100-pcie4 profile with the gradients freed between steps as torchtune's recipe frees them,
and the predictions stay within the stated tolerances of what torchtune measured: eager peak
memory and throughput, and the time checkpointing and then offloading add.
"""

import json
import subprocess

import pytest

from ferry._cli import trace as trace_cli
from ferry_cli import cli as ferry_cli

GIB = 1 << 30
TOKENS = 2 * 4096
LLAMA_3_2_3B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# torchtune README, "Optimization flags": (peak active GiB, tokens per second).
EAGER = (60.0, 7075)
COMPILED = (42.9, 9174)
CHECKPOINTED = (24.9, 7210)
FUSED_OPTIMIZER = (23.1, 7309)
OFFLOADED = (21.8, 7301)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    cli = ferry_cli()
    root = tmp_path_factory.mktemp("published")
    config = root / "llama-3.2-3b.json"
    config.write_text(json.dumps(LLAMA_3_2_3B))
    model = root / "model.json"
    assert (
        trace_cli.main(
            [
                str(config),
                "--seq",
                "4096",
                "--batch",
                "2",
                "--dtype",
                "bf16",
                # torchtune's recipe configurations step AdamW with `fused: True`.
                "--optimizer",
                "adamw-fused",
                # torchtune's attention copies the 8 key and value heads to all 24 query heads
                # before the kernel, which saves the copies (docs/validation.md, row 1).
                "--attention",
                "sdpa-repeat-kv",
                "--out",
                str(model),
            ]
        )
        == 0
    )
    # torchtune's recipe frees the gradients after each step (zero_grad(set_to_none=True)),
    # torch's default and the simulator's.
    run = subprocess.run(
        [cli, "compare", "--model", str(model), "--device", "a100-pcie4", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    rows = {r["name"]: r for r in json.loads(run.stdout)["rows"]}
    # torchtune's own offloader (its first release, policy trl-seed: a forward stash of 5
    # tensors, reloads on demand). Its recipe runs the model under it, the output head under
    # NoOpManager (the trace marks the head so), and the loss after it: the ops after the head
    # keep their saved tensors too.
    traced = json.loads(model.read_text())
    head = max(i for i, op in enumerate(traced["ops"]) if op.get("no_offload"))
    for op in traced["ops"][head + 1 :]:
        op["no_offload"] = True
    as_torchtune = root / "model-loss-outside.json"
    as_torchtune.write_text(json.dumps(traced))
    run = subprocess.run(
        [cli, "simulate", "--model", str(as_torchtune), "--device", "a100-pcie4", "--json"]
        + ["--policy", "trl-seed", "--checkpoint", "every:1", "--no-checker"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    rows["torchtune offload"] = json.loads(run.stdout)["result"]
    return rows


def test_eager_memory_within_3_percent(rows):
    predicted = rows["none"]["peak_allocated_bytes"] / GIB
    assert abs(predicted - EAGER[0]) <= 0.03 * EAGER[0], predicted


def test_eager_throughput_within_8_percent(rows):
    predicted = TOKENS / (rows["none"]["step_time_ns"] / 1e9)
    assert abs(predicted - EAGER[1]) <= 0.08 * EAGER[1], predicted


def test_checkpointing_costs_what_it_measured_within_4_percent(rows):
    """Row 3: 3.4 % under the measured ratio, outside the 2 % target (docs/validation.md)."""
    predicted = rows["checkpoint every layer"]["step_time_ns"] / rows["none"]["step_time_ns"]
    measured = COMPILED[1] / CHECKPOINTED[1]
    assert abs(predicted - measured) <= 0.04 * measured, (predicted, measured)


def test_offloading_checkpointed_inputs_costs_what_it_measured_within_1_percent(rows):
    every = rows["checkpoint every layer"]
    offloaded = rows["ferry + checkpoint"]
    predicted = offloaded["step_time_ns"] / every["step_time_ns"]
    measured = FUSED_OPTIMIZER[1] / OFFLOADED[1]
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)
    # And it saves memory, as measured (less of it: docs/validation.md says why).
    assert offloaded["peak_allocated_bytes"] < every["peak_allocated_bytes"]


def test_offloading_as_torchtune_holds_saves_the_memory_it_measured_within_2_percent(rows):
    """torchtune's offloader (policy trl-seed) with the loss outside it, as torchtune's recipe
    runs it: the memory saved is within 2 % of the 1.3 GiB measured, at the time it measured
    within 1 %."""
    every = rows["checkpoint every layer"]
    offloaded = rows["torchtune offload"]
    saved = (every["peak_allocated_bytes"] - offloaded["peak_allocated_bytes"]) / GIB
    measured = FUSED_OPTIMIZER[0] - OFFLOADED[0]
    assert abs(saved - measured) <= 0.02 * measured, (saved, measured)
    ratio = offloaded["step_time_ns"] / every["step_time_ns"]
    assert abs(ratio - FUSED_OPTIMIZER[1] / OFFLOADED[1]) <= 0.01, ratio
