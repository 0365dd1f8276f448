"""Every traced op carries its operator (`kind`, docs/model-format.md, Op kinds), and the traced
models the C++ tests read (tests/data/traced: `tests/unit/op_sac_test.cpp` checks op-sac on the
tiny ones, the exhaustive plan tests search the sized ones) are what a trace writes today."""

import pytest
import torch

from ferry._trace import trace
from test_trace_cli import TINY_LLAMA
from traced_families import (
    FIXTURE_FAMILIES,
    SIZED_FAMILIES,
    compact_json,
    fixture_path,
    sized_path,
    trace_family,
    trace_sized,
)

transformers = pytest.importorskip("transformers")

FLASH = "aten._scaled_dot_product_flash_attention.default"
CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"


@pytest.mark.parametrize("family", FIXTURE_FAMILIES)
def test_the_op_sac_fixtures_are_what_a_trace_writes(family):
    with open(fixture_path(family), encoding="utf-8") as f:
        text = f.read()
    fresh = compact_json(trace_family(family).document)
    assert fresh == text, (
        f"tests/data/traced/{family}.json is not what a trace writes now; if the change is "
        f"meant, rewrite it: python tests/python/traced_families.py {family}"
    )


@pytest.mark.parametrize("family", SIZED_FAMILIES)
def test_the_sized_fixtures_are_what_python_m_ferry_trace_writes(family, tmp_path):
    with open(sized_path(family), encoding="utf-8") as f:
        text = f.read()
    fresh = compact_json(trace_sized(family, str(tmp_path)))
    assert fresh == text, (
        f"tests/data/traced/sized/{family}.json is not what a trace writes now; if the change "
        f"is meant, rewrite it: python tests/python/traced_families.py {family}"
    )


def _kinds(traced):
    return [op.get("kind") for op in traced.document["ops"]]


def test_every_traced_op_names_its_operator():
    traced = trace_family("llama")
    ops = traced.document["ops"]
    assert all(op.get("kind") for op in ops), [op["name"] for op in ops if not op.get("kind")]
    by_name = {op["name"]: op["kind"] for op in ops}
    assert by_name["model.layers.0.self_attn.q_proj/mm"] == "aten.mm.default"
    assert by_name["model.layers.0.input_layernorm/pow"] == "aten.pow.Tensor_Scalar"
    assert by_name["model.layers.0.input_layernorm/mean"] == "aten.mean.dim"
    assert by_name["model.layers.0.self_attn/slice"] == "aten.slice.Tensor"
    # The CPU kernel the trace ran, written as the device's (target="device").
    assert by_name[f"model.layers.0.self_attn/{CPU_FLASH.split('.')[1]}"] == FLASH


def test_a_host_trace_names_the_kernel_the_host_runs():
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).train()
        ids = torch.zeros((1, 16), dtype=torch.long)
    kinds = _kinds(trace(model, ids, labels=ids, target="host"))
    assert kinds.count(CPU_FLASH) == 2 and FLASH not in kinds
    device = _kinds(trace(model, ids, labels=ids))
    assert device.count(FLASH) == 2 and CPU_FLASH not in device
