"""Plans for one rank's cut under tensor parallelism, applied to the modules torch's
parallelize_module parallelized, over gloo on CPU, 2 processes, on the asynchronous loopback
device (tests/python/conftest.py): `ferry.auto` reads the degree from the DTensor parameters'
mesh, traces the whole model, plans it as `ferry plan --tp 2` does and applies the plan, and
each rank's loss and gradients are bitwise those of the same parallelized step without ferry.

Two tiny random decoders (transformers configs), parallelized two ways:

* Llama as torchtitan parallelizes a decoder: sequence parallelism on the norms, the
  projections colwise and rowwise, the embedding and the head by vocabulary; the residual
  stream is a DTensor split by tokens, and DTensor all-gathers and reduce-scatters it as the
  simulator's cut does, so each of the cut's collectives is matched to the rank's.
* Mixtral with its attention parallelized without sequence parallelism (q, k, v colwise, o
  rowwise, all-reduced) and the head colwise; the routed experts run whole on each rank (torch
  has no parallel style for grouped experts). None of the cut's collectives is issued: they are
  skipped, and the all-reduces are ops the plan lacks.

For each model: the plan at the whole device (no offload), at the floor `ferry.auto` names
when it refuses a smaller budget, and halfway; then random plans over the rank's ops (each layer
a checkpoint region or not, each op kept, offloaded or recomputed, the cut's collectives among
them). A tp= that is not the mesh's size is refused, naming both.
"""

import os
import random
import sys

import pytest
import torch

from gloo_ranks import ranks_fixture, run_rank
from traced_families import decoder_fields

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
FAMILIES = ("llama", "mixtral")
VOCAB, HIDDEN, LAYERS = 256, 64, 2
BATCH, SEQ = 2, 128
#: Random plans a model.
RANDOM_PLANS = 4
#: The planted fault: a region offloads a collective's output before its wait.
FAULT = "offload_collectives_early"


def _model(family):
    import transformers

    fields = decoder_fields(VOCAB, HIDDEN, LAYERS, SEQ)
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).train()
    config = transformers.MixtralConfig(**fields, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config).train()


def _styles(family, model):
    """The parallel styles of each module, as parallelize_module takes them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    sequence = family == "llama"
    styles = {}
    for i in range(len(model.model.layers)):
        layer = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj"):
            styles[f"{layer}self_attn.{name}"] = ColwiseParallel()
        if not sequence:
            styles[f"{layer}self_attn.o_proj"] = RowwiseParallel()
            continue
        for norm in ("input_layernorm", "post_attention_layernorm"):
            styles[layer + norm] = SequenceParallel()
        styles[f"{layer}self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
        )
        styles[f"{layer}self_attn.o_proj"] = RowwiseParallel(
            output_layouts=Shard(1), use_local_output=False
        )
        styles[f"{layer}mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        styles[f"{layer}mlp.gate_proj"] = ColwiseParallel()
        styles[f"{layer}mlp.up_proj"] = ColwiseParallel()
        styles[f"{layer}mlp.down_proj"] = RowwiseParallel(
            output_layouts=Shard(1), use_local_output=False
        )
    if sequence:
        styles["model.embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
        styles["model.norm"] = SequenceParallel()
        styles["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    else:
        styles["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return styles


def _local(t):
    """A DTensor's local shard; a tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def loss_fn(out):
    return out.logits.float().mean()


def _layer_spans(plan):
    """The plan's ops of each layer (``model.layers.N``), by N, each a run of ops."""
    from ferry._names import op_path

    spans = {}
    for i, op in enumerate(plan["ops"]):
        parts = op_path(op["name"]).split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2:
            spans.setdefault(parts[2], []).append(i)
    for layer, span in spans.items():
        assert span == list(range(span[0], span[-1] + 1)), (layer, span)
    return spans


def _with_decisions(plan, regions, decisions):
    """``plan`` with these regions and decisions; every byte may be offloaded: no minimum
    size, no window."""
    return {
        **{k: v for k, v in dict(plan).items() if k not in ("ops", "regions", "knobs")},
        "knobs": {"min_bytes": 0, "window_bytes": 0},
        "regions": regions,
        "ops": [{"name": op["name"], "saved": d} for op, d in zip(plan["ops"], decisions)],
    }


def _random_plan(plan, rng):
    """The rank's ops of ``plan`` with random decisions: each layer's run of ops a region
    (inputs kept or offloaded; ops kept, offloaded or recomputed) or not (ops kept or
    offloaded)."""
    spans = _layer_spans(plan)
    decisions = [rng.choice(("keep", "offload")) for _ in plan["ops"]]
    regions = []
    for layer in sorted(spans, key=int):
        span = spans[layer]
        if rng.random() < 0.5:
            continue
        inputs = rng.choice(("keep", "offload"))
        regions.append({"first_op": span[0], "end_op": span[-1] + 1, "inputs": inputs})
        for i in span:
            decisions[i] = rng.choice(("keep", "offload", "recompute"))
    return _with_decisions(plan, regions, decisions)


def _collectives_offloaded(plan):
    """``plan``'s ops with each layer a region whose ops are recomputed, but for the cut's
    collectives, offloaded; the ops outside the layers kept."""
    from ferry._names import cut_collective

    spans = _layer_spans(plan)
    decisions = ["keep"] * len(plan["ops"])
    regions = []
    for layer in sorted(spans, key=int):
        span = spans[layer]
        regions.append({"first_op": span[0], "end_op": span[-1] + 1, "inputs": "keep"})
        for i in span:
            name = plan["ops"][i]["name"]
            decisions[i] = "offload" if cut_collective(name) else "recompute"
    return _with_decisions(plan, regions, decisions)


def _run(rank, store_path, out_dir):
    sys.path.insert(0, HERE)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import conftest  # noqa: F401  (the loopback sessions of the test process)
    import ferry
    from ferry.testing import planted_offload

    def body():
        mesh = init_device_mesh("cpu", (WORLD,))
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

        def build(family):
            model = _model(family)
            return parallelize_module(model, mesh, _styles(family, model))

        def step(model, ctx):
            if ctx is None:
                loss = loss_fn(model(ids))
            else:
                with ctx:
                    loss = loss_fn(model(ids))
            loss.backward()
            return loss.detach(), [_local(p.grad).clone() for p in model.parameters()]

        def same(want, got):
            return torch.equal(want[0], got[0]) and all(
                torch.equal(a, b) for a, b in zip(want[1], got[1])
            )

        def results_of(family):
            want = step(build(family), None)
            out = {"plans": []}

            def check(make_ctx, what):
                model = build(family)
                try:
                    ctx = make_ctx(model)
                    got = step(model, ctx)
                except Exception as e:  # the message comes back to the test
                    out["plans"].append({"what": what, "error": f"{type(e).__name__}: {e}"})
                    return None
                out["plans"].append(
                    {
                        "what": what,
                        "bitwise": same(want, got),
                        "tracked": ctx.tracked(),
                        "counts": ctx.plan_counts(),
                        "regions": len(ctx._plan_run.regions),
                    }
                )
                return ctx

            def auto(budget, traced=None, **options):
                return lambda model: ferry.auto(
                    model,
                    ids,
                    budget=str(budget),
                    margin=0,
                    loss_fn=loss_fn,
                    traced=traced,
                    **options,
                )

            # Traced as the model before parallelize_module, byte for byte.
            out["whole_trace"] = (
                ferry.trace(build(family), ids, loss_fn=loss_fn, target="host").to_json()
                == ferry.trace(_model(family), ids, loss_fn=loss_fn, target="host").to_json()
            )
            top = check(auto("80GiB"), "80GiB")
            if top is None:
                return out
            out["collectives_in_plan"] = sum("/tp." in op["name"] for op in top.plan["ops"])
            traced = top.traced
            peak = top.plan["predicted"]["peak_reserved_bytes"]
            try:
                auto("1MiB", traced)(build(family))
                out["floor"] = None
            except ferry.PlanError as e:
                out["floor"] = e.floor
            floor = out["floor"] or peak
            out["peak"] = peak
            for budget in (floor, (floor + peak) // 2):
                ctx = check(auto(budget, traced), f"budget {budget}")
                if ctx is not None:
                    out["plans"][-1]["fits"] = (
                        ctx.plan["predicted"]["peak_reserved_bytes"] <= budget
                    )
            rng = random.Random(7)  # the same plans on both ranks
            for k in range(RANDOM_PLANS):
                plan = _random_plan(top.plan, rng)
                check(
                    lambda model, plan=plan: ferry.offload(
                        plan=plan, model=model, loopback=True, dedup=False
                    ),
                    f"random plan {k}",
                )
            # Each layer a region that recomputes all but the cut's collectives, which it
            # offloads: kept instead, they are read after their wait; with the fault planted,
            # copied before it.
            plan = _collectives_offloaded(top.plan)
            for faults in ((), (FAULT,)):
                check(
                    lambda model, plan=plan, faults=faults: planted_offload(
                        faults=faults, plan=plan, model=model, loopback=True, dedup=False
                    ),
                    f"collectives offloaded, faults {faults}",
                )
            try:
                auto("80GiB", traced, tp=2 * WORLD)(build(family))
                out["wrong_tp"] = None
            except ValueError as e:
                out["wrong_tp"] = str(e)
            return out

        results = {family: results_of(family) for family in FAMILIES}
        # Parameters on two meshes, and on a mesh of two dimensions.
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel

        grid = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
        two = _model("llama")
        parallelize_module(two, mesh, {"lm_head": ColwiseParallel()})
        parallelize_module(two, grid["tp"], {"model.layers.0.mlp.up_proj": ColwiseParallel()})
        flat = _model("llama")
        weight = flat.lm_head.weight
        flat.lm_head.weight = torch.nn.Parameter(
            distribute_tensor(weight.detach(), grid, [Replicate(), Shard(0)])
        )
        for key, model in (("two_meshes", two), ("grid", flat)):
            try:
                ferry.auto(model, ids, budget="80GiB", loss_fn=loss_fn)
                results[key] = None
            except ValueError as e:
                results[key] = str(e)
        # FSDP2's parameters are DTensors too, on a mesh that is no tensor parallelism's.
        from torch.distributed.fsdp import fully_shard

        sharded = _model("llama")
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        try:
            ferry.auto(sharded, ids, budget="80GiB", loss_fn=loss_fn)
            results["fsdp"] = None
        except ValueError as e:
            results["fsdp"] = str(e)
        return results

    run_rank(rank, WORLD, store_path, out_dir, body)


ranks = ranks_fixture(_run, WORLD, "tensor_parallel_plan")


def test_a_tp_without_a_parallelized_model_is_refused():
    import ferry

    model = _model("llama")
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(
        ValueError,
        match=r"^ferry\.auto: tp=2, but the model is parallelized over 1 rank\(s\): it has no "
        r"DTensor parameter \(parallelize it with parallelize_module first\)",
    ):
        ferry.auto(model, ids, budget="80GiB", tp=2)
    for tp in (0, 1.5, True):
        with pytest.raises(TypeError, match=rf"^ferry\.auto: tp: {tp!r} is not a number of ranks"):
            ferry.auto(model, ids, budget="80GiB", tp=tp)
    # tp=1 is the model's own degree: planned as one device.
    assert not ferry.auto(model, ids, budget="80GiB", tp=1, loss_fn=loss_fn).plan["regions"]


@pytest.mark.parametrize("family", FAMILIES)
def test_plans_for_a_ranks_cut_train_bitwise(ranks, family):
    for rank, results in enumerate(ranks):
        got = results[family]
        assert len(got["plans"]) == 3 + RANDOM_PLANS + 2, (rank, got)
        for plan in got["plans"]:
            if FAULT in plan["what"]:
                continue
            assert "error" not in plan, (rank, plan)
            assert plan["bitwise"] and plan["tracked"] == 0, (rank, plan)
            assert plan.get("fits", True), (rank, plan)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plans_are_the_cuts_and_do_what_they_say(ranks, family):
    for rank, results in enumerate(ranks):
        got = results[family]
        # Made for one rank of two: the cut's collectives among the ops.
        assert got["collectives_in_plan"] > 0, (rank, got)
        # Below the no-offload peak the planner found a floor, and its plans checkpoint.
        assert got["floor"] is not None and got["floor"] < got["peak"], (rank, got)
        floor_plan = got["plans"][1]
        assert floor_plan["regions"] > 0 and floor_plan["counts"]["recomputed"] > 0, (rank, got)
        # The random plans offload and recompute.
        randoms = got["plans"][3 : 3 + RANDOM_PLANS]
        assert sum(p["counts"]["offloaded"] for p in randoms) > 0, (rank, got)
        assert sum(p["counts"]["recomputed"] for p in randoms) > 0, (rank, got)


def test_the_cuts_collectives_are_matched_to_dtensors(ranks):
    for rank, results in enumerate(ranks):
        # Under sequence parallelism a rank issues each of the cut's collectives: the
        # embedding's reduce-scatter, a layer's two all-gathers and two reduce-scatters, the
        # head's all-gather.
        llama = results["llama"]
        assert llama["collectives_in_plan"] == 1 + 4 * LAYERS + 1, (rank, llama)
        for plan in llama["plans"]:
            assert plan["counts"]["collectives"] == llama["collectives_in_plan"], (rank, plan)
        # Without it, none: the rowwise outputs are all-reduced instead.
        for plan in results["mixtral"]["plans"]:
            assert plan["counts"]["collectives"] == 0, (rank, plan)


def test_a_collective_offloaded_before_its_wait_is_caught(ranks):
    for rank, results in enumerate(ranks):
        sound, planted = results["llama"]["plans"][-2:]
        assert FAULT not in sound["what"] and FAULT in planted["what"], (rank, results)
        # Every layer's region recomputes all but the collectives: kept, the recomputation
        # reads what their wait completed, and each layer's four were matched.
        assert sound["bitwise"] and sound["counts"]["recomputed"] > 0, (rank, sound)
        assert sound["counts"]["collectives"] == 1 + 4 * LAYERS + 1, (rank, sound)
        # Copied before the wait, they are not what the ranks exchanged.
        assert "error" in planted or not planted["bitwise"], (rank, planted)


def test_a_parallelized_model_is_traced_as_the_whole_model(ranks):
    for rank, results in enumerate(ranks):
        for family in FAMILIES:
            assert results[family]["whole_trace"], (rank, family)


def test_a_model_sharded_by_fsdp2_is_refused(ranks):
    for rank, results in enumerate(ranks):
        assert results["fsdp"] is not None, rank
        assert results["fsdp"].startswith(
            "ferry.auto: the model's parameters are sharded by FSDP2 (fully_shard); ferry.auto "
            "plans a model on one device or one that parallelize_module parallelized"
        ), (rank, results["fsdp"])


def test_parameters_on_several_meshes_or_a_grid_are_refused(ranks):
    for rank, results in enumerate(ranks):
        assert results["two_meshes"] is not None and results["two_meshes"].startswith(
            "ferry.auto: parameters model.layers.0.mlp.up_proj.weight and lm_head.weight lie "
            "on different device meshes"
        ), (rank, results["two_meshes"])
        assert results["grid"] is not None and results["grid"].startswith(
            "ferry.auto: parameter lm_head.weight lies on a 2-dimensional device mesh"
        ), (rank, results["grid"])


def test_a_tp_that_is_not_the_meshs_size_is_refused(ranks):
    for rank, results in enumerate(ranks):
        for family in FAMILIES:
            assert results[family]["wrong_tp"] == (
                f"ferry.auto: tp={2 * WORLD}, but the model is parallelized over {WORLD} "
                f"rank(s): its parameters lie on a mesh of {WORLD} ranks; leave tp out to take "
                "the model's"
            ), (rank, results[family])


def test_a_cuts_collective_runs_in_the_module_of_its_op():
    from ferry._names import cut_collective, op_path
    from ferry._plan._layout import regions_of

    name = "model.layers.0.self_attn.q_proj/mm/tp.all_gather"
    assert cut_collective(name) == ("model.layers.0.self_attn.q_proj/mm", "all_gather_into_tensor")
    assert op_path(name) == "model.layers.0.self_attn.q_proj"
    assert cut_collective("model.layers.0.self_attn.q_proj/mm#1") is None
    assert cut_collective("tp.all_gather") is None
    # A region over one projection's call holds the collective inserted before its matmul.
    ops = ["model.norm/mul", "lm_head/view", "lm_head/mm/tp.all_gather", "lm_head/mm", "mean"]
    plan = {
        "ops": [{"name": n, "saved": "keep"} for n in ops],
        "regions": [{"first_op": 1, "end_op": 4}],
    }
    assert [r.path for r in regions_of(plan)] == ["lm_head"]
