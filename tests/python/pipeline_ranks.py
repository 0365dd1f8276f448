"""What each rank of the pipeline-parallel tests runs (tests/python/test_pipeline_parallel.py):
a small model split into stages by layers, trained a few steps by a torch.distributed.pipelining
schedule over gloo on CPU, plainly and with each stage's layers under ferry's offload and
checkpoint."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: Micro-batches a step, more than the stages of a rank and of the pipeline.
MICROBATCHES = 4
BATCH, SEQ, WIDTH, VOCAB = 8, 8, 32, 64
STEPS = 2
#: Each stage's layers: plainly, under an offload session, under ferry's checkpoint, ferry's
#: checkpoint inside an offload session, torch's checkpoint inside an offload session.
MODES = ("plain", "offload", "checkpoint", "offload+checkpoint", "offload+torch-checkpoint")
#: The schedules: name -> (schedule class name, stages a rank holds).
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
}


class MLPStack(nn.Module):
    """A plain stack of residual MLP layers between an input and an output projection."""

    def __init__(self, layers):
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(WIDTH),
                nn.Linear(WIDTH, 2 * WIDTH),
                nn.GELU(),
                nn.Linear(2 * WIDTH, WIDTH),
            )
            for _ in range(layers)
        )
        self.out = nn.Linear(WIDTH, VOCAB)


class MLPStage(nn.Module):
    """Layers `lo` to `hi` of an MLPStack; the first stage has its input projection, the last its
    output projection. Each layer runs through `run_layer` (the mode's)."""

    def __init__(self, whole, lo, hi, first, last, run_layer):
        super().__init__()
        self.inp = whole.inp if first else None
        self.layers = nn.ModuleList(whole.layers[lo:hi])
        self.out = whole.out if last else None
        self.run_layer = run_layer

    def forward(self, x):
        h = self.inp(x) if self.inp is not None else x
        for layer in self.layers:
            h = self.run_layer(lambda v, layer=layer: v + layer(v), h)
        return self.out(h) if self.out is not None else h


class LlamaStage(nn.Module):
    """Decoder layers `lo` to `hi` of a Hugging Face Llama; the first stage embeds the tokens,
    the last applies the final norm and the head. Each stage computes the rotary embeddings of
    its positions; attention is causal (sdpa without a mask)."""

    def __init__(self, whole, lo, hi, first, last, run_layer):
        super().__init__()
        model = whole.model
        self.embed = model.embed_tokens if first else None
        self.rotary = model.rotary_emb
        self.layers = nn.ModuleList(model.layers[lo:hi])
        self.norm = model.norm if last else None
        self.head = whole.lm_head if last else None
        self.run_layer = run_layer

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        rope = self.rotary(h, position_ids=positions)
        for layer in self.layers:

            def body(v, layer=layer):
                return layer(v, position_embeddings=rope, position_ids=positions)

            h = self.run_layer(body, h)
        return self.head(self.norm(h)) if self.head is not None else h


def whole_model(name, layers):
    torch.manual_seed(0)
    if name == "mlp":
        return MLPStack(layers)
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).train()


def batches(model_name):
    """The steps' inputs and targets, the same on every rank."""
    gen = torch.Generator().manual_seed(100)
    out = []
    for _ in range(STEPS):
        if model_name == "mlp":
            x = torch.randn(BATCH, SEQ, WIDTH, generator=gen)
        else:
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        y = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        out.append((x, y))
    return out


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Mode:
    """How a stage runs its layers, and the offload sessions the stages open around them (one a
    stage, made by `make_session`)."""

    def __init__(self, mode, make_session):
        import ferry

        self.make_session = make_session if "offload" in mode else None
        self.sessions = []
        if "torch-checkpoint" in mode:
            from torch.utils.checkpoint import checkpoint

            self.run_layer = lambda f, v: checkpoint(f, v, use_reentrant=False)
        elif "checkpoint" in mode:
            self.run_layer = lambda f, v: ferry.checkpoint(f, v, use_reentrant=False)
        else:
            self.run_layer = lambda f, v: f(v)

    def wrap(self, stage):
        """`stage` with its forward inside a session of its own (in an offload mode)."""
        if self.make_session is None:
            return stage
        session, forward = self.make_session(), stage.forward
        self.sessions.append(session)

        def offloaded(*args):
            with session:
                return forward(*args)

        stage.forward = offloaded
        return stage


def train(model_name, schedule_name, mode, make_session, layers_per_stage=2):
    """Trains the pipeline on this rank for STEPS steps of SGD; returns the last stage's
    micro-batch losses and this rank's gradients by step, and the state left behind: the live
    checkpoint states and, for each stage's session, its telemetry, what it still holds and the
    races the asynchronous loopback device saw."""
    from torch.distributed import pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    cls_name, per_rank = SCHEDULES[schedule_name]
    n_stages = world * per_rank
    whole = whole_model(model_name, n_stages * layers_per_stage)
    how = Mode(mode, make_session)
    split = LlamaStage if model_name == "llama" else MLPStage
    stages = []
    modules = []
    # A rank holds stages rank, rank + world, ... (the looped placement of the interleaved
    # schedules).
    for index in range(rank, n_stages, world):
        lo = index * layers_per_stage
        module = split(
            whole, lo, lo + layers_per_stage, index == 0, index == n_stages - 1, how.run_layer
        )
        modules.append(module)
        stages.append(
            pipelining.PipelineStage(how.wrap(module), index, n_stages, torch.device("cpu"))
        )
    cls = getattr(pipelining, cls_name)
    schedule = cls(stages if per_rank > 1 else stages[0], MICROBATCHES, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    has_first = any(s.is_first for s in stages)
    has_last = any(s.is_last for s in stages)
    out_losses, out_grads = [], []
    for x, y in batches(model_name):
        optimizer.zero_grad(set_to_none=True)
        losses = [] if has_last else None
        args = (x,) if has_first else ()
        schedule.step(*args, target=y if has_last else None, losses=losses)
        out_losses.append(torch.stack(losses) if losses is not None else torch.zeros(0))
        out_grads.append([p.grad.clone() for p in params])
        optimizer.step()
    state = {"checkpoint_states": ferry_live_checkpoint_states(), "sessions": []}
    for session in how.sessions:
        counts = dict(session.telemetry())
        counts |= {
            "tracked": session.tracked(),
            "live_device_buffers": session.live_device_buffers(),
            "races": session._session.races(),
        }
        state["sessions"].append(counts)
    return out_losses, out_grads, state


def ferry_live_checkpoint_states():
    import ferry

    return ferry._C._live_checkpoint_states()
