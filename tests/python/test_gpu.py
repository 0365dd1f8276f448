"""ferry on a CUDA device (loopback=False): the same bitwise gradient checks, and copies that
overlap compute. Marked `gpu`: skipped, with the reason shown, where torch sees no CUDA."""

import copy

import pytest
import torch

import ferry
from models import MLP, Block, check_against_plain, loss_of

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _deterministic_cuda():
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.cuda.synchronize()


@pytest.mark.parametrize("policy", ["ferry", "trl"])
@pytest.mark.parametrize("make", [MLP, Block], ids=["mlp", "block"])
def test_cuda_grads_bitwise(policy, make):
    shape = (8, 32) if make is MLP else (2, 16, 32)
    ctx = ferry.offload(policy=policy, min_bytes=0)
    model = check_against_plain(make, lambda: torch.randn(*shape), ctx, steps=3, device="cuda")
    assert ctx.telemetry()["offloaded"] > 0
    torch.cuda.synchronize()
    assert ctx.tracked() == 0
    assert ctx.live_device_buffers() == 0
    assert next(model.parameters()).is_cuda


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_cuda_reloads_with_small_window(policy):
    ctx = ferry.offload(policy=policy, min_bytes=0, window_bytes=0, max_fwd_stash_size=1)
    check_against_plain(MLP, lambda: torch.randn(64, 32), ctx, steps=3, device="cuda")
    t = ctx.telemetry()
    assert t["bytes_h2d"] > 0
    torch.cuda.synchronize()
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


def test_cuda_checkpoint_inside_offload():
    torch.manual_seed(0)
    ref = Block().cuda()
    model = Block().cuda()
    model.load_state_dict(ref.state_dict())
    x_ref = torch.randn(2, 16, 32, device="cuda", requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    loss_of(ref(x_ref)).backward()
    ctx = ferry.offload(min_bytes=0)
    ctx.update_model_params(model)
    with ctx:
        loss = loss_of(ferry.checkpoint(model, x, use_reentrant=False) * 1.0)
    loss.backward()
    assert torch.equal(x.grad, x_ref.grad)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_offload_overlaps_compute():
    """ferry's copies run on their own streams, beside compute: a step under offload takes
    clearly less than the step's compute time plus the time of its copies done alone."""
    torch.manual_seed(0)
    d = 2048
    layers = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU()) for _ in range(8)]
    ).cuda()
    x = torch.randn(4096, d, device="cuda", requires_grad=True)
    # A window of two activations: most originals leave the device in forward, so backward
    # reloads them (prefetched) and both directions have to overlap compute.
    ctx = ferry.offload(min_bytes=0, window_bytes=64 << 20, prefetch_bytes=64 << 20)
    ctx.update_model_params(layers)
    repeat = 3

    def timed(fn):
        fn()  # warm up (allocators, the host pool)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(repeat):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end))
        return best

    def plain_step():
        loss_of(layers(x)).backward()

    def offload_step():
        with ctx:
            loss = loss_of(layers(x))
        loss.backward()

    compute_ms = timed(plain_step)
    before = ctx.telemetry()
    offload_ms = timed(offload_step)
    after = ctx.telemetry()
    d2h = (after["bytes_d2h"] - before["bytes_d2h"]) // (repeat + 1)
    h2d = (after["bytes_h2d"] - before["bytes_h2d"]) // (repeat + 1)
    assert d2h > 0 and h2d > 0
    torch.cuda.synchronize()
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0

    # The same bytes copied alone, device to pinned host and back, one after the other.
    dev = torch.empty(max(d2h, h2d), dtype=torch.uint8, device="cuda")
    host = torch.empty(max(d2h, h2d), dtype=torch.uint8, pin_memory=True)

    def copies():
        host[:d2h].copy_(dev[:d2h], non_blocking=True)
        dev[:h2d].copy_(host[:h2d], non_blocking=True)

    copy_ms = timed(copies)
    hidden = compute_ms + copy_ms - offload_ms
    # Done one after the other, nothing would be hidden; ask for a quarter of the shorter one.
    assert hidden > 0.25 * min(compute_ms, copy_ms), (compute_ms, copy_ms, offload_ms)


def test_validate_on_cuda_measures_peaks_and_step_time():
    """`validate(real_device="cuda")` trains on the GPU and measures the last step's peak
    allocated and reserved memory, which hold at least the activations a plain forward saves."""
    from ferry._validate import validate

    report = validate("gpt", policies=["none", "ferry"], steps=2, real_device="cuda")
    assert report["real_device"] == "cuda"
    saved = report["saved_at_end_of_forward"]["real"]
    for name, row in report["policies"].items():
        real = row["real"]
        assert real["step_time_ns"] > 0, name
        assert real["peak_reserved_bytes"] >= real["peak_allocated_bytes"] > 0, name
        assert real["packed"] > 0, name
    assert report["policies"]["none"]["real"]["peak_allocated_bytes"] > saved


def test_validate_on_cuda_leaves_out_what_was_live_before():
    """A run's peaks are its own: a gigabyte another object holds on the device while validate
    runs changes neither measured peak."""
    from ferry._validate import validate

    def peaks():
        real = validate("gpt", policies=["none"], steps=2, real_device="cuda")["policies"]
        return real["none"]["real"]["peak_allocated_bytes"], real["none"]["real"][
            "peak_reserved_bytes"
        ]

    alone = peaks()
    ballast = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    beside = peaks()
    del ballast
    for a, b in zip(alone, beside):
        assert abs(a - b) < 16 << 20, (alone, beside)


def test_auto_plans_apply_to_sdpa_on_cuda():
    """A plan made from the CPU trace of a Hugging Face decoder (SDPA attention, float32: the
    GPU runs the memory-efficient kernel, the trace the CPU's flash) applies on CUDA at the
    planner's floor, where it checkpoints, and trains as plain training does."""
    pytest.importorskip("transformers")
    from ferry import PlanError
    from ferry.examples._hf import llama

    ref, inputs, _ = llama(batch=2, seq=128, layers=4)
    ref = ref.cuda()
    ids = inputs["input_ids"].cuda()

    def loss_fn(out):
        return out.logits.float().mean()

    loss_fn(ref(ids)).backward()
    with pytest.raises(PlanError) as refused:
        ferry.auto(copy.deepcopy(ref), ids, budget="1MiB", margin=0, loss_fn=loss_fn)
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    ctx = ferry.auto(model, ids, budget=refused.value.floor, margin=0, loss_fn=loss_fn)
    assert ctx.plan["regions"]
    with ctx:
        loss = loss_fn(model(ids))
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
