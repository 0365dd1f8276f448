"""ferry.offload on the CPU loopback device: gradients bitwise equal to plain autograd, the
scheduler's books after each step, and the reference offloader's errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ferry
from ferry import _validate
from models import MLP, Block, TinyLM, assert_same_grads, check_against_plain, loss_of, twin

POLICIES = ["ferry", "trl"]


def loopback(policy, **kw):
    return ferry.offload(policy=policy, loopback=True, **kw)


@pytest.mark.parametrize("policy", POLICIES + ["none"])
@pytest.mark.parametrize("min_bytes", [0, 1024])
@pytest.mark.parametrize("through_host", [False, True], ids=["window", "zero_window"])
def test_mlp_grads_bitwise(policy, min_bytes, through_host):
    # A zero window (trl: a one-tensor stash) sends every offloaded tensor back through its
    # host copy; the default keeps recent originals on the device.
    extra = dict(window_bytes=0, max_fwd_stash_size=1) if through_host else {}
    ctx = loopback(policy, min_bytes=min_bytes, **extra)
    check_against_plain(MLP, lambda: torch.randn(8, 32), ctx, steps=3)
    t = ctx.telemetry()
    assert t["packed"] > 0
    if policy == "none":
        assert t["offloaded"] == 0
    else:
        assert t["offloaded"] > 0
        if through_host:
            assert t["bytes_h2d"] > 0
    assert ctx.tracked() == 0
    assert ctx.live_device_buffers() == 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("through_host", [False, True], ids=["window", "zero_window"])
def test_transformer_block_grads_bitwise(policy, through_host):
    ref, model, ref_x, x = twin(Block, lambda: torch.randn(2, 16, 32))
    extra = dict(window_bytes=0, max_fwd_stash_size=1) if through_host else {}
    ctx = loopback(policy, min_bytes=0, **extra)
    ctx.update_model_params(model)
    for _ in range(2):
        for m, inp in ((ref, ref_x), (model, x)):
            m.zero_grad(set_to_none=True)
            inp.grad = None
        loss_of(ref(ref_x)).backward()
        with ctx:
            loss = loss_of(model(x))
        loss.backward()
        assert_same_grads(ref, model, [ref_x], [x])
        assert ctx.tracked() == 0
        assert ctx.live_device_buffers() == 0
    assert ctx.telemetry()["offloaded"] > 0


def views_fn(x, w):
    """Saves views of one fresh storage: transposed, broadcast, sliced with an offset,
    as_strided; and a non-contiguous view of another."""
    a = x * 2.0  # (8, 16), fresh storage
    y = (a.t() @ w).sum()  # mm saves a.t() (non-contiguous)
    e = a[:, :1].expand(8, 16)  # broadcast, stride 0
    y = y + (e * x).sum()  # mul saves e and x
    s = a[2:6, 3:]  # offset 35 elements
    y = y + s.sin().sum()  # sin saves s
    st = torch.as_strided(a, (4, 3), (17, 5), 7)  # as_strided with an offset
    y = y + st.cos().sum()  # cos saves st
    b = (x + 1.0).t()[1:, 2:]  # non-contiguous with offset, own storage
    y = y + (b * b).sum()
    return y


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dedup", [True, False])
def test_views_and_strides(policy, dedup):
    torch.manual_seed(3)
    x_ref = torch.randn(8, 16, requires_grad=True)
    w_ref = torch.randn(8, 5, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    w = w_ref.detach().clone().requires_grad_()
    views_fn(x_ref, w_ref).backward()
    ctx = loopback(policy, min_bytes=0, dedup=dedup)
    with ctx:
        y = views_fn(x, w)
    y.backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(w.grad, w_ref.grad)
    t = ctx.telemetry()
    assert t["offloaded"] > 0
    if policy == "ferry" and dedup:
        assert t["deduplicated"] > 0
    elif policy == "trl":
        # Today's reference keeps a second save of one view on the device, whatever `dedup`.
        assert t["deduplicated"] > 0
    else:
        assert t["deduplicated"] == 0
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_views_with_window_retired(policy):
    """The originals leave the device during forward: every view is rebuilt from a reload."""
    torch.manual_seed(4)
    x_ref = torch.randn(8, 16, requires_grad=True)
    w_ref = torch.randn(8, 5, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    w = w_ref.detach().clone().requires_grad_()
    views_fn(x_ref, w_ref).backward()
    ctx = loopback(policy, min_bytes=0, window_bytes=0, max_fwd_stash_size=1)
    with ctx:
        y = views_fn(x, w)
    y.backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(w.grad, w_ref.grad)
    t = ctx.telemetry()
    assert t["bytes_h2d"] > 0
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


class Scaled(nn.Module):
    """A known graph: linear, a multiply by a module buffer, relu, linear."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 24)
        self.fc2 = nn.Linear(24, 8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 24))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x) * self.scale))


def saved_tensors(model, x):
    """(activation saves, distinct activation storages, parameter/buffer saves) of a forward."""
    owned = {p.untyped_storage().data_ptr() for p in model.parameters()}
    owned |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saves, storages, params = 0, set(), 0

    def pack(t):
        nonlocal saves, params
        ptr = t.untyped_storage().data_ptr()
        if ptr in owned:
            params += 1
        else:
            saves += 1
            storages.add(ptr)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(model(x))
    return saves, len(storages), params


@pytest.mark.parametrize("policy", POLICIES)
def test_params_and_buffers_excluded(policy):
    torch.manual_seed(5)
    model = Scaled()
    x = torch.randn(4, 16)
    saves, storages, params = saved_tensors(model, x)
    # x (fc1's input), relu's output twice (relu, fc2), fc2's output (square); fc2.weight and
    # the buffer. x needs no grad, so fc1.weight is not saved.
    assert (saves, storages, params) == (4, 3, 2)
    # ferry copies a storage once; trl copies each saved view once (relu's output, saved by relu
    # and by fc2, is copied once and its second save stays on the device).
    offloaded = storages
    kept = params if policy == "ferry" else params + saves - storages

    ctx = loopback(policy, min_bytes=0)
    ctx.update_model_params(model)
    with ctx:
        loss = loss_of(model(x))
    t = ctx.telemetry()
    assert t["packed"] == saves + params
    assert t["offloaded"] == offloaded  # no parameter or buffer among them
    assert t["kept"] == kept
    loss.backward()
    assert ctx.tracked() == 0

    # Without update_model_params, the buffer (not a leaf that requires grad) is offloaded too,
    # as the reference offloader does without its model-parameter storages; the weight fc2
    # saves (weight.t(), a view of a parameter) stays, where the reference copies it out (Note
    # [Views of parameters]: FSDP2 frees that memory after forward).
    bare = loopback(policy, min_bytes=0)
    with bare:
        loss_of(model(x)).backward()
    assert bare.telemetry()["offloaded"] == offloaded + 1
    assert bare.telemetry()["kept"] == kept - params + 1  # the weight view


def test_shared_storage_deduplicated():
    torch.manual_seed(6)
    x_ref = torch.randn(64, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()

    def fn(x):
        a = x * 3.0
        return (a[:32].sin() * a[32:].cos()).sum()  # both views of a's storage saved

    fn(x_ref).backward()
    ctx = loopback("ferry", min_bytes=0)
    with ctx:
        y = fn(x)
    t = ctx.telemetry()
    assert t["deduplicated"] > 0
    assert t["bytes_d2h"] < t["packed"] * 64 * 4
    y.backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


def test_retain_graph_twice_ferry():
    ref, model, ref_x, x = twin(MLP, lambda: torch.randn(8, 32))
    loss = loss_of(ref(ref_x))
    loss.backward(retain_graph=True)
    loss.backward()
    ctx = loopback("ferry", min_bytes=0, window_bytes=0)
    with ctx:
        loss = loss_of(model(x))
    loss.backward(retain_graph=True)
    assert ctx.tracked() > 0  # the graph is retained, so are its saved tensors
    loss.backward()
    assert_same_grads(ref, model, [ref_x], [x])
    del loss
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


def double_backward(model, x):
    out = loss_of(model(x))
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    g.square().sum().backward()


def test_double_backward_ferry():
    def make():
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Sigmoid())

    ref, model, ref_x, x = twin(make, lambda: torch.randn(4, 16))
    double_backward(ref, ref_x)
    ctx = loopback("ferry", min_bytes=0, window_bytes=0)
    with ctx:
        out = loss_of(model(x))
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    g.square().sum().backward()
    assert_same_grads(ref, model, [ref_x], [x])
    del out, g
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


def test_trl_second_unpack_is_untracked():
    """The reference offloader forgets a tensor at its first unpack: a retained graph cannot be
    walked twice."""
    model = MLP()
    x = torch.randn(8, 32, requires_grad=True)
    ctx = loopback("trl", min_bytes=0)
    with ctx:
        loss = loss_of(model(x))
    loss.backward(retain_graph=True)
    with pytest.raises(ValueError, match="untracked tensor"):
        loss.backward()


def test_unpack_outside_backward():
    """Reading a saved tensor outside backward (grad_fn._saved_*) brings it back. ferry keeps
    its host copy until autograd releases it, so backward still works; trl forgets it at that
    first unpack, as the reference does, and backward then finds it untracked."""
    for policy in POLICIES:
        x = torch.randn(64, 64, requires_grad=True)
        ctx = loopback(policy, min_bytes=0, window_bytes=0, max_fwd_stash_size=1)
        with ctx:
            y = x.sin()
            z = y.cos()
        assert torch.equal(z.grad_fn._saved_self, y)
        if policy == "ferry":
            z.sum().backward()
            assert torch.equal(x.grad, -y.sin() * x.cos())
            assert ctx.tracked() == 0
        else:
            with pytest.raises(ValueError, match="untracked tensor"):
                z.sum().backward()


def test_trl_double_backward_is_untracked():
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    x = torch.randn(4, 16, requires_grad=True)
    ctx = loopback("trl", min_bytes=0)
    with ctx:
        out = loss_of(model(x))
    (g,) = torch.autograd.grad(out, x, create_graph=True)
    with pytest.raises(ValueError, match="untracked tensor"):
        g.square().sum().backward()


@pytest.mark.parametrize("policy", POLICIES)
def test_no_offload_region(policy):
    ref, model, ref_x, x = twin(MLP, lambda: torch.randn(8, 32))
    loss_of(ref(ref_x)).backward()

    plain = loopback(policy, min_bytes=0)
    with plain:
        loss_of(model(x)).backward()
    base = plain.telemetry()

    model.zero_grad(set_to_none=True)
    x.grad = None
    ctx = loopback(policy, min_bytes=0)
    with ctx:
        h = F.gelu(model.fc1(x))
        with ferry.no_offload():
            h = torch.relu(model.fc2(h))
        loss = loss_of(model.fc3(h))
    t = ctx.telemetry()
    assert t["packed"] < base["packed"]  # the region's tensors never reach the scheduler
    assert t["offloaded"] < base["offloaded"]
    loss.backward()
    assert_same_grads(ref, model, [ref_x], [x])
    assert ctx.tracked() == 0


def test_no_offload_outside_any_region():
    x = torch.randn(8, requires_grad=True)
    with ferry.no_offload():
        y = (x.sin() * x).sum()
    y.backward()
    assert torch.equal(x.grad, x.cos() * x + x.sin())


@pytest.mark.parametrize("policy", POLICIES)
def test_fifty_steps_leave_nothing_behind(policy):
    torch.manual_seed(7)
    model = MLP(16, 32)
    ctx = loopback(policy, min_bytes=0, window_bytes=4096)
    ctx.update_model_params(model)
    host = None
    for i in range(50):
        x = torch.randn(4, 16)
        model.zero_grad(set_to_none=True)
        with ctx:
            loss = loss_of(model(x))
        loss.backward()
        with torch.no_grad():  # plain SGD (torch.optim imports torch._dynamo)
            for p in model.parameters():
                p -= 1e-3 * p.grad
        assert ctx.tracked() == 0, f"step {i}"
        assert ctx.live_device_buffers() == 0, f"step {i}"
        if policy == "ferry":
            # ferry's host pool is reused from step to step: it stops growing after step 1.
            if host is None:
                host = ctx.live_host_buffers()
                assert host > 0
            assert ctx.live_host_buffers() == host, f"step {i}"
        else:
            assert ctx.live_host_buffers() == 0, f"step {i}"
    t = ctx.telemetry()
    assert t["packed"] > 0 and t["offloaded"] > 0
    assert t["pinned_peak"] >= t["pinned_bytes"]


def test_offload_model_head_not_offloaded():
    torch.manual_seed(8)
    ref = TinyLM()
    model = TinyLM()
    model.load_state_dict(ref.state_dict())
    x_ref = torch.randn(2, 8, 32, requires_grad=True)
    x = x_ref.detach().clone().requires_grad_()
    loss_of(ref(x_ref)).backward()

    ctx = ferry.offload_model(model, loopback=True, min_bytes=0)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with ctx:
            loss = loss_of(model(x))
        loss.backward()
        assert ctx.tracked() == 0
    assert_same_grads(ref, model, [x_ref], [x])

    # The head's saved tensors never reach the scheduler: fewer packs per step than under a
    # bare offload of the same model.
    bare = ferry.offload(loopback=True, min_bytes=0)
    bare.update_model_params(ref)
    with bare:
        loss_of(ref(x_ref)).backward()
    per_step = ctx.telemetry()["packed"] // 2
    assert per_step == bare.telemetry()["packed"] - 2  # lm_head's input and weight


def test_offload_model_warns_without_head():
    model = MLP()
    with pytest.warns(UserWarning, match="no output head"):
        ferry.offload_model(model, loopback=True)
    ferry.offload_model(model, loopback=True, warn_if_no_head=False)


def test_offload_model_finds_heads():
    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

        def forward(self, x):
            return self.module(x)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.Module()
            self.decoder.output = nn.Linear(4, 4)

        def forward(self, x):
            return self.decoder.output(x)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 4)

        def forward(self, x):
            return self.head(x)

    import warnings

    for model in (Wrapped(TinyLM()), Decoder(), Head()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ctx = ferry.offload_model(model, loopback=True)
        x = torch.randn(2, 3, 32 if isinstance(model, Wrapped) else 4, requires_grad=True)
        with ctx:
            loss = loss_of(model(x))
        loss.backward()
        assert ctx.tracked() == 0


def test_telemetry_fields():
    # The names are ferry._C's (the C++ tables), in their order: counts, then bytes.
    ctx = loopback("ferry")
    t = ctx.telemetry()
    assert list(t) == [*ferry._C.TELEMETRY_COUNTS, *ferry._C.TELEMETRY_BYTES]
    assert all(isinstance(v, int) and v == 0 for v in t.values())
    # What validate compares are names of the telemetry; each count it leaves out is one.
    assert set(_validate.COUNTERS) | set(_validate.UNCOMPARED_COUNTERS) == set(
        ferry._C.TELEMETRY_COUNTS
    )
    assert set(_validate.BYTES) <= set(ferry._C.TELEMETRY_BYTES)


@pytest.mark.parametrize("horizon", [0, 3000])
def test_an_offload_horizon_keeps_what_is_saved_after_it(horizon):
    x = torch.randn(16, 16, requires_grad=True)

    def forward():
        return (x.sin().exp().tanh().cos() * x).sum()

    forward().backward()
    plain = x.grad.clone()
    x.grad = None
    ctx = ferry.offload(loopback=True, min_bytes=0, window_bytes=0, horizon_bytes=horizon)
    with ctx:
        loss = forward()
    loss.backward()
    assert torch.equal(x.grad, plain)
    t = ctx.telemetry()
    assert t["past_horizon"] > 0
    # Each storage is 1 KiB: a horizon of 3000 bytes lets two of them out, 0 none.
    assert t["offloaded"] == horizon // 1024
    with pytest.raises(ValueError, match="horizon_bytes must not be negative"):
        ferry.offload(loopback=True, horizon_bytes=-1)


def test_region_stack_consistent_after_error():
    ctx = loopback("ferry", min_bytes=0)
    with pytest.raises(ZeroDivisionError):
        with ctx:
            with ferry.no_offload():
                raise ZeroDivisionError
    # The regions were closed: a new forward works, and nothing leaks into later tests.
    x = torch.randn(16, requires_grad=True)
    with ctx:
        y = (x * x.exp()).sum()
    y.backward()
    assert ctx.tracked() == 0


# --- misuse -------------------------------------------------------------------------------------


def test_trl_stash_size_at_least_one():
    with pytest.raises(ValueError, match="max_fwd_stash_size should be at least 1"):
        loopback("trl", max_fwd_stash_size=0)


def step_with_an_unused_branch(policy):
    """An offload context after one step whose second branch is never backpropagated, and
    what the next step runs on."""
    model = MLP()
    x = torch.randn(8, 32, requires_grad=True)
    ctx = loopback(policy, min_bytes=0)
    with ctx:
        loss = loss_of(model(x))
        x.exp().sum()  # saves exp's result, which the backward below never unpacks
    loss.backward()
    assert ctx.tracked() > 0
    return ctx, model, x


def test_trl_clears_a_stale_tracker_on_entry():
    ctx, model, x = step_with_an_unused_branch("trl")
    with ctx:
        assert ctx.tracked() == 0  # today's reference clears it on entry
        loss = loss_of(model(x))
    loss.backward()
    assert ctx.tracked() == 0


def test_trl_seed_tracker_not_cleared():
    ctx, model, x = step_with_an_unused_branch("trl-seed")
    with pytest.raises(
        ValueError, match="Backward pass should have cleared tracker of all tensors"
    ):
        with ctx:
            loss_of(model(x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_no_loopback_without_cuda():
    with pytest.raises(ValueError, match="loopback"):
        ferry.offload()


def test_unknown_policy_and_option():
    with pytest.raises(ValueError, match="unknown policy"):
        ferry.offload(policy="fast", loopback=True)
    with pytest.raises(TypeError):
        ferry.offload(loopback=True, bogus=True)


@pytest.mark.parametrize("option", ["min_bytes", "window_bytes", "prefetch_bytes", "host_cap"])
def test_negative_sizes_are_rejected_by_name(option):
    with pytest.raises(ValueError, match=f"{option} must not be negative"):
        ferry.offload(loopback=True, **{option: -1})


def test_write_program_needs_record(tmp_path):
    with pytest.raises(ValueError, match="record=True"):
        loopback("ferry").write_program(tmp_path / "p.json")


class Mixed(nn.Module):
    """Saved tensors of several dtypes: integer indices (embedding, max), empty tensors."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 50)

    def forward(self, idx, target):
        h = self.ln(self.emb(idx))
        top, _ = h.max(dim=1, keepdim=True)
        h = h + top + torch.zeros(0, 16, dtype=h.dtype).sum(0)
        empty = torch.zeros(0, dtype=h.dtype, requires_grad=True)
        logits = self.fc(h).float()
        return F.cross_entropy(logits.view(-1, 50), target.view(-1)) + empty.exp().sum()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_mixed_dtypes_and_empty_tensors(policy, dtype):
    torch.manual_seed(10)
    ref = Mixed().to(dtype)
    model = Mixed().to(dtype)
    model.load_state_dict(ref.state_dict())
    idx, target = torch.randint(0, 50, (4, 7)), torch.randint(0, 50, (4, 7))
    ref(idx, target).backward()
    ctx = loopback(policy, min_bytes=0, window_bytes=0, max_fwd_stash_size=1)
    with ctx:
        loss = model(idx, target)
    loss.backward()
    assert_same_grads(ref, model)
    assert ctx.telemetry()["offloaded"] > 0
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


def test_host_memory_check_keeps_tensors_on_the_device_or_refuses():
    """A reserve above the machine's available memory refuses every pin: ferry keeps the
    tensors where they are and says so; trl raises, naming the tensor."""
    torch.manual_seed(11)
    model = MLP()
    x = torch.randn(8, 32, requires_grad=True)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    everything = 1 << 62
    ctx = loopback("ferry", min_bytes=0, host_reserve_bytes=everything)
    ctx.update_model_params(model)
    with ctx:
        loss = model(x).sum()
    loss.backward()
    t = ctx.telemetry()
    assert t["offloaded"] == 0 and t["host_fallbacks"] > 0 and t["pinned_bytes"] == 0
    assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))
    assert ctx.tracked() == 0 and ctx.live_host_buffers() == 0
    trl = loopback("trl", min_bytes=0, host_reserve_bytes=everything)
    with pytest.raises(ValueError, match="out of pinned host memory: could not pin"):
        with trl:
            model(x).sum()
    with pytest.raises(ValueError, match="host_reserve_bytes must not be negative"):
        loopback("ferry", host_reserve_bytes=-1)
