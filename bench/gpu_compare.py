"""Peak memory and step time of one GPT-style training step, side by side in one run: no
offload, ferry (``ferry.offload_model``) and the reference offloader itself (TRL's
``get_act_offloading_ctx_manager``, when the optional ``trl`` package is installed).

    .venv/bin/python bench/gpu_compare.py [--layers 8] [--width 2048] [--seq 4096] [--batch 2]
                                          [--steps 5] [--loopback]

Each configuration runs its steps in turn, interleaved, after one warm-up step each; the table
gives the median step time and the peak of allocated device memory, each as a ratio to no
offload. ``--loopback`` runs ferry on the CPU (no GPU, no TRL): a smoke run of the script.
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import ferry


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, seq, width, layers, heads):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--loopback", action="store_true")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.loopback
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = Gpt(args.vocab, args.seq, args.width, args.layers, args.heads).to(device, dtype)
    tokens = torch.randint(args.vocab, (args.batch, args.seq), device=device)

    configs = {"none": None, "ferry": ferry.offload_model(model, loopback=not cuda)}
    if cuda:
        try:
            from trl.models.activation_offloading import get_act_offloading_ctx_manager
        except ImportError as e:
            print(f"trl: not measured ({e}); `pip install trl` adds it")
        else:
            configs["trl (reference)"] = get_act_offloading_ctx_manager(model)

    def step(ctx):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if ctx is None:
            logits = model(tokens)
        else:
            with ctx:
                logits = model(tokens)
        loss = F.cross_entropy(logits.view(-1, args.vocab).float(), tokens.roll(-1, 1).view(-1))
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start, (torch.cuda.max_memory_allocated() if cuda else 0)

    times = {name: [] for name in configs}
    peaks = {name: 0 for name in configs}
    for ctx in configs.values():
        step(ctx)  # warm-up
    for _ in range(args.steps):
        for name, ctx in configs.items():
            t, peak = step(ctx)
            times[name].append(t)
            peaks[name] = max(peaks[name], peak)

    base_t = statistics.median(times["none"])
    base_m = peaks["none"] or 1
    print(
        f"GPT {args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}, "
        f"{dtype}, on {torch.cuda.get_device_name() if cuda else 'cpu (loopback)'}"
    )
    print(f"{'configuration':<18}{'step ms':>10}{'time':>8}{'peak MiB':>12}{'memory':>8}")
    for name in configs:
        t = statistics.median(times[name])
        print(
            f"{name:<18}{1e3 * t:>10.1f}{t / base_t:>8.3f}{peaks[name] / 2**20:>12.0f}"
            f"{peaks[name] / base_m:>8.3f}"
        )


if __name__ == "__main__":
    main()
