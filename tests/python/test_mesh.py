"""``ferry.Mesh``: the mesh keywords of ``ferry.simulate``, ``compare`` and ``plan`` as one
frozen value, whose fields are the simulator's mesh keywords. A call given a mesh returns what
the same call given its fields as keywords returns; a field given both ways, a field no mesh
has, or a mesh of another type is a TypeError naming it."""

import dataclasses

import pytest

import ferry
from ferry import _simulator

MODEL, DEVICE = "gpt2-small-s1024", "h100-sxm-pcie5"


def test_the_fields_are_the_simulators_mesh_keywords_in_its_order():
    names = [f.name for f in dataclasses.fields(ferry.Mesh)]
    assert names == list(_simulator.mesh_fields)
    assert {"fsdp", "nodes", "hsdp", "reshard_after_forward", "tp", "cp", "ep", "pp"} <= set(names)
    # Each is a keyword the functions take: the simulator names the field when its value is
    # wrong rather than refusing the keyword.
    for name in names:
        with pytest.raises((TypeError, ValueError), match=name) as refused:
            ferry.simulate("tiny-gpt", mesh=ferry.Mesh(**{name: object()}))
        assert "unexpected keyword" not in str(refused.value)


def test_a_mesh_is_a_frozen_value():
    mesh = ferry.Mesh(fsdp=8, tp=2)
    assert mesh == ferry.Mesh(tp=2, fsdp=8)
    assert hash(mesh) == hash(ferry.Mesh(tp=2, fsdp=8))
    assert mesh != ferry.Mesh(fsdp=8)
    assert mesh.fsdp == 8 and mesh.tp == 2 and mesh.ep is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.fsdp = 4
    assert dataclasses.replace(mesh, tp=4) == ferry.Mesh(fsdp=8, tp=4)
    assert repr(ferry.Mesh(fsdp=8)).startswith("Mesh(fsdp=8, nodes=None")


def test_an_unknown_field_is_named_with_the_fields_a_mesh_has():
    with pytest.raises(TypeError, match=r"ferry.Mesh has no field 'fsdp_ranks' \(its fields: fsdp"):
        ferry.Mesh(fsdp_ranks=8)
    with pytest.raises(TypeError):
        ferry.Mesh(8)


def test_simulate_and_compare_take_a_mesh_as_its_keywords():
    mesh = ferry.Mesh(fsdp=16, nodes=2, reshard_after_forward=8)
    got = ferry.simulate(MODEL, device=DEVICE, mesh=mesh)
    assert got == ferry.simulate(MODEL, device=DEVICE, fsdp=16, nodes=2, reshard_after_forward=8)
    assert got["fsdp"]["ranks"] == 16
    # The mesh's fields and the other keywords together.
    assert ferry.compare(MODEL, device=DEVICE, mesh=ferry.Mesh(fsdp=8), steps=1) == (
        ferry.compare(MODEL, device=DEVICE, fsdp=8, steps=1)
    )
    # An empty mesh gives nothing: the run without one.
    assert ferry.simulate("tiny-gpt", mesh=ferry.Mesh()) == ferry.simulate("tiny-gpt")


def test_plan_takes_a_mesh_as_its_keywords():
    report = ferry.plan(MODEL, budget="1536MiB", device=DEVICE, mesh=ferry.Mesh(fsdp=8))
    assert report["plan"]["parallelism"] == {"fsdp": 8}
    assert report == ferry.plan(MODEL, budget="1536MiB", device=DEVICE, fsdp=8)


def test_a_pipeline_is_a_mesh_field_bounded_by_its_row():
    # pp is the table's row like the others: a Mesh takes it, and the three functions run it
    # as they run the keyword, bounded 1..64 as the command line's --pp.
    mesh = ferry.Mesh(pp=2)
    assert mesh.pp == 2
    got = ferry.compare("tiny-gpt", device=DEVICE, mesh=mesh, steps=1)
    assert got == ferry.compare("tiny-gpt", device=DEVICE, pp=2, steps=1)
    assert [row["devices"] for row in got["pipeline"]] == [2] * len(got["pipeline"])
    # 1f1b is the default schedule, torchtitan's; gpipe is asked for by name.
    assert {row["schedule"] for row in got["pipeline"]} == {"1f1b"}
    gpipe = ferry.compare("tiny-gpt", device=DEVICE, pp=2, schedule="gpipe", steps=1)
    assert {row["schedule"] for row in gpipe["pipeline"]} == {"gpipe"}
    piped = ferry.simulate("tiny-gpt", device=DEVICE, mesh=mesh)
    assert piped == ferry.simulate("tiny-gpt", device=DEVICE, pp=2)
    assert piped != ferry.simulate("tiny-gpt", device=DEVICE)
    for call in (ferry.simulate, ferry.compare):
        with pytest.raises(ValueError, match=r"^--pp: 65 is not in 1\.\.64$"):
            call("tiny-gpt", mesh=ferry.Mesh(pp=65))
    with pytest.raises(ferry.PlanError, match=r"--pp: 0 is not in 1\.\.64"):
        ferry.plan("tiny-gpt", mesh=ferry.Mesh(pp=0))
    with pytest.raises(TypeError, match="devices"):
        ferry.compare("tiny-gpt", devices=2)


def test_a_mesh_value_is_refused_as_the_keyword_is():
    with pytest.raises(ValueError) as by_keyword:
        ferry.simulate("tiny-gpt", fsdp=4, tp=3)
    with pytest.raises(ValueError) as by_mesh:
        ferry.simulate("tiny-gpt", mesh=ferry.Mesh(fsdp=4, tp=3))
    assert str(by_mesh.value) == str(by_keyword.value)


def test_a_field_given_twice_or_a_mesh_of_another_type_is_refused():
    for call in (ferry.simulate, ferry.compare):
        with pytest.raises(TypeError, match=r"got 'fsdp' both in mesh= and as a keyword"):
            call("tiny-gpt", mesh=ferry.Mesh(fsdp=8), fsdp=8)
    with pytest.raises(TypeError, match=r"plan\(\) got 'tp' both in mesh="):
        ferry.plan("tiny-gpt", mesh=ferry.Mesh(fsdp=8, tp=2), tp=2)
    with pytest.raises(TypeError, match=r"simulate: mesh=\{'fsdp': 8\} is not a ferry.Mesh"):
        ferry.simulate("tiny-gpt", mesh={"fsdp": 8})
