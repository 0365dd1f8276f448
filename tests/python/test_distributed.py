"""Data-parallel training (DDP, and FSDP2's fully_shard, over gloo on CPU, 2 processes): under
ferry's offload, checkpoint and both, each rank's losses and gradients are bitwise those of the
same run without ferry."""

import os
import sys

import pytest
import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
MODES = ["offload-ferry", "offload-trl", "checkpoint", "offload+checkpoint"]


def _run(rank, store_path, out_dir, wrapper):
    sys.path.insert(0, HERE)
    import ferry
    from gloo_ranks import run_rank, same_steps
    from models import TinyLM, loss_of

    def body():

        class Model(TinyLM):
            """TinyLM whose blocks run through `checkpoint` when set: the wrapper's forward
            stays the entry point, as data-parallel training needs."""

            checkpoint = None

            def forward(self, x):
                for block in self.blocks:
                    x = block(x) if self.checkpoint is None else self.checkpoint(block, x)
                return self.lm_head(self.ln_f(x))

        def train(mode):
            torch.manual_seed(0)
            model = Model()
            if mode is not None and "checkpoint" in mode:
                model.checkpoint = lambda f, v: ferry.checkpoint(f, v, use_reentrant=False)
            if wrapper == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model)
            else:
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            ctx = None
            if mode is not None and "offload" in mode:
                ctx = ferry.offload(
                    policy="trl" if "trl" in mode else "ferry",
                    loopback=True,
                    min_bytes=0,
                    window_bytes=0,
                    max_fwd_stash_size=1,
                )
            gen = torch.Generator().manual_seed(100 + rank)
            out = []
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                x = torch.randn(2, 16, 32, generator=gen)
                if ctx is None:
                    loss = loss_of(model(x))
                else:
                    with ctx:
                        loss = loss_of(model(x))
                loss.backward()
                if ctx is not None:
                    assert ctx.tracked() == 0
                grads = []
                for p in model.parameters():
                    g = p.grad
                    grads.append(g.full_tensor() if hasattr(g, "full_tensor") else g)
                out.append((loss.detach(), [g.clone() for g in grads]))
            return out

        want = train(None)
        results = {}
        for mode in MODES:
            got = train(mode)
            results[mode] = same_steps(want, got)
        return results

    run_rank(rank, WORLD, store_path, out_dir, body)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_data_parallel_training_is_unchanged(tmp_path, wrapper):
    mp.spawn(_run, args=(str(tmp_path / "store"), str(tmp_path), wrapper), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert results == {mode: True for mode in MODES}, (rank, results)
