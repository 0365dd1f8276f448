"""`ferry plan --for hf|torchtitan|megatron` (docs/plan.md, "A trainer's own settings").

On llama3-8b-s8192 (one GPU and FSDP over 8), a traced Qwen2.5-7B and a traced Mixtral-8x7B
(their bundled configs cut to four layers, traced at sequence 1024):

* the report's space is the trainer's space as this test enumerates it on its own (for hf,
  each every_n_layers with and without the offload flag ferry runs), and every
  setting in it is accepted by the trainer's own configuration code: transformers'
  `HfArgumentParser(TrainingArguments)` and `TrainingArguments`, torchtitan's tyro subcommand
  (`ActivationCheckpointingConfig` with torchtitan's registry) and its policy's `apply`,
  Megatron-LM's argument parser (where `megatron.training` imports: Python 3.12 and later;
  else the flags as it derives them from `TransformerConfig`'s fields) and Megatron-Core's
  `TransformerConfig`;
* the setting printed is the fastest of those that fit the budget (the first of equals);
* `ferry.simulate(trainer=..., trainer_flags=...)` of the printed flags gives the printed
  figures exactly;
* a budget no setting fits is refused, naming the smallest budget that plans, and that budget
  plans while one byte less does not.
"""

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import warnings

import pytest
import torch

import ferry
from ferry._cli import trace as trace_cli
from ferry_cli import cli

LLAMA = "llama3-8b-s8192"
MODULE_ORDER = ["core_attn", "mlp", "moe"]


def _bundled(name, layers=4):
    with open(os.path.join(trace_cli.CONFIG_DIR, name + ".json"), encoding="utf-8") as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    return config


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """name -> (the traced model's path, its layers, Megatron's modules it has)."""
    root = tmp_path_factory.mktemp("trainers")
    out = {}
    for name, modules in (
        ("qwen2.5-7b", ["core_attn", "mlp"]),
        ("mixtral-8x7b", ["core_attn", "moe"]),
    ):
        cfg = root / f"{name}.json"
        cfg.write_text(json.dumps(_bundled(name)))
        model = root / f"{name}.model.json"
        args = [str(cfg), "--seq", "1024", "--batch", "1", "--dtype", "bf16"]
        assert trace_cli.main(args + ["--optimizer", "adamw", "--out", str(model)]) == 0
        out[name] = (str(model), 4, modules)
    return out


def expected_space(trainer, layers, modules):
    """The trainer's settings as the Python configuration's keywords, in the report's order."""
    if trainer == "hf":
        # Each every_n_layers without and with ferry's offload of the checkpointed layers'
        # inputs (the offload flag after ferry.enable_gradient_checkpointing); a keyword at its
        # default is left out.
        space = [{"activation_checkpointing": False}]
        for n in range(1, layers + 1):
            for offload in (False, True):
                kwargs = ({"every_n_layers": n} if n > 1 else {}) | (
                    {"offload": True} if offload else {}
                )
                row = {"activation_checkpointing": True}
                if kwargs:
                    row["activation_checkpointing_kwargs"] = kwargs
                space.append(row)
        return space
    if trainer == "torchtitan":
        return [{"activation_checkpoint": m} for m in ("none", "full", "selective")]
    space = [{"recompute_granularity": None}]
    for method in ("uniform", "block"):
        space += [
            {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": n}
            for n in range(1, layers + 1)
        ]
    for mask in range(1, 1 << len(modules)):
        chosen = [m for i, m in enumerate(modules) if mask >> i & 1]
        space.append({"recompute_granularity": "selective", "recompute_modules": chosen})
    return space


# The trainers' own configuration code.


def check_hf(settings, flags, tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        args=flags + ["--output_dir", str(tmp_path), "--report_to", "none"]
    )
    assert args.activation_checkpointing == settings["activation_checkpointing"]
    kwargs = args.activation_checkpointing_kwargs or {}
    assert kwargs == settings.get("activation_checkpointing_kwargs", {})
    direct = TrainingArguments(output_dir=str(tmp_path), report_to="none", **settings)
    assert direct.activation_checkpointing == args.activation_checkpointing


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.mlp = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = x + torch.nn.functional.scaled_dot_product_attention(*(self.attn(x),) * 3)
        return h + self.mlp(torch.relu(h))


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): _Block() for i in range(2)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def check_torchtitan(settings, flags):
    import tyro
    from torchtitan.config import manager
    from torchtitan.distributed import activation_checkpoint as ac

    @dataclasses.dataclass
    class Config:  # the field of torchtitan's Trainer.Config, with its default
        activation_checkpoint: ac.ActivationCheckpointingConfig = dataclasses.field(
            default_factory=ac.SelectiveAC.Config
        )

    parsed = tyro.cli(Config, args=flags, default=Config(), registry=manager.custom_registry)
    kind = {"none": type(None), "full": ac.FullAC.Config, "selective": ac.SelectiveAC.Config}
    assert type(parsed.activation_checkpoint) is kind[settings["activation_checkpoint"]]
    if parsed.activation_checkpoint is None:
        return
    # torchtitan's own apply: every block wrapped, and a step runs through the wrappers.
    model = _Model()
    parsed.activation_checkpoint.build().apply(model)
    for block in model.layers.values():
        assert type(block).__name__ == "CheckpointWrapper"
    x = torch.randn(2, 4, 8, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


def megatron_flags(flags):
    """Megatron-LM's reading of `flags`: its own parser where megatron.training imports (Python
    3.12 and later); else the flags as it derives them from TransformerConfig's fields
    (`ArgumentGroupFactory`: `--` and the field's name with dashes), each value as its field."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:
        add_megatron_arguments = None
    if add_megatron_arguments is not None:
        parser = argparse.ArgumentParser(allow_abbrev=False)
        add_megatron_arguments(parser)
        return vars(parser.parse_args(flags))
    fields = {
        "--" + f.name.replace("_", "-"): f.name for f in dataclasses.fields(TransformerConfig)
    }
    args, key = {}, None
    for word in flags:
        if word.startswith("--"):
            key = fields[word]  # a flag Megatron-LM does not derive fails here
            args[key] = None
        elif key == "recompute_modules":
            args[key] = (args[key] or []) + [word]
        else:
            args[key] = int(word) if word.isdigit() else word
    return args


def check_megatron(settings, flags, layers, moe):
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = megatron_flags(flags)
    for key, value in settings.items():
        assert args.get(key) == value, key
    extra = {"num_moe_experts": 8, "moe_grouped_gemm": True} if moe else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=layers, hidden_size=64, num_attention_heads=4, **extra, **settings
        )
    assert config.recompute_granularity == settings["recompute_granularity"]


def check_settings(trainer, space, layers, modules, tmp_path):
    for row in space:
        if trainer == "hf":
            check_hf(row["settings"], row["flags"], tmp_path)
        elif trainer == "torchtitan":
            check_torchtitan(row["settings"], row["flags"])
        else:
            check_megatron(row["settings"], row["flags"], layers, "moe" in modules)


def check_choice(report, trainer, model, fsdp, budget_bytes, layers, modules, tmp_path):
    t = report["trainer"]
    assert t["trainer"] == trainer
    space = t["space"]
    assert [row["settings"] for row in space] == expected_space(trainer, layers, modules)
    check_settings(trainer, space, layers, modules, tmp_path)
    if trainer == "hf":
        # The printed Python configuration, as written, is TrainingArguments' call.
        from transformers import TrainingArguments

        def arguments(**settings):
            return TrainingArguments(output_dir=str(tmp_path), report_to="none", **settings)

        printed = eval(t["best"]["python"], {"TrainingArguments": arguments})  # noqa: S307
        kwargs = t["best"]["settings"].get("activation_checkpointing_kwargs") or {}
        assert (printed.activation_checkpointing_kwargs or {}) == kwargs
        # A setting with ferry's offload, its flags read back by simulate: its figures.
        offloading = [
            r
            for r in space
            if r["settings"].get("activation_checkpointing_kwargs", {}).get("offload")
        ]
        assert len(offloading) == layers
        row = offloading[len(offloading) // 2]
        flags = shlex.join(row["flags"])
        run = ferry.simulate(model, trainer="hf", trainer_flags=flags, set_to_none=False, **fsdp)
        run = run["result"]
        assert run["telemetry"]["offloaded"] > 0
        for key in ("step_time_ns", "peak_reserved_bytes", "peak_allocated_bytes"):
            assert run[key] == row[key], key
    fitting = [
        r for r in space if r["fits"] and r["peak_reserved_bytes"] <= t["planned_budget_bytes"]
    ]
    assert [r["fits_budget"] for r in space] == [r in fitting for r in space]
    assert fitting, "the budget was chosen for some setting to fit"
    fastest = min(fitting, key=lambda r: r["step_time_ns"])
    best = t["best"]
    assert best["settings"] == fastest["settings"]
    assert best["step_time_ns"] <= min(r["step_time_ns"] for r in fitting)
    assert best["hazards"] == 0
    # The checked run's figures are its timing run's: the space's figures are simulate's too.
    for key in ("step_time_ns", "peak_reserved_bytes", "peak_allocated_bytes"):
        assert best[key] == fastest[key], key
    # ferry simulate of the printed flags, the gradients held as the planner holds them: the
    # printed figures, exactly.
    run = ferry.simulate(
        model, trainer=trainer, trainer_flags=best["command_line"], set_to_none=False, **fsdp
    )["result"]
    assert run["step_time_ns"] == best["step_time_ns"]
    assert run["peak_reserved_bytes"] == best["peak_reserved_bytes"]
    assert run["peak_allocated_bytes"] == best["peak_allocated_bytes"]
    assert run["hazards"] == 0


def plan_for(model, trainer, budget, fsdp):
    return ferry.plan(model, budget=budget, margin=0, trainer=trainer, **fsdp)


CASES = [
    ("llama3-8b", {}),
    ("llama3-8b", {"fsdp": 8}),
    ("qwen2.5-7b", {}),
    ("mixtral-8x7b", {}),
]


@pytest.mark.parametrize("trainer", ["hf", "torchtitan", "megatron"])
@pytest.mark.parametrize("name,fsdp", CASES, ids=[f"{n}-fsdp{f.get('fsdp', 1)}" for n, f in CASES])
def test_the_trainers_best_setting_is_its_fastest_that_fits(traced, tmp_path, name, fsdp, trainer):
    if name == "llama3-8b":
        model, layers, modules = LLAMA, 32, ["core_attn", "mlp"]
    else:
        model, layers, modules = traced[name]
    # First the whole space at the device's memory, then a budget between its smallest and
    # largest peaks, where some settings fit and some do not.
    roomy = plan_for(model, trainer, None, fsdp)["trainer"]["space"]
    peaks = sorted(r["peak_reserved_bytes"] for r in roomy if r["fits"])
    budget = peaks[len(peaks) // 2]
    report = plan_for(model, trainer, budget, fsdp)
    check_choice(report, trainer, model, fsdp, budget, layers, modules, tmp_path)
    # Below the space's smallest peak: refused, naming the smallest budget that plans there.
    with pytest.raises(
        ferry.PlanError, match=f"smallest budget that plans in {trainer}'s space"
    ) as e:
        plan_for(model, trainer, peaks[0] - 1, fsdp)
    assert f"({peaks[0]} bytes" in str(e.value)
    assert e.value.exit_code == 1


@pytest.mark.parametrize("trainer", ["hf", "torchtitan", "megatron"])
def test_the_flags_file_plan_writes_is_what_simulate_runs(traced, tmp_path, trainer):
    """End to end through the command line: `ferry plan --for T --trainer-config FILE --json`,
    then `ferry simulate --for T --trainer-config FILE --keep-grads --json` (the gradients held
    between steps, as the planner holds them) prints the report's figures."""
    model = traced["mixtral-8x7b"][0]
    flags = tmp_path / f"{trainer}.flags"
    common = ["--model", model, "--for", trainer, "--trainer-config", str(flags), "--json"]
    planned = subprocess.run([cli(), "plan", *common], capture_output=True, text=True, timeout=600)
    assert planned.returncode == 0, planned.stderr
    best = json.loads(planned.stdout)["trainer"]["best"]
    assert flags.read_text().strip() == best["command_line"]
    ran = subprocess.run(
        [cli(), "simulate", *common, "--keep-grads"], capture_output=True, text=True, timeout=600
    )
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)["result"]
    for key in (
        "step_time_ns",
        "peak_reserved_bytes",
        "peak_allocated_bytes",
        "recompute_ns",
        "hazards",
    ):
        assert result[key] == best[key], key
