"""Between steps `ferry.simulate` and `ferry.compare` free the gradients by default, as torch's
`optimizer.zero_grad()` has since 2.0 (`set_to_none=True`), and as the Hugging Face `Trainer`'s
`model.zero_grad()` does; `set_to_none=False` (`--keep-grads`) keeps them from set-up on, a
higher peak; Megatron-Core keeps them in its buffers whatever is asked (docs/offload.md)."""

import json
import subprocess

import pytest

import ferry
from ferry_cli import cli

MODEL = "tiny-gpt"
MEGATRON = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"


def allocated(**options):
    return ferry.simulate(MODEL, **options)["result"]["peak_allocated_bytes"]


def test_the_default_frees_the_gradients_and_keep_grads_keeps_them():
    freed = allocated(policy="none")
    assert freed == allocated(policy="none", set_to_none=True)
    assert allocated(policy="none", set_to_none=False) > freed
    rows = {r["name"]: r for r in ferry.compare(MODEL)["rows"]}
    kept = {r["name"]: r for r in ferry.compare(MODEL, set_to_none=False)["rows"]}
    assert rows["none"]["peak_allocated_bytes"] == freed
    assert kept["none"]["peak_allocated_bytes"] > freed


def test_the_cli_defaults_as_python_does():
    def run(*flags):
        out = subprocess.run(
            [cli(), "simulate", "--model", MODEL, "--policy", "none", "--json", *flags],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["result"]["peak_allocated_bytes"]

    assert run() == allocated(policy="none")
    assert run("--keep-grads") == allocated(policy="none", set_to_none=False)


@pytest.mark.parametrize("set_to_none", [None, True, False])
def test_megatron_keeps_its_gradient_buffers(set_to_none):
    options = {"trainer": "megatron", "trainer_flags": MEGATRON, "set_to_none": set_to_none}
    kept = allocated(trainer="megatron", trainer_flags=MEGATRON, set_to_none=False)
    assert allocated(**options) == kept


def test_the_hf_trainer_frees_them():
    flags = "--activation_checkpointing false"
    freed = allocated(trainer="hf", trainer_flags=flags)
    assert freed == allocated(policy="none")
    assert allocated(trainer="hf", trainer_flags=flags, set_to_none=False) > freed
