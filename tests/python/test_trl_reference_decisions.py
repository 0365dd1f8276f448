"""Policy `trl` against TRL's own offloader: TRL's OffloadActivations (trl 1.16.0) runs a tiny
Qwen3 step on the CPU, its device module replaced by streams that do nothing (its decisions do
not depend on them), and what it does with each saved tensor (copied out, kept by dedup, kept by
rule) is counted; `ferry simulate --policy trl` of the same model's trace must decide the same.
The packed tensors are held until the step ends, so that no address is reused: TRL keys dedup by
address, which the CPU's allocator would reuse differently from CUDA's."""

import contextlib
import json
import subprocess

import pytest
import torch
import transformers

from ferry_cli import cli as ferry_cli
from models import bf16_causal_lm, trace_for_offload_activations

trl_offload = pytest.importorskip("trl.models.activation_offloading")

CONFIG = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1000,
    tie_word_embeddings=False,
)
SEQ = 64


class _Event:
    def synchronize(self):
        pass


class _Stream:
    def record_event(self):
        return _Event()

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


class _Streams:
    """A device module whose streams order nothing: the CPU runs everything in order."""

    Stream = _Stream
    current = _Stream()

    @staticmethod
    def current_stream():
        return _Streams.current

    @staticmethod
    @contextlib.contextmanager
    def stream(stream):
        yield

    @staticmethod
    def empty_cache():
        pass


def _model(device):
    config = transformers.AutoConfig.for_model("qwen3", **CONFIG)
    return bf16_causal_lm(config, device, seed=0)


def _trl_counts(monkeypatch):
    """TRL's decisions in the second of two steps under one context, as axolotl's benchmark
    runs it (update_model_params, min_offload_size=0, streams)."""
    get_module = torch.get_device_module
    with monkeypatch.context() as m:
        m.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
        m.setattr(
            torch,
            "get_device_module",
            lambda d=None: _Streams if str(d) == "cpu" else get_module(d),
        )
        ctx = trl_offload.OffloadActivations(
            use_pin_memory=False, use_streams=True, min_offload_size=0
        )
    model = _model("cpu")
    ctx.update_model_params(model)
    pack = ctx.pack_hook
    counts = {}
    held = []

    def counting_pack(tensor):
        held.append(tensor)
        deduplicated = trl_offload._get_unique_tensor_key(tensor) in ctx.storage_to_tensor_id
        tensor_id = pack(tensor)
        copied = ctx.tracker[tensor_id][1]
        name = "deduplicated" if deduplicated else ("offloaded" if copied else "kept")
        counts[name] = counts.get(name, 0) + 1
        return tensor_id

    ctx.pack_hook = counting_pack
    ids = torch.randint(3, CONFIG["vocab_size"] - 1, (1, SEQ))
    with ctx:
        for _ in range(2):
            counts.clear()
            held.clear()
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, logits_to_keep=1).logits.float().mean().backward()
    return counts


def test_policy_trl_decides_each_saved_tensor_as_trl_does(monkeypatch, tmp_path):
    trl = _trl_counts(monkeypatch)
    model = _model("meta")
    ids = torch.zeros((1, SEQ), dtype=torch.long, device="meta")
    # OffloadActivations alone, as here, offloads the output head's saved tensors too.
    path = trace_for_offload_activations(model, ids, tmp_path / "qwen3-tiny.json")
    args = [ferry_cli(), "simulate", "--model", str(path), "--policy", "trl", "--min-bytes", "0"]
    run = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    telemetry = json.loads(run.stdout)["result"]["telemetry"]
    assert telemetry["packed"] == sum(trl.values())
    assert telemetry["offloaded"] == trl["offloaded"]
    assert telemetry["deduplicated"] == trl["deduplicated"]
    assert telemetry["kept"] == trl["kept"] + trl["deduplicated"]
