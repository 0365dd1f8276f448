"""ferry's predictions against published GPU measurements, one row each (docs/validation.md,
"Against published GPU measurements": the set-ups, the sources, the commands, the errors).

Each set-up is traced here from the published model shapes (nothing is downloaded), simulated
with `ferry simulate --json` on the device the source names (a profile written into the
test's folder where the bundled ones do not fit it), and each prediction is kept within the
tolerance the document states beside its row: memory and time separately, allocated against
what the source calls active or allocated, reserved against reserved.

The tolerances are what the model achieves today, not targets: a row outside the project's
target (memory 3 %, reserved 5 %, time 8 %) has a wider tolerance here and a sentence in the
document on what the model lacks for it. No model constant is fitted to any row.
"""

import json
import math
import subprocess

import pytest

pytest.importorskip("transformers")

from ferry._cli import trace as trace_cli  # noqa: E402
from ferry_cli import REPO  # noqa: E402
from ferry_cli import cli as ferry_cli  # noqa: E402
from models import bf16_causal_lm, trace_for_offload_activations  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20

# --- Models, as their publishers' config.json files give them --------------------------------

LLAMA_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}
#: meta-llama/Llama-2-7b-hf (torchtitan's "llama 7B" of March 2024: dim 4096, 32 layers,
#: 32 heads, SwiGLU hidden 11008, the Llama 2 tokenizer's 32000 tokens).
LLAMA2_7B = LLAMA_BASE | {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}
#: meta-llama/Llama-2-13b-hf.
LLAMA2_13B = LLAMA2_7B | {
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "num_key_value_heads": 40,
}
#: meta-llama/Meta-Llama-3-8B (Llama 3.1 8B has the same shapes).
LLAMA3_8B = LLAMA_BASE | {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
#: google-bert/bert-large-uncased, with the two-label classification head of the example.
BERT_LARGE = {
    "vocab_size": 30522,
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "num_labels": 2,
}

#: Qwen/Qwen3-8B (36 layers, 32 query and 8 key/value heads of 128, SwiGLU hidden 12288, per-head
#: query and key norms, the Qwen tokenizer's 151,936 tokens, untied output head).
QWEN3_8B = LLAMA_BASE | {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "use_sliding_window": False,
}

# --- Devices ----------------------------------------------------------------------------------


def h100_96gb():
    """torchtitan's H100s, the bundled `h100-sxm-96gb`: 95.0396 GiB as torch reports it (PR
    #165), HBM2e at 2.4 TB/s (benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"),
    on-device copies at half that; the rest, the link and collective figures included, as the
    bundled H100 SXM profile (docs/devices.md)."""
    return bundled("h100-sxm-96gb")


def on_flash(profile):
    """`profile` with fused attention on FlashAttention-2's kernel (`"sdpa_backend": "flash"`),
    where the bundled Hopper profiles have SDPA's default since torch 2.9, cuDNN's
    (pytorch/pytorch#162073; docs/devices.md, Kernel figures): SDPA under an earlier torch (the
    runs of 2024 and early 2025), or flash-attention 2 called by name."""
    return profile | {"kernels": profile["kernels"] | {"sdpa_backend": "flash"}}


def bundled(name):
    with open(f"{REPO}/scenarios/devices/{name}.json") as f:
        return json.load(f)


def v100_16gb():
    """Tesla V100-SXM2 16 GB (the nvidia-smi output of the Hugging Face example: 16160 MiB):
    NVIDIA's V100 datasheet, 125 TFLOP/s FP16 on the tensor cores and FP32 15.7 TFLOP/s (the run
    trains in float32, no tensor cores), HBM2 900 GB/s, PCIe Gen3 x16 to the host (about 12 GB/s
    each way)."""
    profile = bundled("a100-pcie4")
    profile.pop("collectives")
    profile.pop("kernels")  # no V100 kernel figures: the flat roofline
    profile.pop("tf32_flops_per_s")  # Volta's tensor cores have no TF32
    profile["name"] = "v100-sxm2-16gb"
    profile["description"] = "V100 SXM2 16 GB; datasheet peaks, PCIe Gen3 host"
    profile["memory_bytes"] = 16160 * MIB
    profile["flops_per_s"] = 125_000_000_000_000
    profile["fp32_flops_per_s"] = 15_700_000_000_000
    profile["memory_bytes_per_s"] = 900_000_000_000
    profile["d2d"]["bytes_per_s"] = 450_000_000_000
    for way in ("h2d", "d2h"):
        profile[way]["bytes_per_s"] = 12_000_000_000
    profile["pageable"] = {"h2d_bytes_per_s": 6_000_000_000, "d2h_bytes_per_s": 6_000_000_000}
    return profile


# --- Fixtures: each trace and each profile once per module ------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("published_rows")


@pytest.fixture(scope="module")
def devices(root):
    paths = {}
    for name, profile in (
        ("h100-96gb", h100_96gb()),
        ("h100-96gb-flash", on_flash(h100_96gb())),
        ("h100-sxm-pcie5-flash", on_flash(bundled("h100-sxm-pcie5"))),
        ("v100", v100_16gb()),
    ):
        paths[name] = root / f"{name}.json"
        paths[name].write_text(json.dumps(profile))
    return paths


#: torchtitan's FSDP reduces the gradients in float32 (its `mixed_precision_reduce`, float32 by
#: default, as its trainer and graph trainer use it since its first FSDP2 runs); torch's default,
#: the gradients' own dtype, is the simulator's.
TITAN_REDUCE = ("--reduce-dtype", "float32")


def trace_config(root, name, config, seq, batch, *options):
    """The trace of `config` at `batch` x `seq` in bf16, stepped by torch's AdamW as its users
    construct it (`--optimizer adamw`: foreach on a device, as torchtitan stepped it until its PR
    #881 of February 2025 and fms-fsdp does); a row whose trainer steps otherwise passes its own
    `--optimizer` among `options`."""
    path = root / f"{name}.json"
    # Fixtures hold their traces' paths for the module: a name traced twice would change the
    # model under another fixture's rows.
    assert not path.exists(), f"{name} is traced twice"
    (root / f"{name}.config.json").write_text(json.dumps(config))
    args = [str(root / f"{name}.config.json"), "--seq", str(seq), "--batch", str(batch)]
    args += ["--dtype", "bf16", "--optimizer", "adamw", *options, "--out", str(path)]
    assert trace_cli.main(args) == 0
    return path


def _loop_adamw():
    import torch

    class LoopAdamW(torch.optim.Optimizer):
        """AdamW as the Trainer of 2022 stepped it by default (`optim="adamw_hf"`, transformers'
        own AdamW, since removed): parameter by parameter, in place but for the denominator's
        square root, one parameter's tensor at a time (torch's AdamW(foreach=False) holds two:
        its square root and the quotient by the bias correction)."""

        def __init__(self, params, lr=5e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
            super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                beta1, beta2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    state["step"] += 1
                    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                    exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    denom = exp_avg_sq.sqrt().add_(group["eps"])
                    step_size = group["lr"] * (1 - beta2 ** state["step"]) ** 0.5
                    p.addcdiv_(exp_avg, denom, value=-step_size / (1 - beta1 ** state["step"]))
                    if group["weight_decay"] > 0:
                        p.add_(p, alpha=-group["lr"] * group["weight_decay"])

    return LoopAdamW


def trace_bert(root, batch, optimizer="adamw"):
    """BertForSequenceClassification in float32 with eager attention (the example ran
    transformers of 2022, before SDPA), batch × 512 tokens; AdamW (the Trainer's default) or
    the Trainer's `optim="adafactor"`: transformers' Adafactor with `scale_parameter=False,
    relative_step=False`."""
    import torch
    import transformers
    from transformers.optimization import Adafactor

    import ferry

    config = transformers.BertConfig(**BERT_LARGE, attn_implementation="eager")
    with torch.device("meta"):
        model = transformers.BertForSequenceClassification(config)
    model.train()
    ids = torch.zeros((batch, 512), dtype=torch.long, device="meta")
    labels = torch.zeros((batch,), dtype=torch.long, device="meta")
    if optimizer == "adafactor":
        step = Adafactor(model.parameters(), lr=5e-5, scale_parameter=False, relative_step=False)
    else:
        step = _loop_adamw()(model.parameters())
    traced = ferry.trace(model, input_ids=ids, labels=labels, optimizer=step)
    path = root / f"bert-large-b{batch}-{optimizer}.json"
    traced.save(str(path))
    return path


def simulate(model, *options, policy="none"):
    """`ferry simulate --policy none --json` (or another policy; the hazard checker off: the rows
    measure time and memory); the result's figures."""
    args = [ferry_cli(), "simulate", "--model", str(model), "--policy", policy, *options]
    run = subprocess.run(
        [*args, "--json", "--no-checker"], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)["result"]
    assert result["fits"], result.get("failure")
    return result


def within(predicted, measured, tolerance):
    error = (predicted - measured) / measured
    assert abs(error) <= tolerance, (
        f"predicted {predicted:.4g}, measured {measured:.4g}: {error:+.1%}"
    )


def tokens_per_s(result, tokens):
    return tokens / (result["step_time_ns"] / 1e9)


# --- torchtitan PR #165: FSDP2 on 8 H100s, Llama 2 7B, batch 8, sequence 2048 ----------------
# "Used per-parameter FSDP" (pytorch/torchtitan#165, commit 83c879f, March 2024): eager, bf16
# mixed precision, fp32 reduce-scatter, the default allocator; peak active and reserved as
# percentages of 95.0396 GiB, WPS (tokens per second per GPU) as a range. Its train.py keeps
# `pred`, the model's float32 logits (the trace's `.float()` copy), through backward and the next
# forward: no `del pred` until torchtitan's e29b6b4 (June 2024), so the trace holds it.
PR165_GPU = 95.0396
PR165_FULL = {"active": 0.2392 * PR165_GPU, "reserved": 0.3264 * PR165_GPU, "wps": (6100, 6300)}
PR165_SAC = {"active": 0.5213 * PR165_GPU, "reserved": 0.6251 * PR165_GPU, "wps": (6600, 6800)}


@pytest.fixture(scope="module")
def pr165(root, devices):
    model = trace_config(root, "llama2-7b", LLAMA2_7B, 2048, 8, "--hold", "_to_copy.out")
    # The run's torch (a nightly of March 2024) copied gradients into the reduce-scatter input on
    # the reduce-scatter stream (docs/fsdp.md, FSDP2 of torch 2.4), and ran SDPA's flash kernel.
    common = ["--device", str(devices["h100-96gb-flash"]), "--fsdp", "8"]
    common += ["--fsdp-impl", "fsdp2-torch2.4", *TITAN_REDUCE]
    return {
        "full": simulate(model, *common, "--checkpoint", "every:1"),
        "sac": simulate(model, *common, "--checkpoint", "op-sac"),
    }


@pytest.mark.parametrize(
    "row, measured, allocated_tol, reserved_tol, time_tol",
    [("full", PR165_FULL, 0.01, 0.07, 0.15), ("sac", PR165_SAC, 0.01, 0.09, 0.15)],
)
def test_torchtitan_pr165_fsdp2_llama2_7b(
    pr165, row, measured, allocated_tol, reserved_tol, time_tol
):
    result = pr165[row]
    within(result["peak_allocated_bytes"] / GIB, measured["active"], allocated_tol)
    within(result["peak_reserved_bytes"] / GIB, measured["reserved"], reserved_tol)
    within(tokens_per_s(result, 8 * 2048), sum(measured["wps"]) / 2, time_tol)


def test_torchtitan_pr165_full_over_selective_step_time(pr165):
    predicted = pr165["full"]["step_time_ns"] / pr165["sac"]["step_time_ns"]
    measured = (sum(PR165_SAC["wps"]) / 2) / (sum(PR165_FULL["wps"]) / 2)
    within(predicted, measured, 0.02)


# --- torchtitan benchmarks, December 2024: Llama 3.1 8B, FSDP, batch 2, sequence 8192 --------
# benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3, row "FSDP" (eager): selective
# (op) activation checkpointing, expandable segments (run_llama_train.sh at 9dec370), memory
# is max reserved, TPS per GPU.
DEC2024 = {8: (82.4, 5762), 128: (67.0, 5605)}
# Table 1's "FSDP + torch.compile" (each block compiled): against the --compiled trace.
DEC2024_COMPILED = (77.0, 6667)


@pytest.fixture(scope="module")
def dec2024(root, devices):
    model = trace_config(root, "llama3-8b-b2", LLAMA3_8B, 8192, 2)
    compiled = trace_config(root, "llama3-8b-b2-compiled", LLAMA3_8B, 8192, 2, "--compiled")
    # A torch nightly of December 2024: SDPA's flash kernel.
    common = ["--device", str(devices["h100-96gb-flash"]), "--checkpoint", "op-sac"]
    common += ["--allocator", "expandable", *TITAN_REDUCE]
    return {
        8: simulate(model, *common, "--fsdp", "8"),
        128: simulate(model, *common, "--fsdp", "128", "--nodes", "16"),
        "compiled": simulate(compiled, *common, "--fsdp", "8"),
    }


@pytest.mark.parametrize("gpus, reserved_tol, time_tol", [(8, 0.08, 0.09), (128, 0.06, 0.13)])
def test_torchtitan_dec2024_fsdp_llama3_8b(dec2024, gpus, reserved_tol, time_tol):
    result = dec2024[gpus]
    memory, tps = DEC2024[gpus]
    within(result["peak_reserved_bytes"] / GIB, memory, reserved_tol)
    within(tokens_per_s(result, 2 * 8192), tps, time_tol)


def test_torchtitan_dec2024_fsdp_compiled_llama3_8b(dec2024):
    """Rows 13a-13c: the compiled run's reserved peak within 2 %; its time 12 % fast, as the
    eager row is 9 % fast on the same hosts; what compiling gains within 3 %."""
    compiled, eager = dec2024["compiled"], dec2024[8]
    memory, tps = DEC2024_COMPILED
    within(compiled["peak_reserved_bytes"] / GIB, memory, 0.02)
    within(tokens_per_s(compiled, 2 * 8192), tps, 0.13)
    within(eager["step_time_ns"] / compiled["step_time_ns"], tps / DEC2024[8][1], 0.03)


# --- torchtitan PR #3429: FSDP8 Llama 3 8B, batch 1, sequence 8192 (docs/fsdp.md) -------------
# The runs are the graph trainer's (SimpleFSDP), rows 22g-22k below; PR3429's keys are the
# checkpointing of torchtitan's own trainer (FSDP2), which the trace and the preset are first
# checked to model alike.
PR3429 = {"op-sac": (52.44, 7890), "every:1": (32.07, 7006)}


@pytest.fixture(scope="module")
def pr3429(devices):
    """PR #3429's model from the preset, run as FSDP2 on torchtitan's H100 96 GB."""
    return {
        checkpoint: simulate(
            "titan-llama3-8b-s8192",
            *("--device", str(devices["h100-96gb"]), "--fsdp", "8", *TITAN_REDUCE),
            *("--checkpoint", checkpoint, "--allocator", "expandable"),
        )
        for checkpoint in PR3429
    }


@pytest.fixture(scope="module")
def llama3_8b_compiled(root):
    """The compiled trace of the Hugging Face config, batch 1, sequence 8192 (`--compiled` keeps
    the eager trace's memory), stepped by fused AdamW: torchtitan's default since its PR #881
    (February 2025), before the runs of PR #3429 and torchao's README (rows 22g-22k, 39-42)."""
    return trace_config(
        root,
        "llama3-8b-b1-compiled",
        LLAMA3_8B,
        8192,
        1,
        "--compiled",
        "--optimizer",
        "adamw-fused",
    )


@pytest.fixture(scope="module")
def pr3429_traced(devices, pr3429, llama3_8b_compiled):
    """PR #3429's model from the compiled trace of the Hugging Face config beside the preset's,
    both run as FSDP2 on torchtitan's H100 96 GB with expandable segments."""
    traced = llama3_8b_compiled
    rows = {}
    for checkpoint in PR3429:
        rows[checkpoint, "trace"] = simulate(
            traced,
            *("--device", str(devices["h100-96gb"]), "--fsdp", "8", *TITAN_REDUCE),
            *("--checkpoint", checkpoint, "--allocator", "expandable"),
        )
        rows[checkpoint, "preset"] = pr3429[checkpoint]
    return rows


@pytest.mark.parametrize("checkpoint", list(PR3429))
def test_torchtitan_pr3429_memory_from_the_trace_is_the_presets(pr3429_traced, checkpoint):
    """The trace of the Hugging Face config and the preset of the same architecture decide
    alike (op-sac saves the same operators) and peak alike, within 2 %."""
    traced, preset = pr3429_traced[checkpoint, "trace"], pr3429_traced[checkpoint, "preset"]
    for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
        within(traced[key], preset[key], 0.02)


@pytest.mark.parametrize("checkpoint", list(PR3429))
def test_torchtitan_pr3429_compiled_trace_times_a_step_as_the_preset(pr3429_traced, checkpoint):
    """The compiled trace of the Hugging Face config and the preset of the same architecture
    predict the same step under op SAC and under full AC, within 2 %
    (docs/validation-sources.md, below the torchtune table)."""
    within(
        pr3429_traced[checkpoint, "trace"]["step_time_ns"],
        pr3429_traced[checkpoint, "preset"]["step_time_ns"],
        0.02,
    )


# PR #3429's runs are torchtitan's graph trainer: SimpleFSDP (`--fsdp-impl simple`), and in its
# "default" column the trainer's default memory policy, which saves every op on torchtitan's save
# list, every matmul included (`op-sac-all`); its "full" column saves the layers' outputs only
# (`every:1`). Expandable segments, as run (docs/validation.md, rows 22g-22k).
PR3429_GRAPH = {"op-sac-all": PR3429["op-sac"], "every:1": PR3429["every:1"]}


# PR #3429's FSDP4 + TP2 rows (8 x H100 96 GB, Llama 3 8B, sequence 8192, local batch 1 per
# data-parallel rank, the graph trainer): peak reserved (GiB) and tokens/s/GPU, which torchtitan
# divides by the tensor-parallel degree (each pair of GPUs trains one batch).
PR3429_TP2 = {"op-sac-all": (30.92, 6607), "every:1": (20.70, 5933)}


@pytest.fixture(scope="module")
def pr3429_tp2(devices):
    rows = {}
    for checkpoint in PR3429_TP2:
        rows[checkpoint] = simulate(
            "titan-llama3-8b-s8192",
            *("--device", str(devices["h100-96gb"]), "--fsdp", "4", "--tp", "2", *TITAN_REDUCE),
            *("--fsdp-impl", "simple", "--checkpoint", checkpoint, "--allocator", "expandable"),
        )
    return rows


def test_torchtitan_pr3429_fsdp4_tp2_full_policy(pr3429_tp2):
    """docs/parallelism.md: the full policy's row within the issue's tolerances (memory 5 %,
    time 8 %), and the default policy's memory too. The default policy's throughput misses
    (tokens/s +10.6 %): the doc says what the model lacks there, and this test holds the miss
    where it is, so that a change that widens it is seen."""
    memory, tps = PR3429_TP2["every:1"]
    result = pr3429_tp2["every:1"]
    within(result["peak_reserved_bytes"] / GIB, memory, 0.05)
    within(tokens_per_s(result, 8192) / 2, tps, 0.08)
    default = pr3429_tp2["op-sac-all"]
    memory, tps = PR3429_TP2["op-sac-all"]
    within(default["peak_reserved_bytes"] / GIB, memory, 0.05)
    within(tokens_per_s(default, 8192) / 2, tps, 0.11)


# --- torchtitan PR #2564: DeepSeek-V3 16B at FSDP4 x TP2 x EP2 on 8 H100 96 GB ----------------
# torchtitan's DeepSeek-V3 16B (27 layers, the first dense; 64 routed experts of 2048 -> 1408,
# top 6, 2 shared; latent attention, a 512-wide compressed KV; vocabulary 102,400) in its graph
# trainer, local batch 2, peak reserved (GiB) without and with its graph SAC. The PR does not
# give the sequence; torchtitan's DeepSeek-V3 16B configuration trains at 4096.
DSV3_16B = {
    "model_type": "deepseek_v3",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 102400,
    "n_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "rope_scaling": None,
}
PR2564 = {"none": 88.22, "op-sac-all": 52.03}


@pytest.fixture(scope="module")
def pr2564(root, devices):
    # torchtitan steps AdamW fused by default since its PR #881 (February 2025).
    traced = trace_config(root, "dsv3-16b-b2", DSV3_16B, 4096, 2, "--optimizer", "adamw-fused")
    mesh = ("--fsdp", "4", "--tp", "2", "--ep", "2", "--fsdp-impl", "simple", *TITAN_REDUCE)
    common = ("--device", str(devices["h100-96gb"]), *mesh, "--allocator", "expandable")
    return {
        "none": simulate(traced, *common),
        "op-sac-all": simulate(traced, *common, "--checkpoint", "op-sac-all"),
    }


def test_torchtitan_pr2564_deepseek_v3_16b_fsdp4_tp2_ep2(pr2564):
    """docs/parallelism.md: the graph SAC row within 10 % (the issue's tolerance for this row).
    The row without SAC misses (-33 %): the doc says what the model lacks there, and this test
    holds the miss where it is, so that a change that widens it is seen."""
    within(pr2564["op-sac-all"]["peak_reserved_bytes"] / GIB, PR2564["op-sac-all"], 0.10)
    within(pr2564["none"]["peak_reserved_bytes"] / GIB, PR2564["none"], 0.35)


@pytest.fixture(scope="module")
def pr3429_graph_trainer(devices, llama3_8b_compiled):
    rows = {}
    for checkpoint in PR3429_GRAPH:
        for model in ("trace", "preset"):
            rows[checkpoint, model] = simulate(
                llama3_8b_compiled if model == "trace" else "titan-llama3-8b-s8192",
                *("--device", str(devices["h100-96gb"]), "--fsdp", "8", "--fsdp-impl", "simple"),
                *TITAN_REDUCE,
                *("--checkpoint", checkpoint, "--allocator", "expandable"),
            )
    return rows


@pytest.mark.parametrize("model", ["trace", "preset"])
@pytest.mark.parametrize("checkpoint", list(PR3429_GRAPH))
def test_torchtitan_pr3429_graph_trainer_memory_and_throughput(
    pr3429_graph_trainer, checkpoint, model
):
    """Rows 22g-22j: peak reserved within 5 %, tokens per second within 8 %."""
    result = pr3429_graph_trainer[checkpoint, model]
    memory, tps = PR3429_GRAPH[checkpoint]
    within(result["peak_reserved_bytes"] / GIB, memory, 0.05)
    within(tokens_per_s(result, 8192), tps, 0.08)


@pytest.mark.parametrize("model", ["trace", "preset"])
def test_torchtitan_pr3429_graph_trainer_full_over_default(pr3429_graph_trainer, model):
    """Row 22k: full over default, predicted 3.7 % above the measured 1.126 (outside the 2 % the
    ratios are held to; docs/validation.md says what is known). Held within 4 %, so that the
    gap does not grow unseen."""
    predicted = (
        pr3429_graph_trainer["every:1", model]["step_time_ns"]
        / pr3429_graph_trainer["op-sac-all", model]["step_time_ns"]
    )
    within(predicted, PR3429_GRAPH["op-sac-all"][1] / PR3429_GRAPH["every:1"][1], 0.04)


def layers_recompute_flops(config, seq, batch):
    """The FLOPs the full policy recomputes in backward, which the default policy saves: every
    decoder layer's forward of a Llama-shaped config but its down projection, whose input is
    the last tensor the layer saves (the replay ends there: Note [A replay ends before the op
    it no longer needs]), six matmuls, and causal attention over s(s+1)/2 (query, key) pairs."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    kv = hidden * config["num_key_value_heads"] // config["num_attention_heads"]
    weights = 2 * hidden * hidden + 2 * hidden * kv + 2 * hidden * ffn
    tokens = seq * batch
    matmuls = 2 * weights * tokens
    attention = 4 * hidden * batch * seq * (seq + 1) // 2
    return config["num_hidden_layers"] * (matmuls + attention)


@pytest.mark.parametrize("model", ["trace", "preset"])
def test_torchtitan_pr3429_full_policy_costs_at_least_its_recompute_at_peak(
    pr3429_graph_trainer, devices, model
):
    """Row 22k's floor. Whatever the kernels reach, the full policy's step is longer than the
    default's by at least the FLOPs it recomputes at the device's peak (1.01e14 FLOP, 0.102 s at
    989 TFLOP/s); the published steps differ by 0.131 s (docs/fsdp.md, Validation against
    torchtitan)."""
    peak = json.loads(devices["h100-96gb"].read_text())["flops_per_s"]
    floor_ns = layers_recompute_flops(LLAMA3_8B, 8192, 1) / peak * 1e9
    assert (
        floor_ns < (8192 / PR3429_GRAPH["every:1"][1] - 8192 / PR3429_GRAPH["op-sac-all"][1]) * 1e9
    )
    extra_ns = (
        pr3429_graph_trainer["every:1", model]["step_time_ns"]
        - pr3429_graph_trainer["op-sac-all", model]["step_time_ns"]
    )
    assert extra_ns >= floor_ns, (extra_ns, floor_ns)


# --- torchtitan docs/performance.md, April 2024: FSDP2 on 64 A100s (8 nodes), time only ------
# Llama 3 8B, batch 1, sequence 8192, selective op: 2973 WPS; Llama 2 13B, batch 2, sequence
# 4096, selective op: 1904 WPS (commit 1ea476e; the default allocator).


@pytest.fixture(scope="module")
def a100(root):
    # Both configs set `norm_type = "fused_rmsnorm"`: traced with fused norms.
    common = ["--device", "a100-pcie4", "--fsdp", "64", "--nodes", "8", "--checkpoint", "op-sac"]
    common += TITAN_REDUCE
    llama3 = trace_config(root, "llama3-8b-b1", LLAMA3_8B, 8192, 1, "--fused-norms")
    llama2 = trace_config(root, "llama2-13b", LLAMA2_13B, 4096, 2, "--fused-norms")
    return {"llama3-8b": simulate(llama3, *common), "llama2-13b": simulate(llama2, *common)}


@pytest.mark.parametrize(
    "model, tokens, wps", [("llama3-8b", 8192, 2973), ("llama2-13b", 8192, 1904)]
)
def test_torchtitan_apr2024_64_a100_throughput(a100, model, tokens, wps):
    """Rows 23 and 24 within the time target (docs/validation-sources.md)."""
    within(tokens_per_s(a100[model], tokens), wps, 0.08)


# --- Hugging Face transformers docs: BERT-large on one V100 16 GB, float32 -------------------
# docs/source/en/model_memory_anatomy.md and perf_train_gpu_one (v4.27.2; the translation
# docs/source/ko/perf_train_gpu_one.md keeps the figures): Trainer, sequence 512, AdamW or
# Adafactor; "GPU memory occupied" is NVML's used memory (MiB), of which the CUDA context is
# 1343 MiB (measured there, before the model is loaded); samples per second over the run.
CONTEXT_MIB = 1343
BERT_B4 = (14949 - CONTEXT_MIB, 8.86)
BERT_B1 = (8681 - CONTEXT_MIB, 7.75)  # batch 1 × 4 accumulation steps
BERT_B1_CHECKPOINTED = (6775 - CONTEXT_MIB, 5.99)
BERT_B4_ADAFACTOR = (12295 - CONTEXT_MIB, 7.96)


def with_softmax_inputs_saved(path):
    """A copy of the trace at `path` in which each softmax also saves its input, as torch 1.10's
    derivative formula did (`_softmax_backward_data(grad, result, dim, self)`,
    pytorch/pytorch#64000; torch 1.11 keeps the input's dtype only, transformers PR #16043)."""
    model = json.loads(path.read_text())
    for op in model["ops"]:
        if op["kind"] == "aten._softmax.default":
            op["saved"] += [t for t in op["inputs"] if t not in op["saved"]]
    out = path.with_name(path.stem + "-torch110.json")
    out.write_text(json.dumps(model))
    return out


@pytest.fixture(scope="module")
def bert(root, devices):
    # The run's torch (1.10 or older) differs from the one traced in two ways the rows model: its
    # softmax saved its input, and the Trainer's model.zero_grad() kept the gradients
    # (set_to_none=False before torch 2.0).
    device = ["--device", str(devices["v100"]), "--keep-grads"]
    b1 = with_softmax_inputs_saved(trace_bert(root, 1))
    return {
        "b4": simulate(with_softmax_inputs_saved(trace_bert(root, 4)), *device),
        "b1": simulate(b1, *device),
        "b1 checkpointed": simulate(b1, *device, "--checkpoint", "every:1"),
        "b4 adafactor": simulate(
            with_softmax_inputs_saved(trace_bert(root, 4, "adafactor")), *device
        ),
    }


def test_torch_1_10_softmax_adds_its_input_to_each_layers_saved_tensors(root):
    """The rows' traces differ from torch 2.11's by each softmax's float32 input: 16 heads x
    512 x 512 a sequence, 16 MiB a layer at batch 1, 24 layers."""
    plain = json.loads(trace_bert(root, 1).read_text())
    old = json.loads(with_softmax_inputs_saved(root / "bert-large-b1-adamw.json").read_text())

    def saved(model):
        return sum(len(op["saved"]) for op in model["ops"])

    assert saved(old) - saved(plain) == 24


def test_hf_bert_large_v100_batch_4(bert):
    within(bert["b4"]["peak_reserved_bytes"] / MIB, BERT_B4[0], 0.02)
    within(4 / (bert["b4"]["step_time_ns"] / 1e9), BERT_B4[1], 0.11)


@pytest.mark.parametrize(
    "row, measured, tolerance",
    [("b1", BERT_B1, 0.01), ("b1 checkpointed", BERT_B1_CHECKPOINTED, 0.01)],
)
def test_hf_bert_large_v100_batch_1_memory(bert, row, measured, tolerance):
    within(bert[row]["peak_reserved_bytes"] / MIB, measured[0], tolerance)


def test_hf_bert_large_v100_gradient_checkpointing_step_time(bert):
    predicted = bert["b1 checkpointed"]["step_time_ns"] / bert["b1"]["step_time_ns"]
    within(predicted, BERT_B1[1] / BERT_B1_CHECKPOINTED[1], 0.05)


def test_hf_bert_large_v100_adafactor(bert):
    adafactor = bert["b4 adafactor"]
    within(adafactor["peak_reserved_bytes"] / MIB, BERT_B4_ADAFACTOR[0], 0.045)
    within(4 / (adafactor["step_time_ns"] / 1e9), BERT_B4_ADAFACTOR[1], 0.08)
    # What Adafactor saves over AdamW: the two moments of 335M float32 parameters, less its
    # factored state.
    saved = (bert["b4"]["peak_reserved_bytes"] - adafactor["peak_reserved_bytes"]) / MIB
    within(saved, BERT_B4[0] - BERT_B4_ADAFACTOR[0], 0.09)


# --- axolotl PR #3776: TRL's offloader against checkpointing, Qwen3-8B, one GPU, 8192 tokens --
# benchmarks/bench_checkpoint_activation_offload.py: bf16 weights, no optimizer, one sequence of
# 8192 tokens, `model(input_ids, logits_to_keep=1)` and `logits.float().mean()` as the loss,
# gradients set to None between steps; `gc` is transformers' non-reentrant checkpointing of each
# decoder layer, `trl_gc` that with TRL's `OffloadActivations(use_streams=True,
# min_offload_size=0)`, `trl_all` the offloader alone. Milliseconds a step (one warm-up step, the
# mean of two), and the peak allocated over the weights (the "CUDA peak delta", GB of 1e9 bytes).
# The PR names no GPU; the rows run on the bundled H100 SXM. Its table is dated 2 July 2026, when
# TRL's releases were 1.7.x, before TRL PR #6241 (1.8.0): policy trl-1.7.
AXOLOTL3776 = {"gc": (2677.7, 17.16), "trl_gc": (2758.3, 17.16), "trl_all": (4956.2, 32.50)}


def trace_axolotl_step(root):
    """Qwen3-8B's step as the benchmark runs it, traced from the config (SDPA's flash kernel
    saves what flash-attention 2 saves: queries, keys, values, output, log-sum-exp)."""
    import torch
    import transformers

    fields = {k: v for k, v in QWEN3_8B.items() if k != "model_type"}
    model = bf16_causal_lm(transformers.AutoConfig.for_model("qwen3", **fields))
    ids = torch.zeros((1, 8192), dtype=torch.long, device="meta")
    # The benchmark enters OffloadActivations itself: every saved tensor is offloadable.
    path = trace_for_offload_activations(model, ids, root / "qwen3-8b-axolotl.json")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return path, weights


@pytest.fixture(scope="module")
def axolotl3776(root, devices):
    traced, weights = trace_axolotl_step(root)
    # The benchmark's attention is flash-attention 2 (`attn_implementation="flash_attention_2"`).
    h100 = str(devices["h100-sxm-pcie5-flash"])
    gc = ("--device", h100, "--checkpoint", "every:1")
    trl = ("--device", h100, "--min-bytes", "0")
    runs = {
        "gc": simulate(traced, *gc),
        "trl_gc": simulate(traced, *gc, "--min-bytes", "0", policy="trl-1.7"),
        "trl_all": simulate(traced, *trl, policy="trl-1.7"),
    }
    return runs, weights


@pytest.mark.parametrize("mode, tolerance", [("trl_gc", 0.03), ("trl_all", 0.10)])
def test_axolotl3776_trl_offload_over_checkpointing_step_time(axolotl3776, mode, tolerance):
    """Rows 33 and 34: TRL's offloader with and without checkpointing, each over checkpointing
    alone. Offloading everything is predicted 9.3 % faster than measured (docs/validation.md
    says why); held within 10 %, so that the gap does not grow unseen."""
    runs, _ = axolotl3776
    predicted = runs[mode]["step_time_ns"] / runs["gc"]["step_time_ns"]
    within(predicted, AXOLOTL3776[mode][0] / AXOLOTL3776["gc"][0], tolerance)


@pytest.mark.parametrize("mode, tolerance", [("gc", 0.03), ("trl_gc", 0.03), ("trl_all", 0.09)])
def test_axolotl3776_peak_over_the_weights(axolotl3776, mode, tolerance):
    """Rows 35-37: the peak allocated over the weights, gradients included. Offloading everything
    keeps 2.7 GB more on the device than measured (docs/validation.md); held within 9 %."""
    runs, weights = axolotl3776
    within((runs[mode]["peak_allocated_bytes"] - weights) / 1e9, AXOLOTL3776[mode][1], tolerance)


def test_axolotl3776_checkpointed_step_is_faster_than_measured(axolotl3776):
    """Row 38, not kept within a tolerance: the H100 profile's checkpointed step is 50 % shorter
    than the measured one (6,131 against 3,059 tokens/s), the cause of row 34's error. Held above
    the measurement, so that a compute model that closes the gap is seen here."""
    runs, _ = axolotl3776
    assert tokens_per_s(runs["gc"], 8192) > 8192 / (AXOLOTL3776["gc"][0] / 1e3)


# --- torchao's float8 and MX READMEs: torchtitan's bfloat16 baseline, Llama 3 8B on 8 GPUs ---
# torchao/float8/README.md ("Training benchmarks", pytorch/ao 8c81863, March 2025: 8 x H100,
# torch 2.7.0a0, torchtitan 0.0.2) and torchao/prototype/mx_formats/README.md (d8bb51f, August
# 2025: 8 x B200 limited to 750 W, torch 2.9.0.dev, torchtitan 6fc499f): torchtitan's
# llama3_8b.toml (FSDP over 8, selective op AC, sequence 8192) with `--training.compile` and
# batch 1 through run_train.sh (expandable segments); peak memory is torchtitan's logged
# reserved GiB, the most over 100 steps; tokens/s the median. The H100's model is not named: the
# bundled H100 SXM; the B200 profile holds the 1000 W datasheet's peak.
TORCHAO = {"h100-sxm-pcie5": (47.65, 6150), "b200": (33.71, 8307.5)}


@pytest.fixture(scope="module")
def torchao_bf16(devices, llama3_8b_compiled):
    # The H100 run's torch 2.7 ran SDPA's flash kernel; the B200 run's 2.9, cuDNN's.
    common = ("--fsdp", "8", "--checkpoint", "op-sac", "--allocator", "expandable", *TITAN_REDUCE)
    paths = {"h100-sxm-pcie5": str(devices["h100-sxm-pcie5-flash"]), "b200": "b200"}
    return {
        device: simulate(llama3_8b_compiled, "--device", paths[device], *common)
        for device in TORCHAO
    }


def test_torchao_bf16_baseline_h100_reserved(torchao_bf16):
    """Row 39: the H100 run within the reserved target."""
    result = torchao_bf16["h100-sxm-pcie5"]
    within(result["peak_reserved_bytes"] / GIB, TORCHAO["h100-sxm-pcie5"][0], 0.05)


def test_torchao_bf16_baseline_b200_reserves_less_than_predicted(torchao_bf16):
    """Row 41, not kept within a tolerance: the B200 run of the same trainer config reserved 29 %
    less, under a later torchtitan that compiles the loss too, which the compiled trace does not
    model (it keeps the eager memory; docs/validation-sources.md). Held above the measurement,
    so that a model of the compiled loss that crosses it is seen here."""
    assert torchao_bf16["b200"]["peak_reserved_bytes"] / GIB > TORCHAO["b200"][0]


def test_torchao_bf16_baseline_h100_throughput(torchao_bf16):
    """Row 40: predicted 23 % faster than measured on the unnamed H100 (the flat 60 % roofline
    for matmuls; docs/validation.md); held within 23 %."""
    within(tokens_per_s(torchao_bf16["h100-sxm-pcie5"], 8192), TORCHAO["h100-sxm-pcie5"][1], 0.23)


def test_torchao_bf16_baseline_b200_is_faster_than_measured(torchao_bf16):
    """Row 42, not kept within a tolerance: the B200 profile's datasheet peak is for 1000 W, the
    run was limited to 750 W. Held above the measurement, so that a change that crosses it is
    seen."""
    assert tokens_per_s(torchao_bf16["b200"], 8192) > TORCHAO["b200"][1]


# --- IBM and Meta's FSDP training of Llama 2: 128 A100s and 96 H100s, time only ---------------
# PyTorch blog "Maximizing training throughput using PyTorch FSDP" (March 2024) and its code's
# README (foundation-model-stack/fms-fsdp at 4ffb9bd, "Training throughput benchmarks"): eager
# FSDP with bf16 mixed precision, the gradients reduced in bf16 (its `bfSixteen` policy: the
# simulator's default), AdamW, batch 2 of 4096 tokens (train_config's seq_length);
# tokens/s per GPU on 128 A100 80 GB (16 nodes) and 96 H100 80 GB (12 nodes). 7B: HSDP (sharded
# within each 8-GPU node, replicated across), no activation checkpointing; 34B and 70B: sharded
# over every GPU, every block checkpointed (selective_checkpointing=1). fms's 7B and 70B are
# Llama 2's shapes, its 34B Code Llama 34B's; its tokenizer has 32,000 tokens.
CODELLAMA_34B = LLAMA2_7B | {
    "hidden_size": 8192,
    "intermediate_size": 22016,
    "num_hidden_layers": 48,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
}
LLAMA2_70B = CODELLAMA_34B | {"intermediate_size": 28672, "num_hidden_layers": 80}
FMS_NODES = {"a100-pcie4": 16, "h100-sxm-pcie5": 12}
# The blog's networks: "400Gbps inter-node interconnect" (A100s), "800Gbps" (H100s), a node's
# whole link; a ring across nodes moves about 92 % of it (46 GB/s on a 400 Gb/s NIC, NCCL's
# expectation in NVIDIA/nccl-tests issue #290).
FMS_NETWORK = {"a100-pcie4": 46_000_000_000, "h100-sxm-pcie5": 92_000_000_000}
FMS = {
    "7b": {"a100-pcie4": 3700, "h100-sxm-pcie5": 7500},
    "34b": {"a100-pcie4": 700, "h100-sxm-pcie5": 1550},
    "70b": {"a100-pcie4": 370, "h100-sxm-pcie5": 800},
}


def fms_device(root, device):
    """The bundled profile with the blog's network between nodes, SDPA as the runs' torch (of
    early 2024) ran it."""
    profile = on_flash(bundled(device))
    profile["collectives"]["inter_node"]["bytes_per_s"] = FMS_NETWORK[device]
    path = root / f"{device}-fms.json"
    path.write_text(json.dumps(profile))
    return path


@pytest.fixture(scope="module")
def fms(root):
    configs = {"7b": LLAMA2_7B, "34b": CODELLAMA_34B, "70b": LLAMA2_70B}
    rows = {}
    for size, config in configs.items():
        model = trace_config(root, f"fms-{size}", config, 4096, 2)
        for device, nodes in FMS_NODES.items():
            mesh = ["--fsdp", str(8 * nodes), "--nodes", str(nodes)]
            if size == "7b":
                mesh += ["--hsdp", str(nodes)]
            else:
                mesh += ["--checkpoint", "every:1"]
            rows[size, device] = simulate(model, "--device", str(fms_device(root, device)), *mesh)
    return rows


@pytest.mark.parametrize(
    "size, device, tolerance",
    [
        ("7b", "a100-pcie4", 0.06),
        ("7b", "h100-sxm-pcie5", 0.11),
        ("34b", "a100-pcie4", 0.10),
        ("34b", "h100-sxm-pcie5", 0.02),
        ("70b", "a100-pcie4", 0.15),
        ("70b", "h100-sxm-pcie5", 0.01),
    ],
)
def test_fms_fsdp_llama2_throughput(fms, size, device, tolerance):
    """Rows 43-45, A100 and H100 each: the 7B 5 % slow on the A100s and 10 % fast on the H100s,
    where its replica groups' bf16 all-reduces share each node's network at the blog's nominal
    rate; the checkpointed 34B and 70B 10 and 14 % slow on the A100s, whose runs reach more of the
    peak than the flat roofline allows, 2 % fast and 0.1 % slow on the H100s
    (docs/validation-sources.md); each held within its error rounded up."""
    within(tokens_per_s(fms[size, device], 2 * 4096), FMS[size][device], tolerance)


# --- The plan's margin and band follow the reserved rows --------------------------------------
def reserved_rows(pr165, dec2024, pr3429_graph_trainer, bert, torchao_bf16):
    """Every row of docs/validation.md's table that holds a peak reserved (NVML's used memory
    less the context, for the BERT rows) against a measured one and is kept within a tolerance:
    {row: (predicted, measured)}, in bytes. Row 41 is not kept: its run compiles the loss, which
    the model does not express."""
    rows = {
        "6": (pr165["full"], PR165_FULL["reserved"] * GIB),
        "9": (pr165["sac"], PR165_SAC["reserved"] * GIB),
        "12": (dec2024[8], DEC2024[8][0] * GIB),
        "13a": (dec2024["compiled"], DEC2024_COMPILED[0] * GIB),
        "14": (dec2024[128], DEC2024[128][0] * GIB),
        "22g": (pr3429_graph_trainer["op-sac-all", "trace"], PR3429_GRAPH["op-sac-all"][0] * GIB),
        "22h": (pr3429_graph_trainer["every:1", "trace"], PR3429_GRAPH["every:1"][0] * GIB),
        "25": (bert["b4"], BERT_B4[0] * MIB),
        "27": (bert["b1"], BERT_B1[0] * MIB),
        "28": (bert["b1 checkpointed"], BERT_B1_CHECKPOINTED[0] * MIB),
        "30": (bert["b4 adafactor"], BERT_B4_ADAFACTOR[0] * MIB),
        "39": (torchao_bf16["h100-sxm-pcie5"], TORCHAO["h100-sxm-pcie5"][0] * GIB),
    }
    return {
        row: (result["peak_reserved_bytes"], measured) for row, (result, measured) in rows.items()
    }


def plan_band():
    """The default margin and the band `ferry plan` prints for a GPU's peak, as fractions: the
    largest underestimate and overestimate of a peak reserved it allows for."""
    args = [ferry_cli(), "plan", "--model", "tiny-gpt", "--budget", "1GiB", "--json"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    predicted, band = plan["peak_reserved_bytes"], plan["expected_peak_reserved_bytes"]
    return plan["margin_permille"] / 1000, 1 - predicted / band["high"], predicted / band["low"] - 1


def test_the_plan_margin_and_band_follow_the_reserved_rows(
    pr165, dec2024, pr3429_graph_trainer, bert, torchao_bf16
):
    """docs/plan.md, What "fits" promises: the band `ferry plan` prints spans every reserved row's
    error, no wider than the largest of them (to 0.1 %), and the default margin is the largest
    underestimate rounded up to a whole percent: a model change that moves a row moves them."""
    rows = reserved_rows(pr165, dec2024, pr3429_graph_trainer, bert, torchao_bf16)
    errors = {row: predicted / measured - 1 for row, (predicted, measured) in rows.items()}
    under = max(-min(errors.values()), 0.0)
    over = max(max(errors.values()), 0.0)
    margin, band_under, band_over = plan_band()
    table = ", ".join(f"{row} {error:+.2%}" for row, error in errors.items())
    # The band's ends are whole permille: each within 0.1 % above the table's extreme.
    assert under <= band_under < under + 0.001, (table, band_under)
    assert over <= band_over < over + 0.001, (table, band_over)
    assert margin == pytest.approx(math.ceil(under * 100) / 100), (table, margin)
