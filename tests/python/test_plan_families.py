"""The planner and the ferry policy on traced Hugging Face models of seven families.

For Qwen2, Mistral, Phi-3, Gemma-2, GPT-2 and the mixtures of experts Mixtral-8x7B and
Qwen3-30B-A3B (each config as its model card gives it, cut to
four layers, traced at sequence 1024 with AdamW state), on three device
profiles, and at budgets of 1.0x, 1.1x and 1.3x the peak reserved of checkpointing every layer:

* the plan is never slower than the fastest row of `ferry compare --keep-grads` (the gradients
  held, as the planner holds them) that fits the budget (0.5 % slack), is hazard-free and peaks
  within the budget (docs/plan.md);
* the `ferry` row is no slower than `trl`, and `ferry + checkpoint` is at most 1.02x
  checkpointing every layer (docs/offload.md, "The offload horizon", "Tensors in flight")
  (plan_checks.py).

The models are traced in this process (no download: configs written here); the CLI is the one
`python -m ferry` finds (FERRY_CLI in CI). The presets' cases are test_plan_presets.py (a module
of their own, which another pytest worker can take: --dist loadscope gives a module to one).
"""

import json
import os

import pytest

from ferry._cli import trace as trace_cli
from plan_checks import DEVICES, check_plans_and_rows
from traced_families import GEMMA2_2B

BUNDLED = trace_cli.CONFIG_DIR

# Phi-3-mini-4k as its model card's config.json gives it (layers cut below); Gemma-2-2b's is
# traced_families.GEMMA2_2B.
PHI3 = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 32,
    "vocab_size": 32064,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "sliding_window": 2047,
    "attention_dropout": 0.0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "pad_token_id": 32000,
    "bos_token_id": 1,
    "eos_token_id": 32000,
}


def _bundled(name):
    with open(os.path.join(BUNDLED, name + ".json"), encoding="utf-8") as f:
        return json.load(f)


# family -> (config, attention implementation); Gemma-2 has no SDPA path in transformers.
FAMILIES = {
    "qwen2": (lambda: _bundled("qwen2.5-7b"), "sdpa"),
    "mistral": (lambda: _bundled("mistral-7b"), "sdpa"),
    "phi3": (lambda: dict(PHI3), "sdpa"),
    "gemma2": (lambda: dict(GEMMA2_2B), "eager"),
    "gpt2": (lambda: _bundled("gpt2"), "eager"),
    # Mixtures of experts (transformers' grouped matmul experts).
    "mixtral": (lambda: _bundled("mixtral-8x7b"), "sdpa"),
    "qwen3_moe": (lambda: _bundled("qwen3-30b-a3b"), "sdpa"),
}


def _four_layers(config):
    key = "n_layer" if "n_layer" in config else "num_hidden_layers"
    config[key] = 4
    return config


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """family -> the traced model's path."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, (config, attention) in FAMILIES.items():
        cfg = root / f"{family}.json"
        cfg.write_text(json.dumps(_four_layers(config())))
        model = root / f"{family}.model.json"
        status = trace_cli.main(
            [
                str(cfg),
                "--seq",
                "1024",
                "--batch",
                "1",
                "--dtype",
                "bf16",
                "--optimizer",
                "adamw",
                "--attention",
                attention,
                "--out",
                str(model),
            ]
        )
        assert status == 0, family
        out[family] = str(model)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plan_never_loses_to_a_fixed_row_and_ferry_to_trl(cli, traced, family, device):
    check_plans_and_rows(cli, traced[family], family, device)
