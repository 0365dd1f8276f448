"""`python -m ferry validate`: on the CPU loopback device the real run and the simulated run of
the traced model agree exactly, count by count and byte by byte, for four architectures; a
planted difference is caught; the table, the JSON and the errors of the command."""

import json

import pytest
import torch
from torch import nn

from ferry import _validate
from ferry._cli import validate as validate_cli
from ferry._validate import validate
from ferry_cli import cli as ferry_cli
from ferry_cli import cli_or_none


@pytest.fixture(autouse=True)
def cli(request, monkeypatch):
    """The CLI binary the simulated runs use (FERRY_CLI, the package's copy, or PATH); the
    tests of bad arguments, refused before any simulation, run without one."""
    if request.node.name.startswith("test_bad_") and cli_or_none() is None:
        return None
    path = ferry_cli()
    monkeypatch.setenv("FERRY_CLI", path)
    return path


OFFLOAD = ["none", "ferry", "trl"]


def assert_exact(report):
    saved = report["saved_at_end_of_forward"]
    assert saved["real"] == saved["traced"] == saved["simulated"] > 0
    for name, row in report["policies"].items():
        assert row["mismatches"] == [], name
        assert row["real"]["packed"] > 0, name


@pytest.mark.parametrize("model", ["gpt", "llama", "gpt2", "bert"])
def test_exact_match_offload_policies(model):
    report = validate(model, policies=OFFLOAD, steps=2)
    assert_exact(report)
    ferry_row = report["policies"]["ferry"]["real"]
    assert ferry_row["offloaded"] > 0 and ferry_row["bytes_d2h"] > 0
    assert ferry_row["pinned_peak"] == ferry_row["bytes_d2h"]  # the pool holds the last step's
    assert report["policies"]["trl"]["real"]["bytes_h2d"] > 0


@pytest.mark.parametrize("model", ["gpt", "gpt2"])
def test_exact_match_checkpoint_policies(model):
    report = validate(model, policies=["checkpoint", "ferry+checkpoint"], steps=2)
    assert_exact(report)
    plain = validate(model, policies=["none"], steps=2)["policies"]["none"]["real"]["packed"]
    assert report["policies"]["checkpoint"]["real"]["packed"] < plain


def test_hf_checkpoint_counts_views_of_region_inputs():
    # A known difference (docs/validation-loopback.md): the simulator packs every tensor a
    # checkpointed layer reads from outside it, views of one storage each on their own, where
    # ferry.checkpoint packs the tensors passed to it, and a Hugging Face layer passes only its
    # positional ones (its keywords are bound in a partial). Llama's layers read the rotary cos
    # and sin, a keyword, so not packed for real: two tensors a layer.
    report = validate("llama", policies=["checkpoint"], steps=2)
    row = report["policies"]["checkpoint"]
    layers = 2
    real = row["real"]["packed"]
    # Counts of the last step, on both sides.
    assert row["mismatches"] == [
        f"packed: real {real}, simulated {real + 2 * layers}",
        f"kept: real {real}, simulated {real + 2 * layers}",
    ]


def planted(extra_saves):
    """ferry.trace, then one op's record loses a saved tensor: the real run then saves one
    tensor more than the trace says."""

    def trace(*args, **kwargs):
        traced = ferry_trace(*args, **kwargs)
        for op in traced.document["ops"]:
            if op["saved"] and not op.get("no_offload"):
                extra_saves.append(op["saved"].pop())
                break
        return traced

    from ferry._trace import trace as ferry_trace

    return trace


def test_planted_mismatch_is_caught():
    dropped = []
    report = validate("gpt", policies=["none", "ferry"], steps=2, trace=planted(dropped))
    assert len(dropped) == 1
    for name in ("none", "ferry"):
        found = report["policies"][name]["mismatches"]
        real = report["policies"][name]["real"]["packed"]
        # One tensor more in the real run, in the step compared (the last).
        assert f"packed: real {real}, simulated {real - 1}" in found, (name, found)


def test_mismatches_name_each_difference():
    real = {n: 1 for n in _validate.COUNTERS + _validate.BYTES}
    sim = dict(real, kept=3, packed=3, bytes_h2d=7)
    found = _validate.mismatches(real, sim, head_packs=2, policy="ferry")
    assert found == ["bytes_h2d: real 1, simulated 7"]
    assert _validate.mismatches(real, dict(real, pinned_peak=9), 0, policy="trl") == []


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def small_factory():
    torch.manual_seed(1)
    return Small(), (torch.randn(8, 32),), lambda out: out.square().mean()


def not_a_pair():
    return Small()


def test_validate_a_module():
    model, inputs, loss_fn = small_factory()
    report = validate(model, inputs, loss_fn, policies=["ferry"], steps=1)
    assert report["model"] == "Small"
    assert_exact(report)
    with pytest.raises(TypeError, match="a torch.nn.Module with its inputs"):
        validate(model)
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        validate(model, inputs, loss_fn, policies=["lifo"])


def test_loopback_run_reports_time_and_no_allocator_peaks():
    """On the loopback device the step time is measured and the peaks, which the host has no
    allocator statistics for, are None; a real device other than loopback or cuda is refused."""
    model, inputs, loss_fn = small_factory()
    report = validate(model, inputs, loss_fn, policies=["none"], steps=1)
    real = report["policies"]["none"]["real"]
    assert report["real_device"] == "loopback"
    assert real["step_time_ns"] > 0
    assert real["peak_allocated_bytes"] is None and real["peak_reserved_bytes"] is None
    with pytest.raises(ValueError, match="real_device must be one of loopback, cuda"):
        validate(model, inputs, loss_fn, policies=["none"], real_device="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_bad_real_device_without_cuda(capsys):
    assert validate_cli.main(["gpt", "--real-device", "cuda"]) == 2
    assert "real_device 'cuda': torch sees no CUDA device" in capsys.readouterr().err


def test_cli_table_for_a_factory(capsys):
    code = validate_cli.main(
        ["test_validate:small_factory", "--policy", "ferry", "--policy", "checkpoint"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "model test_validate:small_factory, 2 steps" in out
    rows = [line.split()[0] for line in out.splitlines()[4:6]]
    assert rows == ["ferry", "checkpoint"]
    assert out.count(" exact") == 2
    assert "saved activations held at the end of forward" in out and "(equal)" in out
    assert "MISMATCH" not in out


def test_cli_json(capsys, tmp_path):
    kept = tmp_path / "gpt.json"
    code = validate_cli.main(
        ["gpt", "--policy", "trl", "--steps", "1", "--json", "--keep", str(kept)]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert json.loads(kept.read_text())["format"] == "ferry.model/1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt.json"]
    assert report["exact"] is True and report["steps"] == 1
    assert list(report["policies"]) == ["trl"]
    row = report["policies"]["trl"]
    assert set(row) == {"real", "simulated", "mismatches"}
    assert row["simulated"]["step_time_ns"] > 0 and row["real"]["step_time_ns"] > 0


def test_cli_exit_1_on_a_mismatch(capsys, monkeypatch):
    monkeypatch.setattr(_validate, "_head_saves", lambda document: 0)  # a wrong correction
    code = validate_cli.main(["gpt", "--policy", "none", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "MISMATCH none: packed: real 111, simulated 113" in out


@pytest.mark.parametrize(
    "model, message",
    [
        ("no-such-example", "neither a bundled example (gpt, llama, gpt2, bert) nor a factory"),
        ("no_such_module_xyz:make", "cannot import no_such_module_xyz"),
        ("test_validate:missing", "test_validate has no function missing"),
        ("test_validate:not_a_pair", "returned Small, not (model, inputs[, loss_fn])"),
        (":make", "a factory is written pkg.module:function"),
    ],
)
def test_bad_model_argument(capsys, model, message):
    assert validate_cli.main([model]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m ferry validate: MODEL ")
    assert message in err


def test_bad_steps(capsys):
    assert validate_cli.main(["gpt", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err


def bert_without_token_types():
    from ferry.examples import bert

    model, inputs, loss_fn = bert()
    del inputs["token_type_ids"]
    return model, inputs, loss_fn


def test_expanded_view_at_the_size_threshold():
    # A known difference (docs/validation-loopback.md): without token type ids BERT expands a
    # 512-byte slice of a buffer to the batch, 1024 logical bytes. The real scheduler weighs a
    # tensor's logical bytes against min_bytes (1024) and offloads it; the model format has one
    # size, the bytes it covers (512), so the simulator keeps it. Without the offload horizon, which
    # counts bytes in pack order and so would carry the difference on to later packs.
    report = validate(
        "test_validate:bert_without_token_types", policies=["ferry"], steps=2, horizon="none"
    )
    real = report["policies"]["ferry"]["real"]
    assert report["policies"]["ferry"]["mismatches"] == [
        f"offloaded: real {real['offloaded']}, simulated {real['offloaded'] - 1}",
        f"kept: real {real['kept']}, simulated {real['kept'] + 1}",
        # ferry's forward window still holds the original: backward finds it there.
        f"stash_hits: real {real['stash_hits']}, simulated {real['stash_hits'] - 1}",
        f"bytes_d2h: real {real['bytes_d2h']}, simulated {real['bytes_d2h'] - 512}",
        f"pinned_peak: real {real['pinned_peak']}, simulated {real['pinned_peak'] - 512}",
    ]


def test_validate_leaves_no_tensor_of_its_runs_alive():
    """What validate's runs made is freed when it returns: a tensor left alive (a forward's
    activations held by a cycle through autograd) would sit on a GPU under every later run's
    measured peak."""
    import gc

    def live_bytes():
        gc.collect()
        return sum(
            o.untyped_storage().nbytes()
            for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and not o.is_meta
        )

    model, inputs, loss_fn = _validate.load("gpt")
    before = live_bytes()
    validate(model, inputs, loss_fn, policies=["none", "ferry", "checkpoint"], steps=1)
    assert live_bytes() == before
