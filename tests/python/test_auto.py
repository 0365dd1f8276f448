"""Applying a `ferry.plan/1` for real: `ferry.offload(plan=...)` and `ferry.auto`, on the CPU
loopback device. Gradients are bitwise those of plain training; what the real run keeps,
offloads and recomputes is counted and equals what the plan says, computed here from the plan's
decisions and the traced model's saved tensors; a plan for another model is refused, naming the
first op that differs."""

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers

import ferry
from ferry import PlanError
from models import TinyLM, assert_same_grads, loss_of, twin


def gpt():
    return TinyLM(d=64), torch.randn(8, 16, 64)


def llama():
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            num_key_value_heads=2,
            max_position_embeddings=16,
            attn_implementation="eager",
        )
    )
    model.config.use_cache = False
    model.train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    # One padded position: the real forward builds the attention mask, as the trace does (with
    # a mask of all ones it checks that and skips the mask, which the trace cannot check).
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 0] = 0
    return model, {"input_ids": ids, "attention_mask": mask}


MODELS = {"gpt": gpt, "llama": llama}


def loss_for(name):
    if name == "llama":
        return lambda out: out.logits.float().square().mean()
    return loss_of


def mixed_plan(doc):
    """Layer 0 outside any region, offloaded; layer 1 one region (inputs offloaded) whose ops
    cycle through recompute, keep and offload; everything else offloaded (the output head
    stays, by the offloader's rule). Every byte offloaded and no storage deduplicated: no
    minimum size, a zero window."""
    ops = doc["ops"]
    layer1 = [i for i, op in enumerate(ops) if op.get("layer") == 1]
    assert layer1 == list(range(layer1[0], layer1[-1] + 1))
    decisions = []
    for i in range(len(ops)):
        decisions.append(("recompute", "keep", "offload")[i % 3] if i in layer1 else "offload")
    return {
        "format": "ferry.plan/1",
        "model": doc["name"],
        "device": "h100-sxm-pcie5",
        "budget_bytes": 0,
        "knobs": {"min_bytes": 0, "window_bytes": 0},
        "regions": [{"first_op": layer1[0], "end_op": layer1[-1] + 1, "inputs": "offload"}],
        "ops": [{"name": op["name"], "saved": d} for op, d in zip(ops, decisions)],
    }


def offloaded_outputs(name):
    """The outputs selective checkpointing offloads for the op of this traced name: each
    tensor it returns, unless its outputs alias its inputs (views, in-place ops: saved)."""
    packet = getattr(torch.ops.aten, name.rpartition("/")[2].partition("#")[0])
    schema = getattr(packet, packet.overloads()[0])._schema
    if any(ret.alias_info is not None for ret in schema.returns):
        return 0
    return sum(str(ret.type) == "Tensor" for ret in schema.returns)


def expected(plan, doc, region_inputs=0):
    """What applying `plan` does, from its decisions and the traced saved tensors; and what it
    hands the offload session, with `region_inputs` the tensor arguments the calls of its
    regions whose inputs it offloads received."""
    ops = doc["ops"]
    tensors = {t["name"]: t for t in doc["tensors"]}
    decision = [op["saved"] for op in plan["ops"]]
    inside = set()
    for region in plan.get("regions", []):
        inside.update(range(region["first_op"], region["end_op"]))
    out = {"kept": 0, "offloaded": 0, "saved_outputs": 0, "offloaded_outputs": 0, "recomputed": 0}
    session = {"packed": region_inputs, "kept": 0}
    for i, op in enumerate(ops):
        if i in inside or not op["saved"]:
            continue
        offloaded = decision[i] == "offload" and not op.get("no_offload")
        out["offloaded" if offloaded else "kept"] += len(op["saved"])
        if offloaded:
            session["packed"] += len(op["saved"])
            session["kept"] += sum(tensors[n]["role"] in ("param", "buffer") for n in op["saved"])
    recomputed = set()
    for region in plan.get("regions", []):
        span = range(region["first_op"], region["end_op"])
        for i in span:
            if decision[i] != "recompute":
                out["saved_outputs" if decision[i] == "keep" else "offloaded_outputs"] += 1
            if decision[i] == "offload":
                session["packed"] += offloaded_outputs(ops[i]["name"])
        # Early stop: the replay ends with the last saved tensor, so the last op that saves
        # runs again only when it saves one of its own outputs.
        last = max(i for i in span if ops[i]["saved"])
        runs = [i for i in span if i < last or set(ops[last]["saved"]) & set(ops[last]["outputs"])]
        recomputed.update(i for i in runs if decision[i] == "recompute")
    out["recomputed"] = len(recomputed)
    session["offloaded"] = session["packed"] - session["kept"]
    return out, session


def run_plan(name, plan_of, steps=2):
    make = MODELS[name]
    torch.manual_seed(0)
    ref, inputs = make()
    model = copy.deepcopy(ref)
    loss_fn = loss_for(name)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
    doc = ferry.trace(model, *args, loss_fn=loss_fn, target="host", **kwargs).document
    plan = plan_of(doc)
    # No deduplication: each tensor handed to the session is counted on its own.
    ctx = ferry.offload(plan=plan, model=model, loopback=True, dedup=False)
    # The tensor arguments of the calls of the regions whose inputs are offloaded.
    region_inputs = []
    for region in ctx._plan_run.regions:
        if region.inputs == "offload":
            model.get_submodule(region.path).register_forward_pre_hook(
                lambda m, a, k: region_inputs.append(
                    sum(isinstance(v, torch.Tensor) for v in list(a) + list(k.values()))
                ),
                with_kwargs=True,
            )
    for _ in range(steps):
        for m in (ref, model):
            m.zero_grad(set_to_none=True)
        want = loss_fn(ref(*args, **kwargs))
        want.backward()
        start = ctx.telemetry()
        with ctx:
            got = loss_fn(model(*args, **kwargs))
        forward = {k: v - start[k] for k, v in ctx.telemetry().items()}
        got.backward()
        assert torch.equal(want, got)
        assert_same_grads(ref, model)
        del got
        assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0
    return plan, doc, ctx, forward, sum(region_inputs) // steps


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_mixed_plan_trains_bitwise_and_does_what_it_says(name):
    plan, doc, ctx, telemetry, region_inputs = run_plan(name, mixed_plan)
    decisions = {op["saved"] for op in plan["ops"]}
    assert decisions == {"keep", "offload", "recompute"}
    want, session = expected(plan, doc, region_inputs)
    assert ctx.plan_counts() == want
    assert all(want[k] > 0 for k in want), want
    # The session's counters over the last forward: every tensor handed to it was offloaded,
    # parameters excepted.
    assert {k: telemetry[k] for k in ("packed", "kept", "offloaded")} == session
    assert ctx.telemetry()["bytes_h2d"] > 0


def test_each_op_saves_what_the_trace_says_it_saves():
    plan, doc, ctx, _, _ = run_plan("gpt", mixed_plan, steps=1)
    inside = set(range(plan["regions"][0]["first_op"], plan["regions"][0]["end_op"]))
    saved = {i: len(ids) for i, ids in ctx._plan_run.saved.items()}
    assert saved == {
        i: len(op["saved"]) for i, op in enumerate(doc["ops"]) if op["saved"] and i not in inside
    }


def keep_all(doc):
    return {
        "format": "ferry.plan/1",
        "model": doc["name"],
        "device": "h100-sxm-pcie5",
        "budget_bytes": 0,
        "ops": [{"name": op["name"], "saved": "keep"} for op in doc["ops"]],
    }


def test_a_plan_that_offloads_nothing_runs_without_copies():
    _, doc, ctx, telemetry, _ = run_plan("gpt", keep_all, steps=1)
    assert telemetry["packed"] == 0
    assert ctx.plan_counts()["kept"] == sum(len(op["saved"]) for op in doc["ops"])


def traced_plan():
    model, x = gpt()
    doc = ferry.trace(model, x, loss_fn=loss_of, target="host").document
    return model, x, mixed_plan(doc)


def test_an_op_the_model_does_not_run_is_named():
    model, x, plan = traced_plan()
    index = next(i for i, op in enumerate(plan["ops"]) if op["name"] == "blocks.0.qkv/addmm")
    plan["ops"][index]["name"] = "blocks.0.qkv/not_an_op"
    ctx = ferry.offload(plan=plan, model=model, loopback=True)
    with pytest.raises(
        PlanError,
        match=r"ran 'blocks.0.qkv/addmm', which saves .* plan is at "
        rf"ops\[{index}\] \('blocks.0.qkv/not_an_op'\)",
    ):
        with ctx:
            loss_of(model(x))


def test_a_plan_for_another_model_is_refused():
    model, x, plan = traced_plan()
    other, y = llama()
    with pytest.raises(PlanError, match="the model has no module 'blocks.1'"):
        with ferry.offload(plan=plan, model=other, loopback=True):
            pass
    # Same module names, other shapes of work: a model with one op more in its first block.
    wider = TinyLM(d=64)
    wider.blocks[0].ln1 = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.ReLU())
    with pytest.raises(
        PlanError,
        match=r"ran 'blocks.0.ln1.0/native_layer_norm', which "
        r"saves .* plan is at ops\[0\]",
    ):
        with ferry.offload(plan=plan, model=wider, loopback=True):
            loss_of(wider(x))


def test_a_forward_that_stops_early_is_refused():
    model, x, plan = traced_plan()
    with pytest.raises(PlanError, match=r"the forward ended before op 'pow'"):
        with ferry.offload(plan=plan, model=model, loopback=True):
            model(x)  # the loss, which the plan covers, is not computed


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"format": "ferry.plan/2"}, 'format: expected "ferry.plan/1", got "ferry.plan/2"'),
        ({"ops": [{"name": "x", "saved": "evict"}]}, r'ops\[0\].saved: unknown decision "evict"'),
        ({"ops": [{"name": "x", "saved": "recompute"}]}, "recomputed but lies in no checkpoint"),
        ({"regions": [{"first_op": 0, "end_op": 9}]}, r"regions\[0\].end_op: 9 must be above"),
        ({"knobs": {"windows": 1}}, r'knobs: unknown key "windows"'),
        ({"device": None}, "device: expected a name"),
    ],
)
def test_a_malformed_plan_is_refused_naming_the_place(bad, message):
    # The simulator's own checks (ferry simulate --plan reads plans with the same code).
    plan = {
        "format": "ferry.plan/1",
        "model": "m",
        "device": "h100-sxm-pcie5",
        "budget_bytes": 0,
        "ops": [{"name": "x", "saved": "keep"}],
        **bad,
    }
    with pytest.raises(PlanError, match=message):
        ferry.offload(plan=plan, loopback=True)
    with pytest.raises(PlanError, match=re.escape("ferry.offload(plan=...): plan: ")):
        ferry.offload(plan=plan, loopback=True)


def test_a_plan_is_checked_once(monkeypatch):
    model, x, plan = traced_plan()
    checked = ferry.load_plan(plan)
    calls = []
    real = ferry._simulator.validate_plan
    monkeypatch.setattr(ferry._simulator, "validate_plan", lambda *a: calls.append(a) or real(*a))
    ref = copy.deepcopy(model)
    loss_of(ref(x)).backward()
    with ferry.offload(plan=checked, model=model, loopback=True):
        loss = loss_of(model(x))
    loss.backward()
    assert_same_grads(ref, model)
    assert calls == []


def test_a_plan_is_read_from_a_file(tmp_path):
    model, x, plan = traced_plan()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    ref = copy.deepcopy(model)
    loss_of(ref(x)).backward()
    with ferry.offload(plan=str(path), model=model, loopback=True):
        loss = loss_of(model(x))
    loss.backward()
    assert_same_grads(ref, model)
    with pytest.raises(PlanError, match="missing.json: cannot read it"):
        ferry.offload(plan=str(tmp_path / "missing.json"), loopback=True)


def test_auto_plans_under_a_budget_and_trains_bitwise():
    ref, model, ref_x, x = twin(lambda: TinyLM(d=128), lambda: torch.randn(64, 16, 128))
    # Between the floor and the no-offload peak of this model (both with the two 32 MiB cuBLAS
    # workspaces of the H100 profile), no margin: some ops must be recomputed.
    ctx = ferry.auto(model, x, budget="97MiB", margin=0, loss_fn=loss_of)
    assert "step time" in ctx.report
    decisions = {op["saved"] for op in ctx.plan["ops"]}
    assert "recompute" in decisions and ctx.plan["regions"]
    loss_of(ref(ref_x)).backward()
    with ctx:
        loss = loss_of(model(x))
    loss.backward()
    assert_same_grads(ref, model, [ref_x], [x])
    want, _ = expected(ctx.plan, ctx.traced.document)
    assert ctx.plan_counts() == want and want["recomputed"] > 0


def test_auto_below_the_floor_names_the_floor():
    model, x = TinyLM(d=128), torch.randn(64, 16, 128)
    with pytest.raises(PlanError, match="the floor .* is [0-9.]+ MiB"):
        ferry.auto(model, x, budget="1MiB", loss_fn=loss_of)


def test_a_traced_model_plans_again_without_tracing_and_reuses_its_planner(monkeypatch):
    ref, model, ref_x, x = twin(lambda: TinyLM(d=128), lambda: torch.randn(64, 16, 128))
    top = ferry.auto(copy.deepcopy(model), x, budget="1GiB", margin=0, loss_fn=loss_of)
    ran = top.traced.planners.simulations
    assert top.traced.planners.planners == 1 and ran > 0

    def no_trace(*args, **kwargs):
        raise AssertionError("traced again")

    monkeypatch.setattr(ferry._auto, "trace", no_trace)
    ctx = ferry.auto(model, x, budget="97MiB", margin=0, loss_fn=loss_of, traced=top.traced)
    assert ctx.traced is top.traced and ctx.plan["regions"]
    # One planner, which ran only what the new budget added.
    assert top.traced.planners.planners == 1
    assert top.traced.planners.simulations > ran
    reused = re.search(r"\((\d+) more reused\)", ctx.report)
    assert reused and int(reused.group(1)) > 0
    loss_of(ref(ref_x)).backward()
    with ctx:
        loss = loss_of(model(x))
    loss.backward()
    assert_same_grads(ref, model, [ref_x], [x])
    # A copy plans afresh: the planners stay with the original.
    assert copy.deepcopy(top.traced).planners is None


def test_a_traced_model_of_another_model_is_refused():
    model, x = TinyLM(d=128), torch.randn(64, 16, 128)
    traced = ferry.trace(TinyLM(d=64), torch.randn(64, 16, 64), loss_fn=loss_of)
    with pytest.raises(ValueError, match=r"ferry.auto: traced: its parameter \S+ has \d+ bytes"):
        ferry.auto(model, x, budget="1GiB", loss_fn=loss_of, traced=traced)
    with pytest.raises(ValueError, match="ferry.auto: traced: it has no parameter"):
        ferry.auto(torch.nn.Linear(128, 128), x, budget="1GiB", loss_fn=loss_of, traced=traced)
    with pytest.raises(TypeError, match="ferry.auto: traced: a TracedModel .* got dict"):
        ferry.auto(model, x, budget="1GiB", loss_fn=loss_of, traced=traced.document)


def test_without_model_the_first_module_called_is_the_model():
    model, x, plan = traced_plan()
    ref = copy.deepcopy(model)
    loss_of(ref(x)).backward()
    ctx = ferry.offload(plan=plan, loopback=True)
    with ctx:
        loss = loss_of(model(x))
    loss.backward()
    assert_same_grads(ref, model)
    assert ctx.plan_counts()["recomputed"] > 0 and ctx.tracked() == 0


LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}


def test_python_m_ferry_auto_traces_and_plans(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_CONFIG))
    common = [
        sys.executable,
        "-m",
        "ferry",
        "auto",
        str(config),
        "--seq",
        "256",
        "--batch",
        "4",
        "--out",
        str(tmp_path / "scenario.json"),
        "--plan",
        str(tmp_path / "plan.json"),
    ]
    # The planner runs in the Python process: no ferry CLI binary is needed.
    env = dict(os.environ, FERRY_CLI="/nonexistent/ferry")
    done = subprocess.run(
        common + ["--budget", "1GiB"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "step time" in done.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    scenario = json.loads((tmp_path / "scenario.json").read_text())
    assert [op["name"] for op in plan["ops"]] == [op["name"] for op in scenario["ops"]]
    done = subprocess.run(
        common + ["--budget", "1MiB"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 1
    assert "the floor" in done.stderr


def test_under_autocast_the_casts_are_ops_of_the_plan_too():
    model, x = gpt()
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        doc = ferry.trace(model, x, loss_fn=loss_of, target="host").document
        want = loss_of(ref(x))
    plan = mixed_plan(doc)
    ctx = ferry.offload(plan=plan, model=model, loopback=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), ctx:
        got = loss_of(model(x))
    want.backward()
    got.backward()
    assert torch.equal(want, got)
    assert_same_grads(ref, model)
    assert any("_to_copy" in op["name"] for op in plan["ops"])
    assert ctx.plan_counts() == expected(plan, doc)[0]
