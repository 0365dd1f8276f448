"""python -m ferry trace: a Hugging Face config.json becomes a ferry scenario (docs/trace.md)."""

import json
import subprocess
import sys

import pytest
import torch

from ferry_cli import cli
from test_trace import accepted_by_cli, real_packs

transformers = pytest.importorskip("transformers")

from ferry._cli.trace import bundled_configs, main  # noqa: E402
from ferry._trace import TracedModel, trace  # noqa: E402

TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def run(tmp_path, *argv):
    out = tmp_path / "scenario.json"
    assert main([*argv, "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    return out, TracedModel(document)


def test_writes_a_scenario_the_simulator_accepts(config, tmp_path):
    out, traced = run(tmp_path, config, "--seq", "64", "--batch", "2")
    doc = traced.document
    assert doc["name"] == "config-s64-b2"
    names = {t["name"]: t for t in doc["tensors"]}
    assert names["model.layers.1.mlp.down_proj.weight"]["dtype"] == "bf16"
    assert names["input.0"]["bytes"] == 2 * 64 * 8  # the token ids, i64
    assert traced.layers() == [0, 1]
    assert "model.layers.1.mlp.down_proj/mm" in {op["name"] for op in doc["ops"]}
    accepted_by_cli(traced_from(out), tmp_path)


#: google-t5/t5-small's config.json, cut to two encoder and two decoder blocks and a smaller
#: vocabulary.
TINY_T5 = {
    "model_type": "t5",
    "d_model": 64,
    "d_kv": 16,
    "d_ff": 128,
    "num_heads": 4,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "vocab_size": 512,
    "feed_forward_proj": "relu",
    "relative_attention_num_buckets": 32,
    "decoder_start_token_id": 0,
    "pad_token_id": 0,
    "eos_token_id": 1,
}


def test_an_encoder_decoder_config_traces_its_seq2seq_lm_one_layer_a_block(tmp_path):
    """A T5 config builds T5ForConditionalGeneration, whose decoder reads --seq tokens too; the
    encoder's blocks are layers 0 and 1, the decoder's 2 and 3 (Note [Layers of several stacks]),
    and the planner checkpoints or offloads each block on its own."""
    path = tmp_path / "t5.json"
    path.write_text(json.dumps(TINY_T5))
    out, traced = run(tmp_path, str(path), "--seq", "256", "--batch", "8", "--optimizer", "adamw")
    assert traced.layers() == [0, 1, 2, 3]
    layers = {}
    for op in traced.document["ops"]:
        if "layer" in op:
            layers.setdefault(op["name"].split(".layer.")[0], set()).add(op["layer"])
    assert layers["encoder.block.0"] == {0} and layers["encoder.block.1"] == {1}
    assert layers["decoder.block.0"] == {2} and layers["decoder.block.1"] == {3}
    names = {t["name"] for t in traced.document["tensors"]}
    assert "input.0" in names and any(n.startswith("decoder.block.1.") for n in names)
    accepted_by_cli(traced_from(out), tmp_path)
    # Each block is a layer of the plan: halfway between the peaks of keeping everything and of
    # checkpointing every layer, the plan keeps some blocks and recomputes others.
    peaks = [
        json.loads(simulate(out, "--policy", "none", *extra, "--json").stdout)["result"]
        for extra in ([], ["--checkpoint", "every:1"])
    ]
    budget = sum(p["peak_reserved_bytes"] for p in peaks) // 2
    plan = subprocess.run(
        [cli(), "plan", "--model", str(out), "--device", "h100-sxm-pcie5", "--json"]
        + ["--budget", str(budget), "--margin", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert plan.returncode == 0, plan.stderr
    report = json.loads(plan.stdout)
    assert report["hazards"] == 0
    layers = {row["layer"]: row for row in report["layers"] if row["layer"] >= 0}
    assert sorted(layers) == [0, 1, 2, 3]
    recomputed = {layer for layer, row in layers.items() if row["recomputed_bytes"] > 0}
    assert recomputed and recomputed != set(layers)


def traced_from(path):
    return TracedModel(json.loads(path.read_text()))


def simulate(path, *argv):
    """`ferry simulate` of the scenario at `path` on an H100, with `argv`."""
    return subprocess.run(
        [cli(), "simulate", "--model", str(path), "--device", "h100-sxm-pcie5", *argv],
        capture_output=True,
        text=True,
        check=False,
    )


def test_same_arguments_give_the_same_bytes(config, tmp_path):
    first, _ = run(tmp_path, config, "--seq", "32")
    text = first.read_text()
    again, _ = run(tmp_path, config, "--seq", "32")
    assert again.read_text() == text


def test_out_dash_writes_to_stdout(config, capsys):
    assert main([config, "--seq", "16", "--name", "tiny", "--out", "-"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert (doc["format"], doc["name"]) == ("ferry.model/1", "tiny")
    assert "tiny: " in captured.err  # the summary goes to stderr


def test_dtype_sets_what_runs(config, tmp_path):
    _, traced = run(tmp_path, config, "--seq", "32", "--dtype", "f32")
    dtypes = {t["dtype"] for t in traced.document["tensors"] if t["role"] == "param"}
    assert dtypes == {"f32"}


def test_gradient_checkpointing_keeps_the_layer_inputs_and_recomputes(config, tmp_path):
    _, plain = run(tmp_path, config, "--seq", "64")
    out, checkpointed = run(tmp_path, config, "--seq", "64", "--gradient-checkpointing")
    assert checkpointed.saved_bytes() < plain.saved_bytes() / 2
    forward, backward = plain.flops()
    # Without the cache (which checkpointing turns off) transformers looks for packed sequences
    # in the positions; the model's own are one sequence a row, so attention stays causal
    # (Note [Packed sequences as the device reads them]) and the forward counts the same.
    assert checkpointed.flops()[0] == forward
    # Backward runs each layer's forward again, up to the last tensor it needs: all but the
    # down projection, whose output nothing in the layer's backward reads (torch's early stop).
    recomputed = sum(checkpointed.flops(layer)[0] for layer in checkpointed.layers())
    last = sum(op["flops"] for op in plain.document["ops"] if op["name"].endswith("down_proj/mm"))
    assert checkpointed.flops()[1] == backward + recomputed - last
    accepted_by_cli(traced_from(out), tmp_path)


def test_gradient_checkpointing_saves_what_a_real_run_saves():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    ).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 512, (2, 64))
    traced = trace(model, ids, labels=ids)
    count, nbytes = real_packs(lambda: model(ids, labels=ids).loss)
    assert (traced.packed_count, traced.packed_bytes) == (count, nbytes)
    tensors = {t["name"]: t for t in traced.document["tensors"]}
    names = [n for op in traced.document["ops"] for n in op["saved"]]
    held = real_packs(lambda: model(ids, labels=ids).loss, held=True)
    assert (len(names), sum(tensors[n]["bytes"] for n in names)) == held


def test_repeated_kv_heads_save_their_copies(config, tmp_path):
    """`--attention sdpa-repeat-kv` copies the 2 key and value heads to all 4 query heads before
    the kernel, which saves the copies: per layer, K and V each save 4 heads where SDPA with
    grouped heads saves 2. The FLOPs are the same (attention counts the query's heads)."""
    _, grouped = run(tmp_path, config, "--seq", "64", "--batch", "2")
    out, repeated = run(
        tmp_path, config, "--seq", "64", "--batch", "2", "--attention", "sdpa-repeat-kv"
    )
    b, s, a, kv, d, layers = 2, 64, 4, 2, 16, 2
    copies = layers * 2 * b * (a - kv) * s * d * 2  # bf16
    assert repeated.saved_bytes() == grouped.saved_bytes() + copies
    assert repeated.flops() == grouped.flops()
    accepted_by_cli(traced_from(out), tmp_path)


def test_repeated_kv_heads_save_what_a_real_run_saves():
    from ferry._cli.trace import _attention_implementation

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM._from_config(
        config, attn_implementation=_attention_implementation("sdpa-repeat-kv")
    ).train()
    ids = torch.randint(0, 512, (2, 64))
    traced = trace(model, ids, labels=ids)
    assert (traced.packed_count, traced.packed_bytes) == real_packs(
        lambda: model(ids, labels=ids).loss
    )


def test_lora_trains_the_adapters_only(config, tmp_path):
    pytest.importorskip("peft")
    out, traced = run(tmp_path, config, "--seq", "32", "--lora-rank", "4", "--optimizer", "adamw")
    tensors = traced.document["tensors"]
    trained = {t["name"] for t in tensors if t["role"] == "param"}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    frozen = {t["name"]: t["role"] for t in tensors}
    assert frozen["base_model.model.model.layers.0.mlp.down_proj.weight"] == "buffer"
    state = sum(t["bytes"] for t in tensors if t["role"] == "optimizer_state")
    assert state == 2 * sum(
        t["bytes"] for t in tensors if t["role"] == "param" and "view_of" not in t
    )
    accepted_by_cli(traced_from(out), tmp_path)


def test_bundled_configs_are_selectable_by_name(tmp_path):
    assert bundled_configs() == [
        "deepseek-v3",
        "gpt2",
        "llama3-70b",
        "llama3-8b",
        "mistral-7b",
        "mixtral-8x7b",
        "qwen2.5-7b",
        "qwen3-30b-a3b",
    ]
    out, traced = run(tmp_path, "gpt2", "--seq", "16")
    params = sum(
        t["bytes"]
        for t in traced.document["tensors"]
        if t["role"] == "param" and "view_of" not in t
    )
    assert params == 124_439_808 * 2  # GPT-2 small, bf16, head tied to the token embedding
    assert any(op.get("draws_rng") for op in traced.document["ops"])  # its dropout
    accepted_by_cli(traced_from(out), tmp_path)


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "qwen2.5-7b", "mistral-7b"])
def test_bundled_configs_have_the_published_parameter_counts(name):
    from ferry._cli.trace import CONFIG_DIR

    with open(f"{CONFIG_DIR}/{name}.json") as f:
        data = json.load(f)
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    published = {
        "llama3-8b": 8_030_261_248,
        "llama3-70b": 70_553_706_496,
        "qwen2.5-7b": 7_615_616_512,
        "mistral-7b": 7_248_023_552,
    }
    assert count == published[name]


@pytest.mark.parametrize(
    "name, billions",
    # As published, rounded: Mixtral 46.7B (Mistral AI, "Mixtral of experts", 2023), Qwen3
    # 30.5B (Qwen3 Technical Report, arXiv:2505.09388), DeepSeek-V3 671B without its
    # multi-token prediction module (DeepSeek-V3 Technical Report, arXiv:2412.19437).
    [("mixtral-8x7b", 46.7), ("qwen3-30b-a3b", 30.5), ("deepseek-v3", 671)],
)
def test_bundled_moe_configs_have_the_published_parameter_counts(name, billions):
    from ferry._cli.trace import CONFIG_DIR

    with open(f"{CONFIG_DIR}/{name}.json") as f:
        data = json.load(f)
    config = transformers.AutoConfig.for_model(**data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    digits = 0 if isinstance(billions, int) else 1
    assert round(count / 1e9, digits) == billions


def test_without_transformers_the_command_says_what_to_install(
    config, tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    assert main([config, "--seq", "8", "--out", str(tmp_path / "x.json")]) == 2
    assert "needs the transformers package" in capsys.readouterr().err


def test_bad_arguments_are_named(config, tmp_path, capsys):
    assert main(["no-such-model", "--seq", "8", "--out", str(tmp_path / "x.json")]) == 2
    assert "'no-such-model' is neither a file nor a bundled config" in capsys.readouterr().err
    assert main([config, "--seq", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert "--seq: expected an integer >= 1, got 0" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 8}')
    assert main([str(bad), "--seq", "8", "--out", str(tmp_path / "x.json")]) == 2
    assert "model_type: expected a string" in capsys.readouterr().err
    bad.write_text('{"model_type": "no-such-architecture"}')
    assert main([str(bad), "--seq", "8", "--out", str(tmp_path / "x.json")]) == 2
    assert "model_type: 'no-such-architecture' is not an architecture" in capsys.readouterr().err
    # An architecture with neither a causal nor a sequence-to-sequence language-model class.
    bad.write_text(json.dumps({"model_type": "vit", "hidden_size": 16, "num_hidden_layers": 1}))
    assert main([str(bad), "--seq", "8", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "model_type: 'vit' has no causal language-model class" in err and "ferry.trace" in err
    assert len(err.splitlines()) == 1
    bad.write_text(json.dumps({**TINY_LLAMA, "hidden_size": 66}))  # not a multiple of 4 heads
    assert main([str(bad), "--seq", "8", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m ferry trace: {bad}: ") and "hidden size (66)" in err
    assert len(err.splitlines()) == 1
    with pytest.raises(SystemExit):
        main([config, "--out", str(tmp_path / "x.json")])  # --seq is required


def test_hold_marks_what_the_loop_keeps_and_the_simulator_keeps_it(config, tmp_path, capsys):
    # The float32 copy of the logits the loss reads, kept as `pred = model(x)` keeps it.
    out, held = run(tmp_path, config, "--seq", "64", "--hold", "_to_copy.out")
    assert [t["name"] for t in held.document["tensors"] if t.get("held")] == ["_to_copy.out"]
    (tmp_path / "plain").mkdir()
    plain_out, plain = run(tmp_path / "plain", config, "--seq", "64")
    assert not any("held" in t for t in plain.document["tensors"])
    peaks = []
    for path in (plain_out, out):
        done = simulate(path, "--policy", "none", "--json")
        assert done.returncode == 0, done.stderr
        peaks.append(json.loads(done.stdout)["result"]["peak_allocated_bytes"])
    assert peaks[1] > peaks[0]
    capsys.readouterr()
    for name, why in (
        ("no-such-tensor", "the trace has no tensor of that name"),
        ("model.embed_tokens.weight", "it is a param"),
        (held.document["loss"], "it is the loss"),
    ):
        assert main([config, "--seq", "8", "--hold", name, "--out", str(tmp_path / "x.json")]) == 2
        assert f"--hold {name}: {why}" in capsys.readouterr().err


def test_fsdp_is_recorded_and_the_commands_run_it(config, tmp_path, capsys):
    out, traced = run(
        tmp_path, config, "--seq", "64", "--fsdp", "8", "--reshard-after-forward", "false"
    )
    assert traced.document["parallelism"] == {"fsdp": 8, "reshard_after_forward": False}
    assert list(traced.document)[-1] == "parallelism"
    assert "FSDP2 over 8 ranks in 3 units (2 layers and the root)" in capsys.readouterr().err
    done = simulate(out, "--json")
    assert done.returncode == 0, done.stderr
    fsdp = json.loads(done.stdout)["fsdp"]
    assert fsdp == {
        "ranks": 8,
        "nodes": 1,
        "hsdp": 1,
        "reshard_after_forward": False,
        "per_rank": True,
    }
    # Without --fsdp nothing is recorded, and the scenario runs on one GPU.
    _, plain = run(tmp_path, config, "--seq", "64")
    assert "parallelism" not in plain.document
    # SimpleFSDP is recorded, and the commands run it.
    out, simple = run(tmp_path, config, "--seq", "64", "--fsdp", "8", "--fsdp-impl", "simple")
    assert simple.document["parallelism"] == {"fsdp": 8, "fsdp_impl": "simple"}
    done = simulate(out)
    assert done.returncode == 0, done.stderr
    assert "SimpleFSDP over 8 ranks on 1 node" in done.stdout
    assert "hazards: 0" in done.stdout
    # So is a float32 reduce (torchtitan's), which the commands report and run: the same shards,
    # twice the reduce-scatter's bytes.
    out32, float32 = run(
        tmp_path, config, "--seq", "64", "--fsdp", "8", "--reduce-dtype", "float32"
    )
    assert float32.document["parallelism"] == {"fsdp": 8, "reduce_dtype": "float32"}
    done = simulate(out32)
    assert done.returncode == 0, done.stderr
    assert "gradients reduced in float32" in done.stdout
    assert "hazards: 0" in done.stdout


def test_tensor_and_context_parallelism_are_recorded_and_the_commands_cut_for_them(
    config, tmp_path, capsys
):
    out, traced = run(tmp_path, config, "--seq", "64", "--fsdp", "2", "--tp", "2", "--cp", "2")
    assert traced.document["parallelism"] == {"fsdp": 2, "tp": 2, "cp": 2}
    err = capsys.readouterr().err
    assert "tensor parallelism over 2 GPUs a rank, context parallelism over 2 GPUs a rank" in err
    done = simulate(out, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["tp"]["ranks"] == 2 and report["cp"]["ranks"] == 2
    assert report["fsdp"]["ranks"] == 2
    # Tensor parallelism alone needs no --fsdp; the command's own --tp overrides the file's.
    out, alone = run(tmp_path, config, "--seq", "64", "--tp", "2")
    assert alone.document["parallelism"] == {"tp": 2}
    done = simulate(out, "--tp", "4")
    # The tiny model's 2 key/value heads do not split among 4 ranks: the file's 2 was overridden.
    assert done.returncode == 2
    assert "--tp 4: 2 key/value heads" in done.stderr
    assert "; --tp 2 cuts this model" in done.stderr


def test_a_pipeline_is_recorded_and_the_commands_run_it(config, tmp_path, capsys):
    # --pp is the mesh table's row: recorded alone, run by the commands as their own --pp, and
    # bounded as they bound it.
    out, traced = run(tmp_path, config, "--seq", "64", "--pp", "2")
    assert traced.document["parallelism"] == {"pp": 2}
    done = simulate(out)
    assert done.returncode == 0, done.stderr
    assert "\n1f1b 2x4 never ferry " in done.stdout
    assert main([config, "--seq", "8", "--pp", "65", "--out", str(tmp_path / "x.json")]) == 2
    assert "--pp: 65 is not in 1..64" in capsys.readouterr().err


def test_tensor_and_context_arguments_are_checked(config, tmp_path, capsys):
    x = str(tmp_path / "x.json")
    assert main([config, "--seq", "8", "--cp", "2", "--out", x]) == 2
    assert "--cp 2 needs --fsdp N" in capsys.readouterr().err
    assert main([config, "--seq", "8", "--tp", "0", "--out", x]) == 2
    assert "--tp: 0 is not in 1..1024" in capsys.readouterr().err
    assert main([config, "--seq", "8", "--fsdp", "2", "--cp", "2000", "--out", x]) == 2
    assert "--cp: 2000 is not in 1..1024" in capsys.readouterr().err
    assert main([config, "--seq", "8", "--ep", "2", "--out", x]) == 2
    assert "--ep 2 needs --fsdp N" in capsys.readouterr().err


def test_fsdp_arguments_are_checked(config, tmp_path, capsys):
    x = str(tmp_path / "x.json")
    assert main([config, "--seq", "8", "--nodes", "2", "--out", x]) == 2
    need = "--nodes, --hsdp, --reshard-after-forward, --fsdp-impl and --reduce-dtype need --fsdp N"
    assert need in capsys.readouterr().err
    assert main([config, "--seq", "8", "--fsdp-impl", "simple", "--out", x]) == 2
    assert need in capsys.readouterr().err
    assert main([config, "--seq", "8", "--reduce-dtype", "float32", "--out", x]) == 2
    assert need in capsys.readouterr().err
    assert main([config, "--seq", "8", "--fsdp", "8", "--hsdp", "3", "--out", x]) == 2
    assert "--hsdp: 3 replica groups do not divide 8 ranks" in capsys.readouterr().err
    assert (
        main([config, "--seq", "8", "--fsdp", "8", "--reshard-after-forward", "1", "--out", x]) == 2
    )
    assert '--reshard-after-forward: "1" is not true, false' in capsys.readouterr().err
    assert main([config, "--seq", "8", "--fsdp", "-1", "--out", x]) == 2
    assert "--fsdp: -1 is not in 1..1000000" in capsys.readouterr().err


TINY_MIXTRAL = {
    **TINY_LLAMA,
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def test_expert_parallelism_is_recorded_and_the_commands_split_the_experts(tmp_path, capsys):
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(TINY_MIXTRAL))
    out, traced = run(tmp_path, str(path), "--seq", "16", "--fsdp", "4", "--ep", "2")
    assert traced.document["parallelism"] == {"fsdp": 4, "ep": 2}
    assert "expert parallelism over 2 GPUs" in capsys.readouterr().err
    done = simulate(out, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ep"]["ranks"] == 2
    # The eager loop over the experts has no grouped matmul to split: refused, named.
    out, _ = run(
        tmp_path, str(path), "--seq", "16", "--experts", "eager", "--fsdp", "4", "--ep", "2"
    )
    done = simulate(out)
    assert done.returncode == 2
    assert "has no grouped expert matmul" in done.stderr


def test_a_mixture_of_experts_traces_under_the_routing_it_is_given(tmp_path, capsys):
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(TINY_MIXTRAL))
    # The grouped matmul experts (the default) compute every routed row, split among the
    # experts as the routing (balanced, the default) gives them.
    out, traced = run(tmp_path, str(path), "--seq", "16", "--dtype", "f32")
    assert traced.document["routing"] == {"assumption": "balanced"}
    assert "assumed balanced" in capsys.readouterr().err
    accepted_by_cli(traced_from(out), tmp_path)
    # The eager loop's shapes follow the routing: the one given, recorded and said.
    argv = ["--seq", "16", "--experts", "eager", "--routing", "loads=3,1,0,0"]
    out, traced = run(tmp_path, str(path), *argv)
    assert traced.document["routing"] == {"assumption": "loads", "loads": [3, 1, 0, 0]}
    assert "the experts' rows follow the routing, assumed loads=3,1,0,0" in capsys.readouterr().err
    rows = [
        op["gemm"]["m"]
        for op in traced.document["ops"]
        if op["name"].startswith("model.layers.0.mlp.experts/mm")
    ]
    assert rows == [16, 16, 16, 16]  # two experts, each every token: gate-and-up, down
    accepted_by_cli(traced_from(out), tmp_path)
    argv = ["--seq", "8", "--experts", "eager", "--routing", "loads=1,2", "--out", "-"]
    assert main([str(path), *argv]) == 2
    assert capsys.readouterr().err == (
        "python -m ferry trace: --routing: routing 'loads=1,2': 2 loads, but the router at "
        "model.layers.0.mlp.gate chooses among 4 experts\n"
    )
    assert main([str(path), "--seq", "8", "--routing", "random,seed=x", "--out", "-"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "python -m ferry trace: --routing: routing 'random,seed=x': seed must be an integer "
        "from 0 to 2^63 - 1, got 'x'\n"
    )
