"""The trace of a model written the way the built-in generator describes it agrees with the
generator's accounting (docs/workload.md, "Generated transformers").

The generator's GPT block saves Korthikanti et al.'s `sbh(34 + 5as/h)` bytes per layer; its
Llama block (fused QKV, a fused RMSNorm that saves its input, flash attention over unexpanded K
and V) saves `sbh(12 + 4kv/a) + 4asb + 8sbf`. The models below are those blocks in PyTorch; the
trace must find the same bytes within 2% and the same FLOPs within 5% (the generator's counts:
2Tkn per linear, 4bs²h for attention, the elementwise counts of its Costs table). The Llama
shape is the generator's `tiny-llama` and `llama3-8b` (at a short sequence); the GPT shape its
`tiny-gpt` and `gpt2-small`.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ferry._trace import trace


class _RMSNormFn(torch.autograd.Function):
    """A fused RMSNorm: saves its input and the reciprocal deviation, as a fused kernel does."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float() * weight.float()
        dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return (
            dx.to(x.dtype),
            (grad.float() * xhat).sum(tuple(range(x.dim() - 1))).to(weight.dtype),
            None,
        )


class RMSNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return _RMSNormFn.apply(x, self.weight, 1e-5)


class LlamaBlock(nn.Module):
    def __init__(self, h, a, kv, f):
        super().__init__()
        self.a, self.kv, self.d = a, kv, h // a
        self.attn_norm = RMSNorm(h)
        self.qkv = nn.Linear(h, h + 2 * kv * self.d, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate = nn.Linear(h, f, bias=False)
        self.up = nn.Linear(h, f, bias=False)
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        d, a, kv = self.d, self.a, self.kv
        q, k, v = self.qkv(self.attn_norm(x)).split([h, kv * d, kv * d], dim=-1)
        q = q.view(b, s, a, d).transpose(1, 2)
        k = k.view(b, s, kv, d).transpose(1, 2)
        v = v.view(b, s, kv, d).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, s, h))
        m = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))


def rotary(t, cos, sin):
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


class Llama(nn.Module):
    def __init__(self, layers, h, a, kv, f, vocab, s):
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(LlamaBlock(h, a, kv, f) for _ in range(layers))
        self.final_norm = RMSNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        d = h // a
        angles = torch.outer(torch.arange(s).float(), 1e4 ** (-torch.arange(0, d, 2).float() / d))
        self.register_buffer("cos", torch.cat((angles.cos(), angles.cos()), -1))
        self.register_buffer("sin", torch.cat((angles.sin(), angles.sin()), -1))

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.final_norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class GPTBlock(nn.Module):
    def __init__(self, h, a, s):
        super().__init__()
        self.a = a
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.register_buffer("masked", ~torch.tril(torch.ones(s, s, dtype=torch.bool)))

    def forward(self, x):
        b, s, h = x.shape
        a, d = self.a, h // self.a
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, a, d).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        probs = dropout(torch.softmax(scores.masked_fill(self.masked, float("-inf")), -1))
        y = (probs @ v).transpose(1, 2).reshape(b, s, h)
        x = x + dropout(self.proj(y))
        return x + dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))


def dropout(x):
    # Traced for a device (the default target): the device's native_dropout, a one-byte mask.
    return F.dropout(x, 0.1)


class GPT(nn.Module):
    def __init__(self, layers, h, a, vocab, s):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(s, h)
        self.layers = nn.ModuleList(GPTBlock(h, a, s) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)

    def forward(self, tokens, labels):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = dropout(self.wte(tokens) + self.wpe(positions))
        for layer in self.layers:
            x = layer(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _meta(make):
    with torch.device("meta"):
        model = make()
    return model.to(torch.bfloat16).train()


def _traced(model, b, s, vocab):
    with torch.device("meta"):
        tokens = torch.zeros((b, s), dtype=torch.long)
    return trace(model, tokens, tokens)


# The generator's shapes: (layers, h, a, kv, f, vocab, s, b).
LLAMA = {
    "tiny-llama": (2, 64, 4, 2, 176, 512, 128, 2),
    "llama3-8b-s512": (2, 4096, 32, 8, 14336, 128256, 512, 1),
}
GPT_SHAPES = {
    "tiny-gpt": (2, 64, 4, 512, 128, 2),
    "gpt2-small-s1024": (2, 768, 12, 50257, 1024, 1),
}


def llama_layer_bytes(h, a, kv, f, s, b):
    """The generator's saved bytes per Llama layer (docs/workload.md, Llama)."""
    return s * b * h * (12 + 4 * kv // a) + 4 * a * s * b + 8 * s * b * f


def llama_layer_flops(h, a, kv, f, s, b):
    """The generator's forward and backward FLOPs per Llama layer (its Costs table: backward
    twice the forward, flash attention 2.5 times): causal attention over the s(s+1)/2 pairs a
    causal kernel computes, as the trace counts it too (docs/workload.md, Costs)."""
    t, d = s * b, h // a
    linear = 2 * t * h * (h + 2 * kv * d) + 2 * t * h * h + 3 * 2 * t * h * f
    elementwise = 4 * t * h * 2 + 3 * t * (h + kv * d) + 4 * t * f + t * f + 2 * t * h
    attention = 4 * b * (s * (s + 1) // 2) * h
    return linear + attention + elementwise, 2 * (linear + elementwise) + 5 * attention // 2


def gpt_layer_bytes(h, a, s, b):
    """Korthikanti et al.'s sbh(34 + 5as/h), the generator's GPT accounting."""
    return 34 * s * b * h + 5 * a * s * s * b


def gpt_layer_flops(h, a, s, b):
    """The generator's forward FLOPs per GPT layer; backward is twice."""
    t = s * b
    linear = 2 * t * h * 3 * h + 2 * t * h * h + 2 * 2 * t * h * 4 * h
    attention = 2 * 2 * b * s * s * h
    elementwise = 5 * t * h * 2 + 5 * a * s * s * b + 2 * a * s * s * b + 2 * t * h * 2
    return linear + attention + elementwise + 8 * t * 4 * h + 2 * t * h


def _agree(traced, layer_bytes, layer_flops, backward_flops, report):
    for layer in traced.layers():
        saved = traced.saved_bytes(layer)
        flops, backward = traced.flops(layer)
        report(layer, saved, flops, backward)
        assert abs(saved - layer_bytes) <= 0.02 * layer_bytes, (layer, saved, layer_bytes)
        assert abs(flops - layer_flops) <= 0.05 * layer_flops, (layer, flops, layer_flops)
        assert abs(backward - backward_flops) <= 0.05 * backward_flops, (layer, backward)


@pytest.mark.parametrize("shape", sorted(LLAMA))
def test_llama_trace_agrees_with_generator(shape, capsys):
    layers, h, a, kv, f, vocab, s, b = LLAMA[shape]
    traced = _traced(_meta(lambda: Llama(layers, h, a, kv, f, vocab, s)), b, s, vocab)
    want = llama_layer_bytes(h, a, kv, f, s, b)
    flops, backward = llama_layer_flops(h, a, kv, f, s, b)

    def report(layer, saved, fwd, bwd):
        with capsys.disabled():
            print(
                f"\n{shape} layer {layer}: saved {saved} vs {want} ({saved / want - 1:+.3%}), "
                f"flops {fwd} vs {flops} ({fwd / flops - 1:+.3%}), backward {bwd}"
            )

    _agree(traced, want, flops, backward, report)


@pytest.mark.parametrize("shape", sorted(GPT_SHAPES))
def test_gpt_trace_agrees_with_generator(shape, capsys):
    layers, h, a, vocab, s, b = GPT_SHAPES[shape]
    traced = _traced(_meta(lambda: GPT(layers, h, a, vocab, s)), b, s, vocab)
    want = gpt_layer_bytes(h, a, s, b)
    flops = gpt_layer_flops(h, a, s, b)

    def report(layer, saved, fwd, bwd):
        with capsys.disabled():
            print(
                f"\n{shape} layer {layer}: saved {saved} vs {want} ({saved / want - 1:+.3%}), "
                f"flops {fwd} vs {flops} ({fwd / flops - 1:+.3%}), backward {bwd}"
            )

    _agree(traced, want, flops, 2 * flops, report)
