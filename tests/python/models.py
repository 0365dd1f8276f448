"""Tiny models and the gradient comparison the tests share."""

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn

from ferry.examples._gpt import Block as ExampleBlock


class MLP(nn.Module):
    def __init__(self, d=32, hidden=64):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(F.gelu(self.fc1(x)))))


class Block(ExampleBlock):
    """The example GPT's pre-LayerNorm block (causal self-attention written out by hand), with
    small defaults."""

    def __init__(self, d=32, heads=4, max_len=16):
        super().__init__(d, heads, max_len)


class TinyLM(nn.Module):
    """Two blocks and an `lm_head`, the shape offload_model looks for."""

    def __init__(self, d=32, vocab=48):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_of(out):
    return out.square().mean()


def assert_same_grads(ref_model, model, ref_inputs=(), inputs=()):
    """Every parameter and input gradient bitwise equal."""
    ref_params = dict(ref_model.named_parameters()) if ref_model is not None else {}
    params = dict(model.named_parameters()) if model is not None else {}
    assert ref_params.keys() == params.keys()
    for name, p in params.items():
        r = ref_params[name]
        assert (r.grad is None) == (p.grad is None), name
        if r.grad is not None:
            assert torch.equal(r.grad, p.grad), f"gradient of {name} differs"
    for i, (r, x) in enumerate(zip(ref_inputs, inputs)):
        assert r.grad is not None and x.grad is not None, f"input {i} has no gradient"
        assert torch.equal(r.grad, x.grad), f"gradient of input {i} differs"


def twin(make_model, make_input, seed=0):
    """A model and input, and an identical copy of both (weights copied, not re-drawn)."""
    torch.manual_seed(seed)
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_x = make_input().requires_grad_()
    x = ref_x.detach().clone().requires_grad_()
    return ref, model, ref_x, x


def step(model, x, ctx=None, loss=loss_of):
    """One forward (under `ctx` when given) and backward; returns the loss."""
    with ctx if ctx is not None else contextlib.nullcontext():
        value = loss(model(x))
    value.backward()
    return value


def check_against_plain(make_model, make_input, ctx, steps=1, device="cpu"):
    """Trains a copy of a model under `ctx` and without it; every step's grads match bitwise."""
    ref, model, ref_x, x = twin(make_model, make_input)
    ref, model = ref.to(device), model.to(device)
    ref_x = ref_x.detach().to(device).requires_grad_()
    x = x.detach().to(device).requires_grad_()
    for _ in range(steps):
        for m, inp in ((ref, ref_x), (model, x)):
            m.zero_grad(set_to_none=True)
            inp.grad = None
        ref_loss = step(ref, ref_x)
        got_loss = step(model, x, ctx)
        assert torch.equal(ref_loss, got_loss)
        assert_same_grads(ref, model, [ref_x], [x])
    return model


def tiny_bert():
    """A Hugging Face BERT masked LM of 2 layers, hidden 64, 4 heads, MLP 128, vocabulary 512."""
    import transformers

    config = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=256,
    )
    return transformers.BertForMaskedLM(config)


def trace_for_offload_activations(model, ids, path):
    """A causal LM's step as a benchmark that enters TRL's OffloadActivations itself runs it
    (`model(input_ids, logits_to_keep=1)`, `logits.float().mean()` as the loss), traced to `path`
    with every op offloadable: the trace marks the output head's saved tensors for the
    NoOpManager of TRL's get_act_offloading_ctx_manager, which such a benchmark does not enter."""
    import json

    import ferry

    traced = ferry.trace(
        model, input_ids=ids, logits_to_keep=1, loss_fn=lambda out: out.logits.float().mean()
    )
    traced.save(str(path))
    document = json.loads(path.read_text())
    for op in document["ops"]:
        op.pop("no_offload", None)
    path.write_text(json.dumps(document))
    return path


def bf16_causal_lm(config, device="meta", seed=None):
    """The causal LM of a transformers `config` built in bfloat16 on `device` with SDPA, in
    training mode without a KV cache, as a trainer runs it (`seed`: torch's, before it is built)."""
    import transformers

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        if seed is not None:
            torch.manual_seed(seed)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation="sdpa"
            )
    finally:
        torch.set_default_dtype(previous)
    model.to(torch.bfloat16)
    model.train()
    model.config.use_cache = False
    return model
