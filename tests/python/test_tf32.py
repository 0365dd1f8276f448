"""TF32 from torch's float32 matmul and convolution precisions: `ferry.trace` records them as
the document's "matmul_fp32_precision" and "conv_fp32_precision", `python -m ferry trace --tf32`
sets the first for the trace, and the simulator runs such a model's float32 matmuls and
convolutions at the profile's TF32 rate (docs/model-format.md, docs/workload.md)."""

import json
import os

import pytest
import torch

import ferry
from ferry._trace import conv_precision_setting, matmul_precision_setting

#: The ways torch lets a loop allow TF32 for float32 matmuls, each tried in a forked child:
#: torch refuses to read its legacy flags once both its APIs have set them.
WAYS = {
    "torch.set_float32_matmul_precision('high')": "tf32",
    "torch.set_float32_matmul_precision('medium')": "tf32",
    "torch.set_float32_matmul_precision('highest')": None,
    "torch.backends.cuda.matmul.fp32_precision = 'tf32'": "tf32",
    "torch.backends.cuda.matmul.allow_tf32 = True": "tf32",
    "torch.backends.fp32_precision = 'tf32'": "tf32",
    "torch.backends.fp32_precision = 'tf32'; torch.backends.cuda.matmul.fp32_precision = 'ieee'": (
        None
    ),
    "torch.backends.cudnn.allow_tf32 = True": None,  # convolutions', not cuBLAS's
}


#: The ways torch lets a loop keep cuDNN's convolutions from TF32, which it allows by default.
CONV_WAYS = {
    "pass": None,
    "torch.backends.cudnn.conv.fp32_precision = 'ieee'": "ieee",
    "torch.backends.cudnn.allow_tf32 = False": "ieee",
    "torch.backends.cudnn.conv.fp32_precision = 'none'": "ieee",
    "torch.backends.cudnn.allow_tf32 = False; torch.backends.cudnn.allow_tf32 = True": None,
    "torch.backends.cudnn.conv.fp32_precision = 'none'; torch.backends.fp32_precision = 'tf32'": (
        None
    ),
    "torch.backends.cudnn.fp32_precision = 'tf32'; torch.backends.cudnn.allow_tf32 = False": None,
    "torch.set_float32_matmul_precision('highest')": None,  # cuBLAS's, not cuDNN's
}


def in_child(statement, setting=matmul_precision_setting):
    """setting() after `statement`, run in a forked child of this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of it reaches this process but the answer
        os.close(read)
        try:
            exec(statement, {"torch": torch})
            answer = repr(setting())
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            answer = f"error: {error}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        answer = f.read()
    os.waitpid(pid, 0)
    return answer


@pytest.mark.parametrize("statement, expected", list(WAYS.items()))
def test_every_way_torch_sets_the_precision_is_read(statement, expected):
    assert in_child(statement) == repr(expected)
    assert matmul_precision_setting() is None  # this process: torch's default


@pytest.mark.parametrize("statement, expected", list(CONV_WAYS.items()))
def test_every_way_torch_sets_the_convolution_precision_is_read(statement, expected):
    assert in_child(statement, conv_precision_setting) == repr(expected)
    assert conv_precision_setting() is None


def traced(target="device"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)
    )
    x = torch.randn(4096, 2048)
    return ferry.trace(model, x, loss_fn=lambda out: out.sum(), target=target)


@pytest.fixture
def tf32():
    """torch.backends.cuda.matmul.fp32_precision = "tf32" for the test, restored after."""
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = before


def step_ns(model, device):
    result = ferry.simulate(model, device, policy="none", check=False)["result"]
    return result["step_time_ns"]


def test_a_trace_under_tf32_records_it_and_its_float32_matmuls_run_faster(tf32, tmp_path):
    under = traced()
    host = traced("host")
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    plain = traced()
    assert under.document["matmul_fp32_precision"] == "tf32"
    assert "matmul_fp32_precision" not in plain.document
    assert "matmul_fp32_precision" not in host.document  # the CPU's matmuls are not cuBLAS's
    # The same ops and tensors: only the rate of the float32 products differs.
    assert {k: v for k, v in under.document.items() if k != "matmul_fp32_precision"} == (
        plain.document
    )
    # h100-sxm-pcie5: 494.5 TFLOP/s of TF32 against 67 of the CUDA cores' float32.
    assert step_ns(under, "h100-sxm-pcie5") < step_ns(plain, "h100-sxm-pcie5")
    # A profile without a TF32 rate runs them on the CUDA cores either way.
    from ferry._sim import scenarios_dir

    with open(
        os.path.join(scenarios_dir(), "devices", "h100-sxm-pcie5.json"), encoding="utf-8"
    ) as f:
        profile = json.load(f)
    del profile["tf32_flops_per_s"]
    profile["name"] = "h100-no-tf32"
    path = tmp_path / "h100-no-tf32.json"
    path.write_text(json.dumps(profile), encoding="utf-8")
    assert step_ns(under, str(path)) == step_ns(plain, str(path))


def test_a_trace_without_tf32_convolutions_records_it_and_they_run_slower():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 256, 4, stride=4), torch.nn.ReLU(), torch.nn.Conv2d(256, 256, 3)
    )
    x = torch.randn(64, 3, 224, 224)

    def trace(target="device"):
        return ferry.trace(model, x, loss_fn=lambda out: out.sum(), target=target)

    default = trace()
    before = torch.backends.cudnn.conv.fp32_precision
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    try:
        ieee = trace()
        host = trace("host")
    finally:
        torch.backends.cudnn.conv.fp32_precision = before
    assert "conv_fp32_precision" not in default.document  # torch's default: TF32
    assert ieee.document["conv_fp32_precision"] == "ieee"
    assert "conv_fp32_precision" not in host.document  # the CPU's convolutions are not cuDNN's
    assert {k: v for k, v in ieee.document.items() if k != "conv_fp32_precision"} == (
        default.document
    )
    # h100-sxm-pcie5: TF32 at 494.5 TFLOP/s, float32 on the CUDA cores at 67.
    assert step_ns(ieee, "h100-sxm-pcie5") > 2 * step_ns(default, "h100-sxm-pcie5")


def test_a_bad_precision_in_a_document_names_the_member(tmp_path):
    document = traced().document
    document["matmul_fp32_precision"] = "high"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(ValueError, match='matmul_fp32_precision: expected "ieee" or "tf32"'):
        ferry.simulate(str(path), check=False)


transformers = pytest.importorskip("transformers")

from ferry._cli.trace import main  # noqa: E402
from test_trace_cli import TINY_LLAMA  # noqa: E402


def test_the_cli_traces_under_tf32_and_leaves_torch_as_it_was(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA), encoding="utf-8")
    documents = {}
    for flags in ([], ["--tf32"]):
        out = tmp_path / f"scenario{len(flags)}.json"
        argv = [str(config), "--seq", "64", "--dtype", "f32", *flags, "--out", str(out)]
        assert main(argv) == 0
        documents[tuple(flags)] = json.loads(out.read_text(encoding="utf-8"))
        assert torch.backends.cuda.matmul.fp32_precision == "none"  # restored
    assert documents[("--tf32",)]["matmul_fp32_precision"] == "tf32"
    assert "matmul_fp32_precision" not in documents[()]
    argv = [str(config), "--seq", "64", "--tf32", "--target", "host", "--out", str(tmp_path / "h")]
    assert main(argv) == 2
    assert "--tf32: TF32 is cuBLAS's" in capsys.readouterr().err
