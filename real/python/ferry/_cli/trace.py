"""``python -m ferry trace``: a Hugging Face config becomes a ferry scenario (docs/trace.md).

The model is built from a local ``config.json`` (or a bundled one, by name) on the meta device,
so no weight is downloaded, initialized or allocated, and traced with ``ferry.trace``.
``transformers`` (and ``peft`` for ``--lora-rank``) are needed by this command only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

# The package's configs/ (package data).
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

_DTYPES = ("bf16", "f16", "f32")


def bundled_configs() -> list[str]:
    """Names of the bundled configs (``configs/<name>.json``), sorted; none where the package
    was installed without its data."""
    if not os.path.isdir(CONFIG_DIR):
        return []
    return sorted(f[: -len(".json")] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def _parser() -> argparse.ArgumentParser:
    from .. import _simulator

    parser = argparse.ArgumentParser(
        prog="python -m ferry trace",
        description="Trace a Hugging Face language model, built from its config.json without "
        "weights, into a ferry.model/1 scenario for `ferry simulate` / `ferry compare --model`.",
    )
    parser.add_argument(
        "config",
        help="a config.json path, or a bundled config: " + ", ".join(bundled_configs()),
    )
    parser.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size (default 1)")
    parser.add_argument("--dtype", choices=_DTYPES, default="bf16", help="parameter dtype")
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train LoRA adapters of this rank (needs peft); 0: full training",
    )
    parser.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj",
        help="comma-separated module names LoRA adapts",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="checkpoint every decoder layer (the model's own, non-reentrant)",
    )
    parser.add_argument(
        "--attention",
        default="sdpa",
        choices=("sdpa", "sdpa-repeat-kv", "eager"),
        help="the model's attention implementation: sdpa (the default), sdpa-repeat-kv (SDPA "
        "after copying the key and value heads to every query head, as torchtune's attention "
        "does) or eager",
    )
    parser.add_argument(
        "--experts",
        choices=("grouped_mm", "eager"),
        help="a mixture-of-experts model's experts implementation: grouped_mm (one grouped "
        "matmul over every routed token, transformers' default) or eager (a loop over the "
        "experts hit, whose shapes follow the routing)",
    )
    parser.add_argument(
        "--routing",
        default="balanced",
        help="where shapes follow a router's choice, the routing the trace assumes: balanced "
        "(the default), loads=W0,W1,... (relative per-expert loads) or "
        "random[,seed=S][,capacity=C] (docs/trace.md, Routing)",
    )
    parser.add_argument(
        "--optimizer",
        default="none",
        choices=("none", "adamw", "adamw-for-loop", "adamw-fused", "sgd"),
        help="the optimizer the loop steps: its state is static memory, its step's cost and "
        "temporaries are the step's (adamw and sgd as torch defaults them: foreach on a "
        "device; adamw-for-loop: AdamW(foreach=False); adamw-fused: AdamW(fused=True)); "
        "default none",
    )
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="the loop lets float32 matmuls (every one under --dtype f32) use TF32, as "
        "Trainer's --tf32 and torch.set_float32_matmul_precision('high') do; default: torch's "
        "full float32",
    )
    parser.add_argument(
        "--target",
        default="device",
        choices=("device", "host"),
        help="where the scenario runs: an accelerator (default) or the CPU",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="time each chain of ops torch.compile fuses between two library kernels as one "
        "fused kernel; memory stays the eager trace's (docs/trace.md, Compiled steps)",
    )
    parser.add_argument(
        "--fused-norms",
        action="store_true",
        help="time each call of a normalization module as one fused kernel, as a trainer with "
        "fused norms runs it (torchtitan's fused_rmsnorm, Liger Kernel); memory stays the eager "
        "trace's (docs/trace.md, Fused norms)",
    )
    parser.add_argument(
        "--fsdp",
        type=int,
        default=0,
        metavar="N",
        help="record FSDP2 over N ranks in the scenario: `ferry simulate / compare / plan` then "
        "shard each decoder layer, and the root, over N ranks unless their own --fsdp says "
        "otherwise (docs/fsdp.md)",
    )
    parser.add_argument("--nodes", type=int, default=0, help="with --fsdp: nodes the ranks span")
    parser.add_argument("--hsdp", type=int, default=1, help="with --fsdp: HSDP replica groups")
    parser.add_argument(
        "--reshard-after-forward",
        default="true",
        help="with --fsdp: true, false, or K (keep a 1/K shard after forward)",
    )
    parser.add_argument(
        "--fsdp-impl",
        default="fsdp2",
        choices=_simulator.fsdp_impls,
        help="with --fsdp: fsdp2 (torch's fully_shard, the default), simple (torchtitan's "
        "SimpleFSDP: the collectives' buffers from the compute stream's pool) or "
        "fsdp2-torch2.4 (fully_shard of torch 2.4 and before; docs/fsdp.md)",
    )
    parser.add_argument(
        "--reduce-dtype",
        default="param",
        choices=_simulator.reduce_dtypes,
        help="with --fsdp: the gradients' reduce dtype, param (torch's default) or float32 "
        "(torchtitan's)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="record tensor parallelism over N GPUs a rank: the commands then run each GPU's cut "
        "of the model unless their own --tp says otherwise (docs/parallelism.md)",
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        metavar="N",
        help="with --fsdp: record context parallelism over N GPUs a rank, each holding 1/N of "
        "the sequence (docs/parallelism.md, Context parallelism)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        metavar="N",
        help="with --fsdp: record expert parallelism over N GPUs of the shard group and their "
        "tensor-parallel ones (a multiple of --tp), each holding 1/N of the experts "
        "(docs/parallelism.md, Expert parallelism)",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="N",
        help="record a pipeline of N stages (docs/pipeline.md)",
    )
    parser.add_argument(
        "--hold",
        action="append",
        default=[],
        metavar="TENSOR",
        help="mark an activation of the trace, by its name, as held by the training loop past "
        "backward until the next step's forward produces it again, as `pred = model(x)` "
        "without `del pred` holds the output (repeatable; docs/model-format.md, Tensors)",
    )
    parser.add_argument("--name", help="the scenario's name (default: config, seq and batch)")
    parser.add_argument("--out", required=True, help="where to write the scenario ('-': stdout)")
    return parser


class UsageError(Exception):
    """A bad argument or config: reported as one line, exit status 2."""


def _load_config(spec: str) -> tuple[str, dict[str, Any]]:
    path = spec
    if not os.path.exists(path):
        bundled = os.path.join(CONFIG_DIR, spec + ".json")
        if not os.path.exists(bundled):
            raise UsageError(
                f"config: {spec!r} is neither a file nor a bundled config "
                f"(bundled: {', '.join(bundled_configs())})"
            )
        path = bundled
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UsageError(f"{path}: model_type: expected a string naming the architecture")
    return path, data


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a config it rejects (its own checks and the hub's)."""
    errors = (ValueError, TypeError, KeyError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return errors
    return errors + (StrictDataclassError,)


# `--attention sdpa-repeat-kv`: SDPA over key and value heads copied to every query head before
# the kernel, as torchtune's MultiHeadAttention does (`expand` then `flatten`, a copy) and as
# transformers itself does when it passes SDPA a mask tensor. The kernel then saves the copies
# for backward instead of the grouped heads (docs/trace.md, Attention).
_REPEAT_KV = "ferry_sdpa_repeat_kv"


def _sdpa_repeat_kv(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs):
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    return sdpa_attention_forward(
        module, query, repeat_kv(key, groups), repeat_kv(value, groups), attention_mask, **kwargs
    )


def _attention_implementation(choice: str) -> str:
    """The ``attn_implementation`` transformers is given for ``--attention choice``."""
    if choice != "sdpa-repeat-kv":
        return choice
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(_REPEAT_KV, _sdpa_repeat_kv)
    AttentionMaskInterface.register(_REPEAT_KV, sdpa_mask)
    return _REPEAT_KV


def build_model(data: dict[str, Any], args: argparse.Namespace, source: str = "config") -> Any:
    """The language model of config ``data`` (read from ``source``) on the meta device, in
    training mode, as ``args`` ask: its sequence-to-sequence LM where the config is an
    encoder-decoder's (``is_encoder_decoder``), else its causal LM."""
    import torch

    try:
        from transformers import (
            CONFIG_MAPPING,
            MODEL_FOR_CAUSAL_LM_MAPPING,
            MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForSeq2SeqLM,
        )
        from transformers import __version__ as transformers_version
    except ImportError:
        raise UsageError(
            "python -m ferry trace needs the transformers package: pip install transformers"
        ) from None
    if data["model_type"] not in CONFIG_MAPPING:
        raise UsageError(
            f"{source}: model_type: {data['model_type']!r} is not an architecture "
            f"transformers {transformers_version} knows"
        )
    # `use_cache` stays the config's: transformers takes another attention-mask path without
    # the cache (Note [Packed sequences as the device reads them] in _trace), and the trace
    # shows the one the config asks for.
    fields = {k: v for k, v in data.items() if k != "model_type"}
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[args.dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        config = AutoConfig.for_model(data["model_type"], **fields)
        implementations = {"attn_implementation": _attention_implementation(args.attention)}
        if getattr(args, "experts", None) is not None:
            implementations["experts_implementation"] = args.experts
        if config.is_encoder_decoder:
            auto, mapping = AutoModelForSeq2SeqLM, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING
            head = "sequence-to-sequence"
        else:
            auto, mapping = AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING
            head = "causal"
        if type(config) not in mapping:
            raise UsageError(
                f"{source}: model_type: {data['model_type']!r} has no {head} language-model "
                f"class in transformers {transformers_version}; trace another head from "
                "Python with ferry.trace (docs/trace.md)"
            )
        with torch.device("meta"):
            model = auto.from_config(config, **implementations)
    except _config_errors() as error:
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise UsageError(f"{source}: {message}") from None
    finally:
        torch.set_default_dtype(previous)
    model.to(dtype)
    model.train()
    if args.gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # older transformers
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    if args.lora_rank:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UsageError("--lora-rank needs the peft package: pip install peft") from None
        targets = [t for t in args.lora_targets.split(",") if t]
        lora = LoraConfig(
            r=args.lora_rank,
            lora_alpha=2 * args.lora_rank,
            lora_dropout=0.0,
            target_modules=targets,
            task_type="SEQ_2_SEQ_LM" if model.config.is_encoder_decoder else "CAUSAL_LM",
        )
        with torch.device("meta"):
            model = get_peft_model(model, lora)
    return model


def _check(args: argparse.Namespace) -> dict[str, Any] | None:
    """Checks the arguments before anything is built; returns the scenario's "parallelism"
    section they record (``mesh_section``)."""
    for flag, value, low in (
        ("--seq", args.seq, 1),
        ("--batch", args.batch, 1),
        ("--lora-rank", args.lora_rank, 0),
    ):
        if value < low:
            raise UsageError(f"{flag}: expected an integer >= {low}, got {value}")
    if args.tf32 and args.target == "host":
        raise UsageError("--tf32: TF32 is cuBLAS's; a --target host scenario runs on the CPU")
    section = mesh_section(args)
    from .._trace import Routing

    try:
        Routing(args.routing)
    except ValueError as error:
        raise UsageError(f"--routing: {str(error).removeprefix('ferry.trace: ')}") from None
    return section


def hold(document: dict[str, Any], names: Sequence[str]) -> None:
    """Marks each named tensor of the traced ``document`` "held" (docs/model-format.md,
    Tensors); raises UsageError naming --hold unless it names a base activation of the trace."""
    tensors = {tensor["name"]: tensor for tensor in document["tensors"]}
    for name in names:
        tensor = tensors.get(name)
        if tensor is None:
            raise UsageError(f"--hold {name}: the trace has no tensor of that name")
        if tensor["role"] != "activation" or "view_of" in tensor or name == document["loss"]:
            what = (
                "the loss"
                if name == document["loss"]
                else f"a view of {tensor['view_of']}"
                if "view_of" in tensor
                else f"a {tensor['role']}"
            )
            raise UsageError(
                f"--hold {name}: it is {what}; name an activation with storage of its own"
            )
        tensor["held"] = True


def mesh_section(args: argparse.Namespace) -> dict[str, Any] | None:
    """The scenario's "parallelism" section (docs/model-format.md) that --fsdp, --nodes,
    --hsdp, --reshard-after-forward, --fsdp-impl, --reduce-dtype, --tp, --cp, --ep and --pp
    record, or None
    without --fsdp, --tp and --pp. The simulator writes it, checked by the mesh's rules as the
    commands that read it check them (``ferry._simulator.parallelism_section``; --fsdp and
    --nodes 0: not given)."""
    from .. import _simulator

    try:
        return _simulator.parallelism_section(
            fsdp=args.fsdp or None,
            nodes=args.nodes or None,
            hsdp=args.hsdp,
            reshard_after_forward=args.reshard_after_forward,
            fsdp_impl=args.fsdp_impl,
            reduce_dtype=args.reduce_dtype,
            tp=args.tp,
            cp=args.cp,
            ep=args.ep,
            pp=args.pp,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


def parallelism(section: dict[str, Any] | None, layers: list[int]) -> dict[str, Any] | None:
    """``section`` for a traced model with decoder ``layers``: FSDP2's units are the model's
    layers, as `fully_shard` is applied per decoder layer. Whether the model cuts for --tp,
    --cp and --ep the commands that run it say."""
    if section is not None and "fsdp" in section and not layers:
        raise UsageError(
            "--fsdp: the traced model has no layers to shard (fully_shard units follow the "
            "decoder layers ferry.trace finds)"
        )
    return section


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (0 done, 2 bad arguments or config)."""
    import torch

    from .._trace import trace

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        asked = _check(args)
        path, data = _load_config(args.config)
        model = build_model(data, args, path)
        with torch.device("meta"):
            ids = torch.zeros((args.batch, args.seq), dtype=torch.long)
        optimizer = None
        trainable = [p for p in model.parameters() if p.requires_grad]
        if args.optimizer in ("adamw", "adamw-fused"):
            optimizer = torch.optim.AdamW(trainable)
            if args.optimizer == "adamw-fused":
                # The parameters are meta tensors, which AdamW(fused=True) refuses: the group
                # asks for the fused kernel the device's step runs.
                for group in optimizer.param_groups:
                    group["fused"] = True
        elif args.optimizer == "adamw-for-loop":
            optimizer = torch.optim.AdamW(trainable, foreach=False)
        elif args.optimizer == "sgd":
            optimizer = torch.optim.SGD(trainable, lr=1e-3, momentum=0.9)
        stem = os.path.splitext(os.path.basename(path))[0]
        name = args.name or f"{stem}-s{args.seq}-b{args.batch}"
        # An encoder-decoder's decoder reads --seq tokens too, given rather than shifted from
        # the labels (a config may name no decoder start token).
        decoder = {"decoder_input_ids": ids} if model.config.is_encoder_decoder else {}
        precision = torch.backends.cuda.matmul.fp32_precision
        try:
            if args.tf32:
                torch.backends.cuda.matmul.fp32_precision = "tf32"
            traced = trace(
                model,
                ids,
                labels=ids,
                **decoder,
                optimizer=optimizer,
                name=name,
                target=args.target,
                routing=args.routing,
                compiled=args.compiled,
                fused_norms=args.fused_norms,
            )
        except ValueError as error:
            # Loads for another number of experts than a router of this model chooses among.
            if not str(error).startswith("ferry.trace: routing "):
                raise
            raise UsageError(f"--routing: {str(error).removeprefix('ferry.trace: ')}") from None
        finally:
            torch.backends.cuda.matmul.fp32_precision = precision
        hold(traced.document, args.hold)
        section = parallelism(asked, traced.layers())
        if section is not None:
            traced.document["parallelism"] = section
    except UsageError as error:
        print(f"python -m ferry trace: {error}", file=sys.stderr)
        return 2
    text = traced.to_json()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    doc = traced.document
    sharded = (
        f", FSDP2 over {args.fsdp} ranks in {len(traced.layers()) + 1} units "
        f"({len(traced.layers())} layers and the root)"
        if section is not None and args.fsdp
        else ""
    )
    if args.tp > 1:
        sharded += f", tensor parallelism over {args.tp} GPUs a rank"
    if args.cp > 1:
        sharded += f", context parallelism over {args.cp} GPUs a rank"
    if args.ep > 1:
        sharded += f", expert parallelism over {args.ep} GPUs"
    print(
        f"{name}: {len(doc['ops'])} ops, {len(doc['tensors'])} tensors, "
        f"{traced.saved_bytes()} saved activation bytes{sharded} -> {args.out}",
        file=sys.stderr,
    )
    if traced.compiled is not None:
        fused = traced.compiled
        what = "compiled" if args.compiled else "fused norms"
        section = "Compiled steps" if args.compiled else "Fused norms"
        print(
            f"{name}: {what}: {len(fused.groups)} fused groups; forward bytes "
            f"{fused.bytes_before} -> {fused.bytes_after}, backward bytes "
            f"{fused.backward_bytes_before} -> "
            f"{fused.backward_bytes_after} (docs/trace.md, {section})",
            file=sys.stderr,
        )
    if traced.routing is not None:
        print(
            f"{name}: the experts' rows follow the routing, assumed {args.routing} "
            "(docs/trace.md, Routing)",
            file=sys.stderr,
        )
    if traced.uncosted:
        listed = ", ".join(f"{op} ({calls} calls)" for op, calls in traced.uncosted.items())
        print(
            f"{name}: no cost model, so counted as free of FLOPs: {listed}",
            file=sys.stderr,
        )
    return 0
