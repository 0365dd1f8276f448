"""Tiny Hugging Face models of the families the trace tests cover, built from `transformers`
configs on the meta device (nothing downloaded), and the traced models the C++ tests read; the
config fields of a tiny decoder and of DeepSeek-V3's layout serve the other tests' models too.

`python tests/python/traced_families.py` rewrites `tests/data/traced/<family>.json` (the traced
models `tests/unit/op_sac_test.cpp` checks op-sac on) and `tests/data/traced/sized/<family>.json`
(the published configs cut to two layers, at sizes where activations weigh: the exhaustive plan
tests of `tests/prop/plan_options_prop.cpp` and `tests/unit/plan_templates_test.cpp`);
`test_op_kinds.py` fails when a fresh trace no longer lists the same ops.
"""

import json
import os
import sys

import torch

#: The fixtures' directory.
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "traced")
#: The sized fixtures' directory.
SIZED_FIXTURES = os.path.join(FIXTURES, "sized")

_DECODER = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}


def decoder_fields(vocab, hidden, layers, seq):
    """A tiny Hugging Face decoder's config fields: `layers` layers `hidden` wide with 4
    attention heads, 2 key/value heads and an MLP twice as wide, a vocabulary of `vocab` and
    positions up to `seq`."""
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 2 * hidden,
        "max_position_embeddings": seq,
    }


#: DeepSeek-V3's layout, tiny, as config fields over a decoder's: multi-head latent attention
#: (low-rank Q and KV, a rotary part of each head apart), a dense first layer, then shared and
#: routed experts with a sigmoid router.
DEEPSEEK_V3_LAYOUT = {
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 32,
}

#: family -> (model_type, config fields, attention implementation). Gemma-2 has no SDPA path
#: in transformers 5 (its logit soft-capping); GPT-2 runs eager, as the `tiny-gpt` preset does.
FAMILIES = {
    "llama": ("llama", {**_DECODER, "tie_word_embeddings": True}, "sdpa"),
    "qwen2": ("qwen2", dict(_DECODER), "sdpa"),
    "mistral": ("mistral", {**_DECODER, "sliding_window": None}, "sdpa"),
    "gemma2": ("gemma2", {**_DECODER, "head_dim": 16}, "eager"),
    "gpt2": (
        "gpt2",
        {
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "vocab_size": 512,
            "n_positions": 256,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
        "eager",
    ),
    "mixtral": ("mixtral", {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}, "sdpa"),
    "qwen3_moe": (
        "qwen3_moe",
        {
            **_DECODER,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
        "sdpa",
    ),
    "deepseek_v3": ("deepseek_v3", {**_DECODER, **DEEPSEEK_V3_LAYOUT}, "sdpa"),
}

#: The mixture-of-experts families.
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")

#: The families written as fixtures for the C++ op-sac test.
FIXTURE_FAMILIES = ("llama", "qwen2", "mistral", "gemma2", "gpt2")
#: The fixtures' batch and sequence (GPT-2 at the `tiny-gpt` preset's).
SHAPES = {"gpt2": (2, 128)}
DEFAULT_SHAPE = (1, 32)


#: Gemma-2-2b as its model card's config.json gives it.
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "num_hidden_layers": 26,
    "vocab_size": 256000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

#: google/flan-t5-base's config.json: an encoder-decoder of 12 + 12 blocks 768 wide, gated-GELU
#: feed-forward layers and relative position buckets.
FLAN_T5_BASE = {
    "architectures": ["T5ForConditionalGeneration"],
    "model_type": "t5",
    "is_encoder_decoder": True,
    "d_model": 768,
    "d_ff": 2048,
    "d_kv": 64,
    "num_heads": 12,
    "num_layers": 12,
    "num_decoder_layers": 12,
    "vocab_size": 32128,
    "n_positions": 512,
    "feed_forward_proj": "gated-gelu",
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "layer_norm_epsilon": 1e-06,
    "dropout_rate": 0.1,
    "initializer_factor": 1.0,
    "tie_word_embeddings": False,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
    "eos_token_id": 1,
}

#: family -> (published config: a bundled one's name or a dict, attention implementation,
#: batch, sequence, extra trace arguments) of the sized fixtures: each config cut to two
#: layers (an encoder-decoder to one block a stack), traced in bf16 with AdamW's state, at a
#: sequence its positions allow; the mixture of experts with seeded random routing at capacity
#: 1.25.
SIZED = {
    "llama": ("llama3-8b", "sdpa", 1, 4096, ()),
    "qwen2": ("qwen2.5-7b", "sdpa", 1, 4096, ()),
    "mistral": ("mistral-7b", "sdpa", 1, 4096, ()),
    "gemma2": (GEMMA2_2B, "eager", 1, 4096, ()),
    "gpt2": ("gpt2", "eager", 8, 1024, ()),
    "mixtral": ("mixtral-8x7b", "sdpa", 1, 4096, ("--routing", "random,seed=1,capacity=1.25")),
    "t5": (FLAN_T5_BASE, "sdpa", 8, 512, ()),
}

#: The config fields that count an encoder-decoder's blocks, each stack's.
_STACK_COUNTS = (("num_layers", "num_decoder_layers"), ("encoder_layers", "decoder_layers"))


def cut_to_two_layers(config):
    """``config`` with two layers: a decoder's two blocks, an encoder-decoder's one block a
    stack."""
    config = dict(config)
    for keys in _STACK_COUNTS:
        if all(key in config for key in keys):
            config.update(dict.fromkeys(keys, 1))
            return config
    config["n_layer" if "n_layer" in config else "num_hidden_layers"] = 2
    return config


#: The families with a sized fixture (tests/data/traced/sized).
SIZED_FAMILIES = tuple(SIZED)


def build(family, dtype=torch.bfloat16, experts=None, overrides=None):
    """The family's causal LM on the meta device, in training mode; ``experts`` names the
    experts' implementation of a mixture-of-experts family (``"grouped_mm"``, transformers'
    default, or ``"eager"``, a loop over the experts hit); ``overrides``, config fields that
    replace the family's."""
    import transformers

    model_type, fields, attention = FAMILIES[family]
    config = transformers.AutoConfig.for_model(model_type, **{**fields, **(overrides or {})})
    implementations = {"attn_implementation": attention}
    if experts is not None:
        implementations["experts_implementation"] = experts
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, **implementations)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).train()


def trace_family(
    family,
    batch=None,
    seq=None,
    dtype=torch.bfloat16,
    experts=None,
    routing="balanced",
    overrides=None,
):
    """The traced model of one training step with token ids as labels (``overrides``: config
    fields that replace the family's)."""
    from ferry._trace import trace

    default_batch, default_seq = SHAPES.get(family, DEFAULT_SHAPE)
    batch, seq = batch or default_batch, seq or default_seq
    model = build(family, dtype, experts, overrides)
    with torch.device("meta"):
        ids = torch.zeros((batch, seq), dtype=torch.long)
    name = f"{family}-tiny-s{seq}-b{batch}"
    return trace(model, ids, labels=ids, name=name, routing=routing)


def fixture_path(family):
    return os.path.join(FIXTURES, f"{family}.json")


def compact_json(document):
    """The document with one tensor or op a line: the fixtures' form (a third of the indented
    one's bytes)."""

    def line(value):
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True)

    parts = []
    for key, value in document.items():
        if key in ("tensors", "ops"):
            rows = ",\n".join(line(v) for v in value)
            parts.append(f"{line(key)}:[\n{rows}\n]")
        else:
            parts.append(f"{line(key)}:{line(value)}")
    return "{" + ",\n".join(parts) + "}\n"


def sized_path(family):
    return os.path.join(SIZED_FIXTURES, f"{family}.json")


def trace_sized(family, tmp_dir):
    """The sized fixture of ``family`` as ``python -m ferry trace`` writes it (the config
    written under ``tmp_dir``), as a document."""
    from ferry._cli import trace as trace_cli

    config, attention, batch, seq, extra = SIZED[family]
    if isinstance(config, str):
        with open(os.path.join(trace_cli.CONFIG_DIR, config + ".json"), encoding="utf-8") as f:
            config = json.load(f)
    config = cut_to_two_layers(config)
    cfg = os.path.join(tmp_dir, f"{family}.json")
    out = os.path.join(tmp_dir, f"{family}.model.json")
    with open(cfg, "w", encoding="utf-8") as f:
        json.dump(config, f)
    args = [cfg, "--seq", str(seq), "--batch", str(batch), "--dtype", "bf16"]
    args += ["--optimizer", "adamw", "--attention", attention, "--out", out, *extra]
    if trace_cli.main(args) != 0:
        raise RuntimeError(f"tracing the sized {family} failed")
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def main(argv):
    import tempfile

    os.makedirs(SIZED_FIXTURES, exist_ok=True)
    for family in argv or SIZED_FAMILIES:
        if family in FIXTURE_FAMILIES:
            with open(fixture_path(family), "w", encoding="utf-8", newline="\n") as f:
                f.write(compact_json(trace_family(family).document))
            print(fixture_path(family))
        with (
            tempfile.TemporaryDirectory() as tmp,
            open(sized_path(family), "w", encoding="utf-8", newline="\n") as f,
        ):
            f.write(compact_json(trace_sized(family, tmp)))
        print(sized_path(family))


if __name__ == "__main__":
    main(sys.argv[1:])
