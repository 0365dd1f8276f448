"""`ferry.trace(..., compiled=True)` and `python -m ferry trace --compiled`: the eager trace with
each chain of fusible ops timed as one fused kernel (docs/trace.md, Compiled; Note [Costs of a
compiled step] in ferry/_trace/_compiled.py); `fused_norms=True` and `--fused-norms`: each call
of a normalization module so (Note [Fused norms])."""

import argparse
import copy
import json
import subprocess

import pytest
import torch

from ferry_cli import cli

transformers = pytest.importorskip("transformers")

from ferry._cli import trace as trace_cli  # noqa: E402
from ferry._trace import trace  # noqa: E402
from ferry._trace._compiled import fuse, fused_groups, is_normalization  # noqa: E402
from traced_families import build  # noqa: E402

#: Two Llama layers large enough that the simulated step is bound by the device, not by
#: launching its ops (a compiled trace keeps every op, and launches are not fused): hidden 1024,
#: sequence 4096. On fake tensors it traces as fast as a tiny one.
SMALL_LLAMA = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
SEQ = 4096
COST_KEYS = ("bytes", "backward_bytes")


def small_llama():
    """The Llama as `python -m ferry trace` builds it (bf16, meta device, training)."""
    args = argparse.Namespace(
        dtype="bf16", attention="sdpa", gradient_checkpointing=False, lora_rank=0
    )
    return trace_cli.build_model(SMALL_LLAMA, args)


def trace_llama(compiled, fused_norms=False):
    model = small_llama()
    with torch.device("meta"):
        ids = torch.zeros((1, SEQ), dtype=torch.long)
    return trace(model, ids, labels=ids, name="small", compiled=compiled, fused_norms=fused_norms)


@pytest.fixture(scope="module")
def llama():
    return trace_llama(False), trace_llama(True)


def without_costs(op):
    return {k: v for k, v in op.items() if k not in COST_KEYS}


def extern(op):
    """A library kernel in the document: FLOPs from a formula (matmuls, attention)."""
    return op["flops"] > 0 or "gemm" in op


def check_groups(document, groups):
    """What a fused group must be: consecutive ops of one layer, no library kernel among them,
    and maximal (what follows a group is a library kernel or another layer's op); every op
    outside the groups is a library kernel (the Llama has no uncosted op)."""
    ops = document["ops"]
    grouped = set()
    for group in groups:
        assert list(group) == list(range(group.start, group.stop)) and len(group) > 0
        layers = {ops[i].get("layer", -1) for i in group}
        assert len(layers) == 1, f"group {group} crosses layers {sorted(layers)}"
        assert not any(extern(ops[i]) for i in group), f"group {group} holds a library kernel"
        if group.stop < len(ops):
            after = ops[group.stop]
            assert extern(after) or after.get("layer", -1) != ops[group.start].get("layer", -1)
        grouped.update(group)
    for i, op in enumerate(ops):
        assert i in grouped or extern(op), f"ops[{i}] {op['name']} is in no group"


def test_compiled_keeps_everything_but_the_bytes(llama):
    eager, compiled = llama
    e, c = eager.document, compiled.document
    assert c["tensors"] == e["tensors"]
    assert (c["name"], c["loss"], c["format"]) == (e["name"], e["loss"], e["format"])
    assert [without_costs(op) for op in c["ops"]] == [without_costs(op) for op in e["ops"]]
    assert eager.compiled is None and compiled.compiled is not None
    forward = [sum(op["bytes"] for op in d["ops"]) for d in (e, c)]
    backward = [sum(op["backward_bytes"] for op in d["ops"]) for d in (e, c)]
    assert forward[1] < forward[0] and backward[1] < backward[0]
    fused = compiled.compiled
    assert (fused.bytes_before, fused.bytes_after) == tuple(forward)
    assert (fused.backward_bytes_before, fused.backward_bytes_after) == tuple(backward)
    for before, after in zip(e["ops"], c["ops"]):
        if extern(before):
            assert (after["bytes"], after["backward_bytes"]) == (
                before["bytes"],
                before["backward_bytes"],
            ), before["name"]


def test_groups_are_runs_of_fusible_ops_within_a_layer(llama):
    eager, compiled = llama
    groups = compiled.compiled.groups
    check_groups(compiled.document, groups)
    # Norms, rotary, SiLU, products and residual adds in each of the two layers, the norm and
    # the loss outside them.
    per_layer = {}
    for group in groups:
        layer = compiled.document["ops"][group.start].get("layer", -1)
        per_layer[layer] = per_layer.get(layer, 0) + 1
    assert per_layer[0] == per_layer[1] >= 5
    ops_e, ops_c = eager.document["ops"], compiled.document["ops"]
    for group in groups:
        # A fused kernel moves no more than the ops it replaces, and its costs sit on one op
        # forward and one op backward.
        assert sum(ops_c[i]["bytes"] for i in group) <= sum(ops_e[i]["bytes"] for i in group)
        assert sum(ops_c[i]["bytes"] > 0 for i in group) <= 1
        assert sum(ops_c[i]["backward_bytes"] > 0 for i in group) <= 1


def test_the_check_catches_a_group_across_layers(llama):
    """A planted fault: two groups of neighbouring layers merged into one is caught, and so is
    a group cut short of its maximal run."""
    _, compiled = llama
    doc, groups = compiled.document, list(compiled.compiled.groups)
    ops = doc["ops"]
    k = next(
        k
        for k in range(len(groups) - 1)
        if groups[k].stop == groups[k + 1].start
        and ops[groups[k].start].get("layer", -1) != ops[groups[k + 1].start].get("layer", -1)
    )
    merged = groups[:k] + [range(groups[k].start, groups[k + 1].stop)] + groups[k + 2 :]
    with pytest.raises(AssertionError, match="crosses layers"):
        check_groups(doc, merged)
    long = next(g for g in groups if len(g) > 1)
    cut = [g for g in groups if g != long] + [range(long.start, long.stop - 1)]
    with pytest.raises(AssertionError):
        check_groups(doc, cut)


def test_fused_groups_end_at_a_library_kernel_or_a_layer():
    ops = [{"layer": layer} for layer in (0, 0, 0, 0, 1, 1, -1)]
    fusible = [True, True, False, True, True, True, True]
    assert fused_groups(ops, fusible) == [range(0, 2), range(3, 4), range(4, 6), range(6, 7)]


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4, bias=False)

    def forward(self, x):
        return self.fc((x * 2 + 1).relu())


def test_a_small_chain_costs_what_its_fused_kernel_moves():
    """`(x * 2 + 1).relu()` then a linear layer and a sum, float32, x [16, 8] requiring grad.
    The chain is one group: it reads x (512 bytes) and writes the ReLU's output (512: the
    linear layer reads it and the ReLU saves it); the products in between stay in registers.
    Backward reads the gradient the matmul writes for the ReLU's output (512) and the saved
    output (512) and writes x's gradient (512). The sum is a group of its own: it reads the
    matmul's output (256) and writes the loss (4); backward reads the loss's gradient (4) and
    writes the matmul output's (256)."""
    torch.manual_seed(0)
    x = torch.randn(16, 8, requires_grad=True)
    kwargs = {"loss_fn": lambda out: out.sum()}
    eager = trace(Chain(), x, **kwargs).document
    traced = trace(Chain(), x, compiled=True, **kwargs)
    ops = {op["name"]: op for op in traced.document["ops"]}
    eager_ops = {op["name"]: op for op in eager["ops"]}
    assert [eager_ops[n]["bytes"] for n in ("mul", "add", "relu")] == [1024, 1024, 1024]
    assert (ops["mul"]["bytes"], ops["mul"]["backward_bytes"]) == (512 + 512, 0)
    assert (ops["add"]["bytes"], ops["add"]["backward_bytes"]) == (0, 0)
    assert (ops["relu"]["bytes"], ops["relu"]["backward_bytes"]) == (0, 512 + 512 + 512)
    assert (ops["fc/mm"]["bytes"], ops["fc/mm"]["backward_bytes"]) == (
        eager_ops["fc/mm"]["bytes"],
        eager_ops["fc/mm"]["backward_bytes"],
    )
    assert (ops["sum"]["bytes"], ops["sum"]["backward_bytes"]) == (256 + 4, 4 + 256)
    assert [list(g) for g in traced.compiled.groups] == [
        [i for i, op in enumerate(traced.document["ops"]) if op["name"] in names]
        for names in (("mul", "add", "relu", "fc/t"), ("sum",))
    ]


def tensor(name, nbytes, role="activation", **extra):
    return {"name": name, "bytes": nbytes, "dtype": "f32", "role": role, **extra}


def op(name, inputs, outputs, saved=(), flops=0, nbytes=4096, layer=0):
    return {
        "name": name,
        "layer": layer,
        "flops": flops,
        "bytes": nbytes,
        "backward_flops": 2 * flops,
        "backward_bytes": 2 * nbytes,
        "inputs": list(inputs),
        "outputs": list(outputs),
        "saved": list(saved),
    }


def document(ops, tensors):
    return {"format": "ferry.model/1", "name": "hand", "tensors": tensors, "ops": ops}


def test_outputs_read_outside_are_written_and_inside_ones_are_not():
    """a -> A, b(A) -> B, c(A, B) -> C, then a matmul reading A and C: A leaves the group (the
    matmul reads it) though a later op of the group reads it too; B stays inside; C leaves.
    Each output the matmul reads brings its gradient back once."""
    tensors = [
        tensor("x", 1024, "input"),
        tensor("w", 64, "param"),
        tensor("A", 1024),
        tensor("B", 1024),
        tensor("C", 1024),
        tensor("D", 128),
    ]
    ops = [
        op("a", ["x"], ["A"]),
        op("b", ["A"], ["B"]),
        op("c", ["A", "B"], ["C"], saved=["B"]),
        op("mm", ["A", "C", "w"], ["D"], flops=1000),
    ]
    doc = document(ops, tensors)
    doc["loss"] = "D"
    fused = fuse(doc, [True, True, True, False], needs_grad={"w", "A", "B", "C", "D"})
    assert fused.groups == (range(0, 3),)
    # Forward: x read (1024), A, B (saved) and C written (3 * 1024).
    assert [o["bytes"] for o in doc["ops"]] == [1024 + 3 * 1024, 0, 0, 4096]
    # Backward: the gradients of A and C (2 * 1024), the saved B (1024); x needs none.
    assert [o["backward_bytes"] for o in doc["ops"]] == [0, 0, 3 * 1024, 8192]


def test_views_count_the_bytes_of_their_storage_once():
    """Two halves of one storage read by the group count as the storage; a base written with
    only one of its views read outside counts that view."""
    tensors = [
        tensor("P", 2048),
        tensor("P0", 1024, view_of="P", view_offset=0),
        tensor("P1", 1024, view_of="P", view_offset=1024),
        tensor("Q", 4096),
        tensor("Q1", 1024, view_of="Q", view_offset=2048),
        tensor("w", 64, "param"),
        tensor("R", 128),
    ]
    ops = [
        op("mm0", ["w"], ["P", "P0", "P1"], flops=10),
        op("f", ["P0", "P1"], ["Q", "Q1"]),
        op("mm1", ["Q1", "w"], ["R"], flops=10),
    ]
    doc = document(ops, tensors)
    doc["loss"] = "R"
    fuse(doc, [False, True, False], needs_grad={"w", "P", "P0", "P1", "Q", "Q1", "R"})
    assert doc["ops"][1]["bytes"] == 2048 + 1024
    # The gradient of Q1 read, P0's and P1's written (one storage).
    assert doc["ops"][1]["backward_bytes"] == 1024 + 2048


def simulate(model, *options):
    run = subprocess.run(
        [cli(), "simulate", "--model", str(model), "--policy", "none", *options, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["result"]


@pytest.mark.parametrize("checkpoint", ["none", "op-sac", "every:1"])
def test_a_compiled_step_is_faster_with_the_same_memory(llama, tmp_path, checkpoint):
    results = []
    for traced in llama:
        path = tmp_path / f"{traced.compiled is not None}.json"
        traced.save(path)
        results.append(simulate(path, "--checkpoint", checkpoint))
    eager, compiled = results
    assert compiled["step_time_ns"] < eager["step_time_ns"]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert compiled[key] == eager[key], key


def test_the_same_model_gives_the_same_bytes(llama):
    assert trace_llama(True).to_json() == llama[1].to_json()


def test_the_command_and_the_keyword_agree(llama, tmp_path, capsys):
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    out = tmp_path / "out.json"
    argv = [str(config), "--seq", str(SEQ), "--name", "small", "--compiled"]
    assert trace_cli.main([*argv, "--out", str(out)]) == 0
    assert out.read_text() == llama[1].to_json()
    groups = len(llama[1].compiled.groups)
    assert f"small: compiled: {groups} fused groups;" in capsys.readouterr().err
    assert trace_cli.main([*argv[:-1], "--out", str(out)]) == 0
    assert out.read_text() == llama[0].to_json()


def test_fuse_changes_nothing_but_the_costs(llama):
    eager, compiled = llama
    doc = copy.deepcopy(eager.document)
    fusible = [False] * len(doc["ops"])
    fused = fuse(doc, fusible, needs_grad=set())
    assert fused.groups == () and doc == eager.document
    with pytest.raises(ValueError, match="fusible flags"):
        fuse(doc, fusible[1:], needs_grad=set())


# --- Fused norms -------------------------------------------------------------------------------


def norm_paths(model):
    """The test's oracle: the paths of the model's norm modules, by their classes' names (the
    trace decides by what a module is: Note [Fused norms])."""
    return {
        path
        for path, m in model.named_modules()
        if type(m).__name__.endswith(("RMSNorm", "LayerNorm")) or isinstance(m, torch.nn.LayerNorm)
    }


def check_fused_norms(eager, fused, paths):
    """What fused norms must be: the eager trace but for the norms' bytes; one group a norm
    call, holding every op of the call and nothing else; each group moves less than its ops
    did, or as much where the norm is one kernel already."""
    e, f = eager.document, fused.document
    assert f["tensors"] == e["tensors"]
    assert [without_costs(op) for op in f["ops"]] == [without_costs(op) for op in e["ops"]]
    groups = fused.compiled.groups
    grouped = {i for group in groups for i in group}
    module = [op["name"].rpartition("/")[0] for op in e["ops"]]
    calls = {}
    for group in groups:
        assert {module[i] for i in group} <= paths, [e["ops"][i]["name"] for i in group]
        calls[module[group.start]] = calls.get(module[group.start], 0) + 1
        before = sum(e["ops"][i]["bytes"] + e["ops"][i]["backward_bytes"] for i in group)
        after = sum(f["ops"][i]["bytes"] + f["ops"][i]["backward_bytes"] for i in group)
        assert after < before or len(group) == 1, module[group.start]
    assert set(calls) == paths and set(calls.values()) == {1}
    for i, (before, after) in enumerate(zip(e["ops"], f["ops"])):
        assert (i in grouped) == (module[i] in paths), before["name"]
        if i not in grouped:
            assert (after["bytes"], after["backward_bytes"]) == (
                before["bytes"],
                before["backward_bytes"],
            ), before["name"]


def test_fused_norms_fuse_each_call_of_a_norm_and_nothing_else(llama):
    fused = trace_llama(False, fused_norms=True)
    paths = norm_paths(small_llama())
    assert len(paths) == 2 * SMALL_LLAMA["num_hidden_layers"] + 1
    check_fused_norms(llama[0], fused, paths)
    assert fused.compiled.bytes_after < fused.compiled.bytes_before


def test_the_check_of_fused_norms_catches_a_norm_left_eager_or_a_projection_fused(llama):
    """Planted faults: a norm call missing from the groups, and a group over the ops of a
    projection that is no norm, are each caught."""
    fused = trace_llama(False, fused_norms=True)
    paths = norm_paths(small_llama())
    missing = copy.copy(fused)
    missing.compiled = fused.compiled._replace(groups=fused.compiled.groups[1:])
    with pytest.raises(AssertionError):
        check_fused_norms(llama[0], missing, paths)
    ops = fused.document["ops"]
    mm = next(i for i, op in enumerate(ops) if op["name"].endswith("q_proj/mm"))
    extra = copy.copy(fused)
    extra.compiled = fused.compiled._replace(groups=(*fused.compiled.groups, range(mm, mm + 1)))
    with pytest.raises(AssertionError):
        check_fused_norms(llama[0], extra, paths)


@pytest.mark.parametrize("family", ["gemma2", "gpt2", "mixtral", "deepseek_v3"])
def test_fused_norms_in_other_families(family):
    """Gemma-2's norms scale by one plus their weight, GPT-2's LayerNorm is one kernel already,
    DeepSeek-V3's attention normalizes its low-rank projections, Mixtral routes to experts."""
    model = build(family)
    with torch.device("meta"):
        ids = torch.zeros((1, 32), dtype=torch.long)
    eager = trace(model, ids, labels=ids, name=family)
    fused = trace(model, ids, labels=ids, name=family, fused_norms=True)
    check_fused_norms(eager, fused, norm_paths(model))


def test_a_norm_is_a_module_without_submodules_whose_parameters_are_vectors():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for norm in (torch.nn.LayerNorm(8), torch.nn.RMSNorm(8), LlamaRMSNorm(8)):
        assert is_normalization(norm), norm
    others = (
        torch.nn.LayerNorm(8, elementwise_affine=False),  # no parameter: one kernel already
        torch.nn.Linear(8, 8),
        torch.nn.Embedding(8, 8),
        torch.nn.SiLU(),
        torch.nn.Sequential(torch.nn.LayerNorm(8)),
    )
    for other in others:
        assert not is_normalization(other), other


@pytest.mark.parametrize("checkpoint", ["none", "op-sac"])
def test_fused_norms_make_a_step_faster_with_the_same_memory(llama, tmp_path, checkpoint):
    paths = [tmp_path / "eager.json", tmp_path / "fused.json"]
    llama[0].save(paths[0])
    trace_llama(False, fused_norms=True).save(paths[1])
    eager, fused = (simulate(path, "--checkpoint", checkpoint) for path in paths)
    assert fused["step_time_ns"] < eager["step_time_ns"]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        assert fused[key] == eager[key], key


def test_the_fused_norms_command_and_the_keyword_agree(tmp_path, capsys):
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    out = tmp_path / "out.json"
    argv = [str(config), "--seq", str(SEQ), "--name", "small", "--fused-norms"]
    assert trace_cli.main([*argv, "--out", str(out)]) == 0
    fused = trace_llama(False, fused_norms=True)
    assert out.read_text() == fused.to_json()
    groups = len(fused.compiled.groups)
    assert f"small: fused norms: {groups} fused groups;" in capsys.readouterr().err
