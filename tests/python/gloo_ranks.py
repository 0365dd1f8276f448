"""Training on several ranks over gloo on CPU, one process each (the distributed tests): how the
test starts the ranks and gathers what they saved, what each rank runs, and how a rank leaves."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_ranks(run, world, out_dir, *args):
    """Runs ``run(rank, store_path, out_dir, *args)`` in `world` processes, one a rank, each of
    which ends in run_rank; returns what each rank saved, by rank."""
    out_dir = Path(out_dir)
    mp.spawn(run, args=(str(out_dir / "store"), str(out_dir), *args), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world)]


def ranks_fixture(run, world, name):
    """A fixture of the module's tests: what each of `world` ranks running `run` saved, by rank,
    from one spawn_ranks into a temporary directory called `name`."""

    @pytest.fixture(scope="module")
    def ranks(tmp_path_factory):
        return spawn_ranks(run, world, tmp_path_factory.mktemp(name))

    return ranks


def same_steps(want, got):
    """Whether two runs' steps, each (loss, gradients), are bitwise equal."""
    return all(
        torch.equal(wl, gl) and all(torch.equal(a, b) for a, b in zip(wg, gg))
        for (wl, wg), (gl, gg) in zip(want, got)
    )


def run_rank(rank, world, store_path, out_dir, body):
    """Joins the gloo group of `world` ranks, runs `body()` and saves what it returns to
    out_dir/rank{rank}.pt, then leaves the process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        torch.save(body(), os.path.join(out_dir, f"rank{rank}.pt"))
        # Every rank is done with every collective before any leaves.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that finished ends here, without the interpreter's shutdown: gloo's worker threads
    # may still drop their last references to finished work (tensors that hold Python objects)
    # while the interpreter finalizes; such a thread is stopped by pthread_exit, whose unwinding
    # through a noexcept frame aborts the process ("terminate called without an active
    # exception", pytorch/pytorch#190489 and #179291). The results are already on disk; an
    # exception above still propagates and fails the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
