"""`python -m ferry validate` per layer: on the CPU loopback device the real run and the
simulated row make the same decision for the saved tensors of every layer (packed, offloaded,
kept, deduplicated: Note [Decisions per layer] in `_validate.py`), for the bundled GPT and two
traced Hugging Face models; a tensor moved to another layer in the trace is caught by layer,
where the totals agree."""

import pytest

from ferry import _validate
from ferry._validate import validate
from ferry_cli import cli as ferry_cli


@pytest.fixture(autouse=True)
def cli(monkeypatch):
    path = ferry_cli()
    monkeypatch.setenv("FERRY_CLI", path)
    return path


def _layers(report, policy):
    row = report["policies"][policy]
    return row["real"]["layers"], row["simulated"]["layers"]


# The Hugging Face Llama's checkpointed layers pack their rotary tables differently in the real
# run (a keyword argument; docs/validation-loopback.md, "Known differences"): offload policies only.
@pytest.mark.parametrize(
    "model, policies",
    [
        ("gpt", ["none", "ferry", "trl", "checkpoint", "ferry+checkpoint"]),
        ("gpt2", ["none", "ferry", "trl", "checkpoint", "ferry+checkpoint"]),
        ("llama", ["none", "ferry", "trl"]),
    ],
)
@pytest.mark.parametrize("horizon", ["auto", "none"])
def test_every_layer_decides_alike(model, policies, horizon):
    report = validate(model, policies=policies, steps=2, horizon=horizon)
    for policy in policies:
        real, sim = _layers(report, policy)
        assert report["policies"][policy]["mismatches"] == [], policy
        layers = sorted(layer for layer in real if layer >= 0)
        assert layers == sorted(layer for layer in sim if layer >= 0) and len(layers) >= 2, policy
        assert all(real[layer]["packed"] > 0 for layer in layers), policy
    real, _ = _layers(report, "ferry")
    row = report["policies"]["ferry"]
    if horizon == "none":
        # Without a horizon the ferry rows offload from every layer: the comparison is not of
        # empty rows.
        assert row["simulated"]["horizon_bytes"] is None
        assert all(real[layer]["offloaded"] > 0 for layer in real if layer >= 0)
    else:
        # With the derived one, the first layer offloads and the tensors past the horizon stay:
        # both decisions are made, and made alike.
        assert row["simulated"]["horizon_bytes"] is not None
        assert real[0]["offloaded"] > 0
        assert any(real[layer]["kept"] > 0 for layer in real if layer >= 0)


def test_a_tensor_charged_to_another_layer_is_caught_by_layer():
    moved = []

    def planted(model, *args, **kwargs):
        from ferry import trace

        traced = trace(model, *args, **kwargs)
        for op in traced.document["ops"]:
            if op.get("layer") == 1 and op["saved"] and not moved:
                op["layer"] = 0
                moved.append(op["name"])
        return traced

    report = validate("gpt", policies=["none"], steps=2, trace=planted)
    assert len(moved) == 1
    found = report["policies"]["none"]["mismatches"]
    # The totals agree; layers 0 and 1 do not.
    assert not [m for m in found if not m.startswith("layer ")], found
    assert any(m.startswith("layer 0: packed:") for m in found), found
    assert any(m.startswith("layer 1: packed:") for m in found), found


def test_layer_counters_are_the_ones_compared():
    assert _validate.LAYER_COUNTERS == ("packed", "offloaded", "kept", "deduplicated", "recomputed")


def test_checkpointed_layers_are_recomputed_alike():
    report = validate("gpt", policies=["checkpoint"], steps=2)
    real, sim = _layers(report, "checkpoint")
    # One replay of each layer's region in the step compared (the last), on both sides.
    assert {k: v["recomputed"] for k, v in real.items() if k >= 0} == {0: 1, 1: 1, 2: 1, 3: 1}
    assert {k: v["recomputed"] for k, v in sim.items() if k >= 0} == {0: 1, 1: 1, 2: 1, 3: 1}


def test_a_layer_recomputed_on_one_side_only_is_named():
    # Equal totals, one layer's replays moved to another: the layer rows name both.
    counts = dict.fromkeys(_validate.COUNTERS + _validate.BYTES, 0)
    row = dict.fromkeys(_validate.LAYER_COUNTERS, 0)
    real = {**counts, "layers": {0: {**row, "recomputed": 2}, 1: {**row, "recomputed": 2}}}
    sim = {**counts, "layers": {0: {**row, "recomputed": 4}, 1: dict(row)}}
    assert _validate.mismatches(real, sim, 0) == [
        "layer 0: recomputed: real 2, simulated 4",
        "layer 1: recomputed: real 2, simulated 0",
    ]
