"""ferry.trace: a model's training step as a ferry.model/1 document (docs/trace.md).

What the trace records is checked against a real CPU run of the same model: the tensors
autograd saves, as a saved_tensors_hooks pack hook sees them, count and bytes, exactly.
"""

import json
import subprocess

import pytest
import torch
from torch import nn

from ferry._trace import layer_of, trace
from ferry_cli import cli
from models import TinyLM, loss_of, tiny_bert


def real_packs(run, held=False):
    """Count and bytes of the tensors autograd saves while ``run()`` computes a loss, then runs
    backward: logical bytes, or with ``held`` the bytes of storage each covers (less for an
    expanded view, whose elements share storage), empty tensors left out."""
    packs = []

    def pack(t):
        nbytes = t.numel() * t.element_size()
        if held:
            offset = t.storage_offset() * t.element_size()
            nbytes = min(nbytes, t.untyped_storage().nbytes() - offset)
        if nbytes or not held:
            packs.append(nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return len(packs), sum(packs)


def document_saves(traced):
    tensors = {t["name"]: t for t in traced.document["tensors"]}
    names = [name for op in traced.document["ops"] for name in op["saved"]]
    return len(names), sum(tensors[n]["bytes"] for n in names)


def accepted_by_cli(traced, tmp_path):
    path = tmp_path / "model.json"
    traced.save(path)
    for command in (["simulate", "--policy", "ferry"], ["compare"]):
        run = subprocess.run(
            [cli(), *command, "--model", str(path)], capture_output=True, text=True
        )
        assert run.returncode == 0, (command, run.stderr)


def tiny_lm():
    torch.manual_seed(0)
    return TinyLM(), torch.randn(2, 16, 32)


def test_saved_tensors_match_a_real_run_exactly():
    model, x = tiny_lm()
    traced = trace(model, x, loss_fn=loss_of)
    count, nbytes = real_packs(lambda: loss_of(model(x)))
    assert (traced.packed_count, traced.packed_bytes) == (count, nbytes)
    assert document_saves(traced) == (count, nbytes)


def test_the_model_is_left_untouched():
    model, x = tiny_lm()
    before = {n: p.clone() for n, p in model.named_parameters()}
    trace(model, x, loss_fn=loss_of, optimizer=torch.optim.AdamW(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_the_document_is_accepted_by_simulate_and_compare(tmp_path):
    model, x = tiny_lm()
    accepted_by_cli(trace(model, x, loss_fn=loss_of), tmp_path)


def test_same_model_gives_the_same_bytes():
    model, x = tiny_lm()
    first = trace(model, x, loss_fn=loss_of).to_json()
    assert trace(model, x, loss_fn=loss_of).to_json() == first
    torch.manual_seed(1)
    again, y = TinyLM(), torch.randn(2, 16, 32)  # other values, same shapes
    assert trace(again, y, loss_fn=loss_of).to_json() == first


def test_a_meta_model_traces_as_the_real_one():
    model, x = tiny_lm()
    with torch.device("meta"):
        meta = TinyLM()
    real = trace(model, x, loss_fn=loss_of).to_json()
    assert trace(meta, x.to("meta"), loss_fn=loss_of).to_json() == real


def test_ops_are_named_by_module_path_and_aten_op_with_layers():
    model, x = tiny_lm()
    ops = {op["name"]: op for op in trace(model, x, loss_fn=loss_of).document["ops"]}
    assert ops["blocks.1.qkv/addmm"]["layer"] == 1
    assert ops["blocks.0.ln1/native_layer_norm"]["layer"] == 0
    assert "layer" not in ops["lm_head/addmm"]
    assert ops["lm_head/addmm"]["no_offload"] is True  # the output head, as offload_model does
    assert "blocks.0/bmm#1" in ops  # the second bmm of the module
    qkv = ops["blocks.0.qkv/addmm"]
    assert qkv["flops"] == 2 * 32 * 32 * 96  # 2Tkn, from PyTorch's FLOP counter
    assert qkv["backward_flops"] == 2 * qkv["flops"]
    assert qkv["bytes"] > 0


@pytest.mark.parametrize(
    "path, layer",
    [
        ("model.layers.3.mlp.down_proj", 3),
        ("transformer.h.11.attn", 11),
        ("lm_head", -1),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default", 0),
        ("", -1),
    ],
)
def test_layer_index_comes_from_the_module_path(path, layer):
    assert layer_of(path) == layer


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return 2 * x * w * grad, (x * x * grad).sum(0)


class _InPlace(nn.Module):
    """In-place ops, a custom Function and an op that saves one tensor twice."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        h = torch.relu_(self.fc(x))
        h = h * 2
        h.add_(1.0)
        h = _Cube.apply(h, self.w).tanh()
        return (h * h).sum()


def test_each_saved_tensor_belongs_to_the_op_whose_node_holds_it():
    model, x = _InPlace(), torch.randn(4, 8)
    traced = trace(model, x)
    ops = {op["name"]: op for op in traced.document["ops"]}
    assert ops["fc/addmm"]["saved"] == ["input.0"]  # for the weight's gradient
    assert ops["relu_"]["saved"] == ["fc/addmm.out"]  # its result, rewritten in place
    assert ops["relu_"]["outputs"] == []  # in place: nothing new is produced
    # The Function's node sits on the output of its last op, which now reads what it saved.
    assert ops["mul#2"]["saved"] == ["mul.out", "w"]
    assert ops["mul#3"]["saved"] == ["tanh.out"]  # h * h saves h twice; the format once
    count, nbytes = real_packs(lambda: model(x))
    assert (traced.packed_count, traced.packed_bytes) == (count, nbytes)
    tanh = next(t for t in traced.document["tensors"] if t["name"] == "tanh.out")
    assert document_saves(traced) == (count - 1, nbytes - tanh["bytes"])


def test_views_and_shared_storages_are_kept():
    model, x = tiny_lm()
    doc = trace(model, x, loss_fn=loss_of).document
    tensors = {t["name"]: t for t in doc["tensors"]}
    views = [t for t in tensors.values() if "view_of" in t]
    assert views
    for view in views:
        base = tensors[view["view_of"]]
        assert "view_of" not in base  # views of the root storage only
        assert view["role"] == base["role"]
        assert view["view_offset"] + view["bytes"] <= base["bytes"]
    # q, k and v split out of the fused projection lie in its first, second and last third.
    q, k, v = (tensors[f"blocks.0/split.out{i}"] for i in range(3))
    assert {q["view_of"], k["view_of"], v["view_of"]} == {"blocks.0.qkv/addmm.out"}
    third = tensors["blocks.0.qkv/addmm.out"]["bytes"] // 3
    assert [q["view_offset"], k["view_offset"], v["view_offset"]] == [0, third, 2 * third]
    # Views are produced by the op that wrote their storage, not by the view op.
    ops = {op["name"]: op for op in doc["ops"]}
    assert q["name"] in ops["blocks.0.qkv/addmm"]["outputs"]
    assert ops["blocks.0/split"]["outputs"] == []


def test_optimizer_state_is_static_memory():
    model, x = tiny_lm()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    traced = trace(model, x, loss_fn=loss_of, optimizer=torch.optim.AdamW(model.parameters()))
    state = [t for t in traced.document["tensors"] if t["role"] == "optimizer_state"]
    # Adam's two moments per parameter; the scalar step counts live on the host.
    assert traced.optimizer_state_bytes == sum(t["bytes"] for t in state) == 2 * param_bytes
    assert any(t["name"] == "optimizer.blocks.0.qkv.weight.exp_avg" for t in state)


def test_a_model_with_hundreds_of_parameters_simulates(tmp_path):
    # More parameters than one simulated kernel may write (255): a Llama of 32 layers has 291.
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(150)))
    traced = trace(model, torch.randn(2, 4), loss_fn=lambda out: out.sum())
    tensors = traced.document["tensors"]
    assert sum(t["role"] == "param" and "view_of" not in t for t in tensors) == 300
    accepted_by_cli(traced, tmp_path)


def test_buffers_nothing_reads_are_still_memory():
    model, x = tiny_lm()
    model.register_buffer("unused", torch.zeros(5))
    tensors = {t["name"]: t for t in trace(model, x, loss_fn=loss_of).document["tensors"]}
    assert tensors["unused"] == {"name": "unused", "bytes": 20, "dtype": "f32", "role": "buffer"}


def test_frozen_parameters_are_resident_without_gradient():
    model, x = tiny_lm()
    model.blocks[0].requires_grad_(False)
    roles = {t["name"]: t["role"] for t in trace(model, x, loss_fn=loss_of).document["tensors"]}
    assert roles["blocks.0.qkv.weight"] == "buffer"
    assert roles["blocks.1.qkv.weight"] == "param"


def test_autocast_traces_the_dtypes_that_run():
    model, x = tiny_lm()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        traced = trace(model, x, loss_fn=loss_of)
    tensors = {t["name"]: t for t in traced.document["tensors"]}
    ops = {op["name"]: op for op in traced.document["ops"]}
    assert {tensors[n]["dtype"] for n in ops["blocks.0.qkv/addmm"]["saved"]} == {"bf16"}
    assert tensors["blocks.0.qkv.weight"]["dtype"] == "f32"  # the cast is an op of its own
    count, nbytes = real_packs(lambda: _autocast_loss(model, x))
    assert (traced.packed_count, traced.packed_bytes) == (count, nbytes)


def _autocast_loss(model, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return loss_of(model(x))


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return nn.functional.dropout(self.fc(x), 0.5).sum()


def test_random_ops_are_flagged():
    model, x = _Noisy().train(), torch.randn(4, 8)
    ops = trace(model, x).document["ops"]
    assert [op["name"] for op in ops if op.get("draws_rng")] == ["native_dropout"]
    ops = trace(model, x, target="host").document["ops"]
    assert [op["name"] for op in ops if op.get("draws_cpu_rng")] == ["bernoulli_"]


def test_dropout_saves_the_mask_the_target_keeps():
    model, x = _Noisy().train(), torch.randn(4, 8)
    before = nn.functional.dropout

    def saved_activations(traced):
        tensors = {t["name"]: t for t in traced.document["tensors"]}
        return [
            (tensors[n]["dtype"], tensors[n]["bytes"])
            for op in traced.document["ops"]
            for n in op["saved"]
            if tensors[n]["role"] == "activation"
        ]

    assert saved_activations(trace(model, x)) == [("u8", 32)]  # native_dropout: a byte each
    host = trace(model, x, target="host")
    assert saved_activations(host) == [("f32", 128)]  # the host's noise tensor
    assert nn.functional.dropout is before  # the device's dropout was for the trace only
    count, nbytes = real_packs(lambda: model(x))
    assert (host.packed_count, host.packed_bytes) == (count, nbytes)


class _Latent(nn.Module):
    """Attention whose values are narrower than its queries and keys, as DeepSeek-V3's latent
    attention (192 against 128 a head there; 24 against 16 here)."""

    def __init__(self, heads=2, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.q = nn.Linear(16, heads * 24)
        self.k = nn.Linear(16, kv_heads * 24)
        self.v = nn.Linear(16, kv_heads * 16)

    def forward(self, x):
        b, s, _ = x.shape

        def split(t, heads):
            return t.view(b, s, heads, -1).transpose(1, 2)

        q = split(self.q(x), self.heads)
        k, v = split(self.k(x), self.kv_heads), split(self.v(x), self.kv_heads)
        gqa = self.kv_heads != self.heads
        return nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=gqa
        ).sum()


def test_attention_with_narrower_values_runs_the_kernel_the_target_runs():
    """Note [Attention as the device runs it]: for a device, the memory-efficient kernel
    (saving its output and log-sum-exp, no attention matrix); for the host, the math path the
    CPU runs, which saves the softmax of every (query, key) pair."""
    x = torch.randn(2, 32, 16)
    before = nn.functional.scaled_dot_product_attention

    def kinds(traced):
        return [op["kind"] for op in traced.document["ops"]]

    device = trace(_Latent(), x)
    assert "aten._scaled_dot_product_efficient_attention.default" in kinds(device)
    assert not any("softmax" in kind or kind == "aten.bmm.default" for kind in kinds(device))
    host = trace(_Latent(), x, target="host")
    assert "aten._safe_softmax.default" in kinds(host)
    assert "aten._scaled_dot_product_efficient_attention.default" not in kinds(host)
    # The softmax of 2 x 2 heads x 32 x 32 pairs in float32, which the device does not keep.
    matrix = 2 * 2 * 32 * 32 * 4

    def saved_sizes(traced):
        tensors = {t["name"]: t for t in traced.document["tensors"]}
        return {tensors[n]["bytes"] for op in traced.document["ops"] for n in op["saved"]}

    assert matrix in saved_sizes(host)
    assert matrix not in saved_sizes(device)
    assert device.saved_bytes() < host.saved_bytes()
    assert nn.functional.scaled_dot_product_attention is before  # for the trace only
    # Grouped queries take the usual path: the efficient kernel does not run them.
    grouped = trace(_Latent(heads=4, kv_heads=2), x)
    assert "aten._scaled_dot_product_efficient_attention.default" not in kinds(grouped)


class _Biased(nn.Module):
    """Attention with dropout (``dropout``), over a learned bias a head (``bias``), as T5's."""

    def __init__(self, dropout, bias):
        super().__init__()
        self.dropout = dropout
        self.qkv = nn.Linear(16, 3 * 16)
        self.bias = nn.Parameter(torch.zeros(1, 2, 32, 32)) if bias else None

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=self.bias, dropout_p=self.dropout
        ).sum()


@pytest.mark.parametrize(
    ("dropout", "bias", "kernel"),
    [
        (0.1, False, "aten._scaled_dot_product_flash_attention.default"),
        (0.0, True, "aten._scaled_dot_product_efficient_attention.default"),
        (0.1, True, "aten._scaled_dot_product_efficient_attention.default"),
    ],
)
def test_attention_the_cpu_runs_on_its_math_path_runs_cudas_kernel(dropout, bias, kernel):
    """Note [Attention as the device runs it]: under dropout, or over a bias that needs a
    gradient, the CPU takes the math path (saving the softmax of every pair); a device trace
    runs the kernel CUDA picks, flash without a mask, the memory-efficient kernel with one."""
    x = torch.randn(2, 32, 16)

    def kinds(traced):
        return {op["kind"] for op in traced.document["ops"]}

    device = trace(_Biased(dropout, bias), x)
    assert kernel in kinds(device)
    assert not any("softmax" in kind or kind == "aten.bmm.default" for kind in kinds(device))
    host = trace(_Biased(dropout, bias), x, target="host")
    assert "aten._safe_softmax.default" in kinds(host)
    assert device.saved_bytes() < host.saved_bytes()
    attention = [op for op in device.document["ops"] if op["kind"] == kernel]
    assert [("bias" in op["inputs"]) for op in attention] == [bias]


def test_ops_after_the_loss_get_a_last_op_that_hands_it_on(tmp_path):
    model, x = tiny_lm()

    def loss_then_more(out):
        loss = out.square().mean()
        out.abs().max()  # logging, after the loss
        return loss

    traced = trace(model, x, loss_fn=loss_then_more)
    last = traced.document["ops"][-1]
    assert (last["name"], last["inputs"], last["flops"]) == ("loss", ["mean.out"], 0)
    assert [traced.document["loss"]] == last["outputs"] == ["loss"]
    accepted_by_cli(traced, tmp_path)


def test_bad_use_is_named():
    model, x = tiny_lm()
    with pytest.raises(ValueError, match="not a scalar tensor .* pass loss_fn"):
        trace(model, x)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        trace(lambda x: x, x)
    with pytest.raises(ValueError, match="target must be"):
        trace(model, x, loss_fn=loss_of, target="gpu")


def test_ferry_exports_trace():
    import ferry

    model, x = tiny_lm()
    assert (
        ferry.trace(model, x, loss_fn=loss_of).to_json()
        == trace(model, x, loss_fn=loss_of).to_json()
    )


def test_save_writes_to_json(tmp_path):
    model, x = tiny_lm()
    traced = trace(model, x, loss_fn=loss_of, name="tiny")
    traced.save(tmp_path / "m.json")
    text = (tmp_path / "m.json").read_text()
    assert text == traced.to_json()
    doc = json.loads(text)
    assert (doc["format"], doc["name"], list(doc)) == (
        "ferry.model/1",
        "tiny",
        ["format", "name", "tensors", "ops", "loss"],
    )
    assert doc["loss"] in doc["ops"][-1]["outputs"]


# Hugging Face models built from small configs (no download).

transformers = pytest.importorskip("transformers")


def _hf_llama():
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(config)


def _hf_gpt2():
    config = transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=512,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("make", [_hf_llama, _hf_gpt2, tiny_bert], ids=["llama", "gpt2", "bert"])
def test_hugging_face_models_match_a_real_run(make, tmp_path):
    torch.manual_seed(0)
    model = make().train()
    ids = torch.randint(0, 512, (2, 64))
    traced = trace(model, ids, labels=ids, target="host")  # the host's dropout, as run here
    count, nbytes = real_packs(lambda: model(ids, labels=ids).loss)
    assert (traced.packed_count, traced.packed_bytes) == (count, nbytes)
    assert document_saves(traced) == real_packs(lambda: model(ids, labels=ids).loss, held=True)
    assert traced.layers() == [0, 1]
    accepted_by_cli(traced, tmp_path)


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "packed"])
def test_training_without_a_cache_builds_the_mask_the_positions_ask_for(packed):
    """Note [Packed sequences as the device reads them]: without a cache transformers reads the
    positions for packed sequences. Positions the model makes (one sequence a row) build no mask,
    as in a real run; a caller's positions that restart (two sequences a row) build one there,
    and the trace, which does not know a caller's values, keeps it. Without the Note's check the
    first trace saves a sequence-squared mask in each layer that the real run does not."""
    torch.manual_seed(0)
    model = _hf_llama().train()
    model.config.use_cache = False
    ids = torch.randint(0, 512, (2, 64))
    extra = {}
    if packed:
        extra["position_ids"] = torch.arange(32).repeat(2).expand(2, -1)
    traced = trace(model, ids, labels=ids, target="host", **extra)
    count, nbytes = real_packs(lambda: model(ids, labels=ids, **extra).loss)
    assert (traced.packed_count, traced.packed_bytes) == (count, nbytes)
    masks = [t for t in traced.document["tensors"] if "where" in t["name"]]
    assert bool(masks) == packed
