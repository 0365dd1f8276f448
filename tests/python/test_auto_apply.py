"""`ferry.auto` applies every plan it returns. Tiny random Hugging Face models of several
families (decoders, the encoder-only BERT, the encoder-decoder T5 wrapped as a user wraps it
for a step, the vision encoder ViT), built as a user builds them (the config's defaults: a
key/value cache, SDPA, dropout where the family has it; no attention mask), with the loss of
the issue that found the breach (`out.logits.float().mean()`), on the CPU loopback device:

* below the floor `ferry.auto` refuses, naming the floor, a peak above the budget it refused;
* at the floor, at the whole device (no offload) and halfway between their peaks, it returns a
  plan that fits, and one training step under it gives the loss and gradients of plain
  training bit for bit;
* random plans over the same traced ops (each layer a checkpoint region or not, each op kept,
  offloaded or recomputed, a region's inputs kept or offloaded) train bitwise as well: the
  planner picks no offload on models this small, and the matching of real ops to the plan must
  hold for any decisions.

Dropout draws from the random state: both runs of a step start from the same seed.
"""

import copy
import functools
import random

import pytest
import torch
import transformers

import ferry
from ferry import PlanError
from models import assert_same_grads
from traced_families import DEEPSEEK_V3_LAYOUT, decoder_fields

VOCAB = 256
HIDDEN = 64
LAYERS = 4
BATCH, SEQ = 2, 128


def _decoder(config_class, model_class, dtype=torch.float32, experts=None, **extra):
    def make():
        fields = {**decoder_fields(VOCAB, HIDDEN, LAYERS, SEQ), **extra}
        config = config_class(**fields)
        if experts is not None:
            config._experts_implementation = experts
        return model_class(config).to(dtype)

    return make


# Mixture-of-experts decoders: 4 experts, top 2, in float32 and bf16 (transformers' grouped
# matmul experts; the trace runs float32's on bf16 stand-ins, docs/trace.md).
_MOE = {
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    ),
    # DeepSeek-V3's layout: latent attention, a dense first layer, shared and routed experts.
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        DEEPSEEK_V3_LAYOUT,
    ),
}


def _gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=4,
            n_positions=SEQ,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def _bert():
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            intermediate_size=2 * HIDDEN,
            max_position_embeddings=SEQ,
        )
    )


def _llama_without_cache():
    # Without the cache transformers cannot tell on the trace's fake tensors that the sequences
    # are not packed: the trace builds a causal mask and expands K and V for it, where the
    # real forward runs SDPA causal.
    model = _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM)()
    model.config.use_cache = False
    return model


class _T5(torch.nn.Module):
    """An encoder-decoder as a user wraps it for a step: (input ids, decoder input ids)."""

    def __init__(self):
        super().__init__()
        self.t5 = transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=VOCAB,
                d_model=HIDDEN,
                d_kv=HIDDEN // 4,
                d_ff=2 * HIDDEN,
                num_layers=LAYERS,
                num_decoder_layers=LAYERS,
                num_heads=4,
            )
        )

    def forward(self, ids, decoder_ids):
        return self.t5(input_ids=ids, decoder_input_ids=decoder_ids)


def _vit():
    return transformers.ViTForImageClassification(
        transformers.ViTConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            intermediate_size=2 * HIDDEN,
            image_size=32,
            patch_size=4,
            num_labels=10,
        )
    )


def _token_ids():
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)),)


def _seq2seq_ids():
    g = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        torch.randint(0, VOCAB, (BATCH, SEQ // 2), generator=g),
    )


def _images():
    return (torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1)),)


# Each family's inputs of one step, as a tuple (token ids unless named here).
INPUTS = {"t5": _seq2seq_ids, "vit": _images}

FAMILIES = {
    "llama": _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "llama-no-cache": _llama_without_cache,
    "qwen2": _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": _decoder(
        transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=SEQ // 2
    ),
    "phi3": _decoder(transformers.Phi3Config, transformers.Phi3ForCausalLM, pad_token_id=0),
    "gemma2": _decoder(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        head_dim=HIDDEN // 4,
        sliding_window=SEQ // 2,
    ),
    "gpt2": _gpt2,
    "bert": _bert,
    "t5": _T5,
    "vit": _vit,
}
for _name, (_config, _model, _fields) in _MOE.items():
    FAMILIES[_name] = _decoder(_config, _model, **_fields)
    FAMILIES[f"{_name}-bf16"] = _decoder(_config, _model, torch.bfloat16, **_fields)

# The experts as a loop over the experts hit (transformers' "eager" experts): the trace's shapes
# follow its routing assumption (balanced by default), the real step's follow the router. Plans
# over the traced ops still apply bitwise: every expert is hit in both (256 tokens, top 2 of
# 4), and the loop's ops have the same names whichever tokens each expert gets.
EAGER_FAMILIES = {
    "mixtral-eager": _decoder(
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        experts="eager",
        **_MOE["mixtral"][2],
    ),
    "qwen3_moe-eager-bf16": _decoder(
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        torch.bfloat16,
        experts="eager",
        **_MOE["qwen3_moe"][2],
    ),
}
FAMILIES.update(EAGER_FAMILIES)


def loss_fn(out):
    return out.logits.float().mean()


def build(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.train()
    return model, INPUTS.get(family, _token_ids)()


def train_step(model, ids, ctx=None, seed=2):
    """One step on the inputs ``ids`` (a tuple), under ``ctx`` when given."""
    torch.manual_seed(seed)
    if ctx is None:
        loss = loss_fn(model(*ids))
    else:
        with ctx:
            loss = loss_fn(model(*ids))
    loss.backward()
    return loss


@functools.cache
def reference(family):
    """The model and its inputs, and a copy of the model after one step of plain training."""
    base, ids = build(family)
    trained = copy.deepcopy(base)
    loss = train_step(trained, ids)
    return base, ids, trained, loss


def check_bitwise(family, make_ctx):
    """One step of a copy of the family's model under ``make_ctx(model, ids)``: the loss and
    the gradients of plain training, bit for bit; nothing left tracked."""
    base, ids, trained, want = reference(family)
    model = copy.deepcopy(base)
    ctx = make_ctx(model, ids)
    got = train_step(model, ids, ctx)
    assert torch.equal(want, got)
    assert_same_grads(trained, model)
    assert ctx.tracked() == 0
    return ctx


# Each family's step as ferry.auto traced it (test_auto_applies_every_plan_it_returns): the
# random plans below are made over the same document, traced again when that test did not run.
TRACED = {}


def traced_document(family):
    if family not in TRACED:
        base, ids, _, _ = reference(family)
        TRACED[family] = ferry.trace(base, *ids, loss_fn=loss_fn, target="host")
    return TRACED[family].document


def auto(model, ids, budget, traced=None):
    # The simulator's own budgets (the floor, the no-offload peak): no margin below them.
    return ferry.auto(model, *ids, budget=str(budget), margin=0, loss_fn=loss_fn, traced=traced)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_auto_applies_every_plan_it_returns(cli, family):
    base, ids, _, _ = reference(family)
    # No offload (the whole device): traced here, and planned again below from that trace.
    top = check_bitwise(family, lambda model, ids: auto(model, ids, "80GiB"))
    assert not top.plan["regions"] and {op["saved"] for op in top.plan["ops"]} == {"keep"}
    peak = top.plan["predicted"]["peak_reserved_bytes"]
    traced = TRACED[family] = top.traced
    # Below the floor: refused, naming a floor above the budget.
    with pytest.raises(PlanError, match=r"the floor .* is .*\(\d+ bytes\)") as refused:
        auto(copy.deepcopy(base), ids, "1MiB", traced)
    floor = refused.value.floor
    assert 1 << 20 < floor < peak
    # The floor (a peak the planner reached) and between it and the no-offload peak.
    for budget in (floor, (floor + peak) // 2):
        ctx = check_bitwise(
            family, lambda model, ids, budget=budget: auto(model, ids, budget, traced)
        )
        assert ctx.traced is traced
        assert ctx.plan["predicted"]["peak_reserved_bytes"] <= budget
        # Below the no-offload peak the plan checkpoints (nothing offloads on models this
        # small): the regions were applied.
        assert ctx.plan["regions"]
    # One planner made every plan (one device, steps and parallelism).
    assert traced.planners.planners == 1


def random_plan(doc, rng):
    """Each layer's run of ops a region (inputs kept or offloaded; ops kept, offloaded or
    recomputed) or not (ops kept or offloaded); the ops outside layers kept or offloaded. Every
    byte may be offloaded: no minimum size, no window."""
    ops = doc["ops"]
    # A layer's ops in runs: an encoder-decoder numbers its encoder's and decoder's layers
    # alike, so a layer number may have two runs of ops.
    spans = []
    for i, op in enumerate(ops):
        layer = op.get("layer")
        if layer is None:
            continue
        if spans and ops[spans[-1][-1]].get("layer") == layer and spans[-1][-1] == i - 1:
            spans[-1].append(i)
        else:
            spans.append([i])
    decisions = [rng.choice(("keep", "offload")) for _ in ops]
    regions = []
    for span in spans:
        if rng.random() < 0.5:
            continue
        regions.append(
            {"first_op": span[0], "end_op": span[-1] + 1, "inputs": rng.choice(("keep", "offload"))}
        )
        for i in span:
            decisions[i] = rng.choice(("keep", "offload", "recompute"))
    return {
        "format": "ferry.plan/1",
        "model": doc["name"],
        "device": "h100-sxm-pcie5",
        "budget_bytes": 0,
        "knobs": {"min_bytes": 0, "window_bytes": 0},
        "regions": regions,
        "ops": [{"name": op["name"], "saved": d} for op, d in zip(ops, decisions)],
    }


def check_random_plans_bitwise(family, doc, seeds):
    """A random plan of ``doc`` for each seed trains ``family`` bitwise as it trains alone."""
    for seed in seeds:
        plan = random_plan(doc, random.Random(seed))
        try:
            check_bitwise(
                family,
                lambda model, ids, plan=plan: ferry.offload(
                    plan=plan, model=model, loopback=True, dedup=False
                ),
            )
        except Exception as e:
            raise AssertionError(f"{family}: random plan of seed {seed} failed: {e}") from e


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_random_plans_train_bitwise(family):
    doc = traced_document(family)
    index = sorted(FAMILIES).index(family)
    check_random_plans_bitwise(family, doc, (index, len(FAMILIES) + index))


@pytest.mark.parametrize("family", sorted(EAGER_FAMILIES))
def test_plans_over_a_random_routing_train_bitwise(family):
    base, ids, _, _ = reference(family)
    routing = "random,seed=1,capacity=1.25"
    doc = ferry.trace(base, *ids, loss_fn=loss_fn, target="host", routing=routing).document
    assert doc["routing"] == {"assumption": "random", "seed": 1, "capacity_factor": 1.25}
    check_random_plans_bitwise(family, doc, (0, 1))


def test_every_fused_attention_kernel_is_the_call_the_trace_named():
    """The CPU trace names an SDPA call by the CPU's flash kernel; a GPU runs flash, cuDNN's or
    the memory-efficient kernel (by dtype and GPU). A plan finds the call by any of them; other
    ops keep their own names."""
    from ferry._names import OpNames

    aten = torch.ops.aten
    kernels = (
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    )
    name = "model.layers.0.self_attn/_scaled_dot_product_flash_attention_for_cpu"
    assert {OpNames().next("model.layers.0.self_attn", k) for k in kernels} == {(name, name)}
    assert OpNames().next("m", aten.mm.default) == ("m/mm", "m/mm")
