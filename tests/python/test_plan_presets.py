"""The planner and the ferry policy on the bundled presets, on three device profiles, as
test_plan_families.py checks them on traced families (plan_checks.py): the issue's case
(Llama-3.2-3B at sequence 4096, batch 2, as a trace lists it), a GPT-2 and a Llama-3-8B; and the
`ferry` row against `trl` on Llama-3-8B at sequence 16384, whose saved tensors outgrow a 512 MiB
window."""

import pytest

from plan_checks import DEVICES, check_plans_and_rows, cli_json

PRESETS = ("llama3.2-3b-traced-s4096-b2", "gpt2-small-s1024", "llama3-8b-s8192")


@pytest.mark.parametrize("device", DEVICES)
def test_ferry_is_no_slower_than_trl_with_tensors_larger_than_its_window(cli, device):
    code, compare, err = cli_json(
        cli, "compare", "--model", "llama3-8b-s16384", "--device", device, "--no-checker"
    )
    assert code == 0, err
    rows = {r["name"]: r for r in compare["rows"]}
    assert rows["ferry"]["step_time_ns"] <= rows["trl"]["step_time_ns"], rows["ferry"]
    every = rows["checkpoint every layer"]
    assert rows["ferry + checkpoint"]["step_time_ns"] * 100 <= every["step_time_ns"] * 102


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
def test_plan_never_loses_to_a_fixed_row_and_ferry_to_trl(cli, preset, device):
    check_plans_and_rows(cli, preset, preset, device)
