"""A small GPT written with torch alone: pre-LayerNorm blocks, causal self-attention written
out (fused QKV, masked softmax), a GELU MLP and an output head."""

import math

import torch
import torch.nn.functional as F
from torch import nn

SEED = 0


class Block(nn.Module):
    def __init__(self, d, heads, max_len):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))

    def attention(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = torch.softmax(att.masked_fill(~self.mask[:t, :t], float("-inf")), dim=-1)
        return self.proj(torch.matmul(att, v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=256, d=64, heads=4, layers=4, max_len=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, heads, max_len) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _next_token_loss(logits):
    # The tokens are all zero: the loss of predicting token 0 everywhere.
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long))


def gpt(batch=2, seq=64):
    """The example GPT: 4 layers, hidden 64, 4 heads, vocabulary 256."""
    torch.manual_seed(SEED)
    model = GPT(max_len=seq).train()
    tokens = torch.randint(0, 256, (batch, seq))
    return model, (tokens,), _next_token_loss
