"""Every model family the installed `transformers` registers, built tiny and traced for one
training step (`test_trace_families.py`; docs/trace.md, Costs).

The families come from transformers' own auto mappings: each registered config type
(`CONFIG_MAPPING_NAMES`) is traced with the first head of `HEADS` its mappings name for it.
Its config is transformers' default for the type with the layer, expert and size fields cut
(`tiny_config`); the model is built on the meta device and traced on fake tensors, so no weight
is allocated and nothing is downloaded.

`python tests/python/hf_families.py [TYPE...]` traces the families (all by default) and prints
one line for each: its wall and CPU seconds, and its uncosted ops or the error that stopped it.
"""

import functools
import sys
import time

import torch

#: The heads tried for each family, in order: (auto mapping, the inputs it takes). A family with
#: an LM head is traced with it; one without, with a classification head.
HEADS = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "tokens"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "tokens"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "tokens"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "tokens-class"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image-class"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "audio-class"),
)

BATCH, SEQ = 2, 16  # two samples: batch norm in training needs more than one value

# Config fields cut to a tiny model, by what they count (transformers' names vary by family).
_LAYERS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "num_blocks",  # xLSTM's
    "num_layers_per_stack",  # HRM's, each stack run once a cycle
)
_EXPERTS = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "num_expert_group": 1,
    "n_group": 1,
    "topk_group": 1,
}
# Fields whose value decides per step, from random draws, whether a layer runs (LayerDrop): a
# fake trace cannot read the draw, and the step traced is the one that runs every layer.
_LAYERDROP = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "layer_drop")
# The same for masks drawn at random over the input (SpecAugment's): boolean indexing by them
# has a shape that is data.
_RANDOM_MASKS = ("mask_time_prob", "mask_feature_prob")
# MLP widths, cut to a multiple of 16 bytes in any dtype (a grouped matmul's rows must be
# aligned; DeepSeek-V2's default experts are 1407 wide).
_WIDTHS = {
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
}


@functools.cache
def families():
    """Every registered config type with the head it is traced with: a sorted list of
    ``(model_type, mapping name, class name, inputs)``, where the mapping is None for a type
    with no head of `HEADS`."""
    from transformers.models.auto import configuration_auto, modeling_auto

    out = []
    for model_type in sorted(configuration_auto.CONFIG_MAPPING_NAMES):
        for mapping, inputs in HEADS:
            names = getattr(modeling_auto, mapping)
            if model_type in names:
                name = names[model_type]
                out.append(
                    (model_type, mapping, name if isinstance(name, str) else name[0], inputs)
                )
                break
        else:
            out.append((model_type, None, None, None))
    return tuple(out)


def _kept_layers(lists, count, least):
    """The layers a tiny model keeps of ``count``: the first ``least`` and the first of every
    distinct combination of the per-layer lists' entries (attention type, MLP type, ...)."""
    kept, seen = [], set()
    for i in range(count):
        key = tuple(str(values[i]) for values in lists)
        if i < least or key not in seen:
            kept.append(i)
        seen.add(key)
    return kept


def tiny_config(model_type):
    """Transformers' default config of ``model_type`` (and of its sub-configs) with its layers
    and experts cut (``_cut``) and no key/value cache, as a training step runs."""
    import transformers

    default = transformers.AutoConfig.for_model(model_type)
    return type(default).from_dict(_cut(default.to_dict()))


def _cut(fields):
    out = {}
    for key, value in fields.items():
        if isinstance(value, dict) and "model_type" in value:
            value = _cut(value)
        elif key in _EXPERTS and isinstance(value, int) and value > _EXPERTS[key]:
            value = _EXPERTS[key]
        elif key in _EXPERTS and value is None and key in fields:
            value = _EXPERTS[key]  # DeepSeek-V2's and dots1's defaults leave them unset
        elif key in _WIDTHS and isinstance(value, int) and value > _WIDTHS[key]:
            value = _WIDTHS[key]
        elif (key in _LAYERDROP or key in _RANDOM_MASKS) and value:
            value = 0.0
        elif key.endswith("_layer_period") and isinstance(value, int) and value > 2:
            value = 2  # Jamba's attention and experts every other layer
        elif key.endswith("_layer_offset") and isinstance(value, int) and value > 1:
            value = 1
        elif key in ("first_k_dense_replace", "moe_layer_start_index") and value:
            value = 0  # the one layer kept has the experts (a dense MLP's ops are theirs too)
        elif (
            key == "head_dim"
            and value is None
            and fields.get("hidden_size")
            and fields.get("num_attention_heads")
        ):
            value = fields["hidden_size"] // fields["num_attention_heads"]  # Ministral's default
        elif key == "num_key_value_heads" and value is None and fields.get("num_attention_heads"):
            value = fields["num_attention_heads"]  # Nemotron's default: as many as the queries
        elif key == "use_cache":
            value = False
        elif key in ("stage_names", "out_features", "out_indices"):
            continue  # a backbone's stages follow from its layers
        out[key] = value
    # One layer, two where a period puts other blocks on every other layer (Jamba's).
    least = 2 if any(k.endswith("_layer_period") for k in out) else 1
    for key in _LAYERS:
        count = out.get(key)
        if not isinstance(count, int) or count <= least:
            continue
        # Per-layer lists (layer types, MLP types) and per-layer dicts (keyed by the layer's
        # index) keep the entries of the layers kept.
        indices = [k for k, v in out.items() if _layer_indices(v, count)]
        lists = [
            k
            for k, v in out.items()
            if isinstance(v, list) and len(v) == count and k not in indices
        ]
        dicts = [k for k, v in out.items() if _by_layer(v, count)]
        per_layer = [out[k] for k in lists]
        per_layer += [[_by_layer(out[k], count).get(i) for i in range(count)] for k in dicts]
        per_layer += [[i in out[k] for i in range(count)] for k in indices]
        kept = _kept_layers(per_layer, count, least)
        shared = out.get("num_kv_shared_layers")
        if isinstance(shared, int) and shared:
            # Gemma-3n's last layers reuse earlier layers' keys and values: none does once
            # the layers are cut, unless all do (an assistant model's layers read its target's).
            out["num_kv_shared_layers"] = len(kept) if shared >= count else 0
        out[key] = len(kept)
        for k in lists:
            out[k] = [out[k][i] for i in kept]
        for k in indices:
            out[k] = [new for new, i in enumerate(kept) if i in out[k]]
        for k in dicts:
            entries = out[k]
            width = len(next(iter(entries))) if isinstance(next(iter(entries)), str) else 0
            out[k] = {
                (str(new).zfill(width) if width else new): entries[old]
                for new, i in enumerate(kept)
                for old in entries
                if int(old) == i
            }
    return out


def _layer_indices(value, count):
    """Whether ``value`` lists layers by index (Llama 4's ``moe_layers``): increasing ints below
    ``count``, named once each."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(type(i) is int for i in value)
        and all(a < b for a, b in zip(value, value[1:]))
        and 0 <= value[0]
        and value[-1] < count
    )


def _by_layer(value, count):
    """A dict keyed by layer indices below ``count`` (ints or digit strings, dots3's
    ``per_layer_config``), as index -> entry; else None."""
    if not isinstance(value, dict) or not value:
        return None
    keys = list(value)
    if not all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in keys):
        return None
    indices = {int(k): v for k, v in value.items()}
    return indices if max(indices) < count else None


def build(model_type):
    """The family's tiny model (its head's class) on the meta device in training mode, and its
    inputs' kind."""
    import transformers

    found = [(m, c, i) for family, m, c, i in families() if family == model_type]
    if not found:
        raise KeyError(f"{model_type}: not a config type transformers registers")
    ((mapping, class_name, inputs),) = found
    if mapping is None:
        raise LookupError(f"{model_type}: no head of {[h for h, _ in HEADS]}")
    config = tiny_config(model_type)
    if mapping == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES" and hasattr(config, "is_decoder"):
        config.is_decoder = True  # an encoder family's causal LM head (BERT's, Reformer's)
    cls = getattr(transformers, class_name)
    text = getattr(config, "text_config", None)
    if not isinstance(config, cls.config_class) and isinstance(text, cls.config_class):
        config = text  # a composite family's text model (Llama 4's causal LM)
    with torch.device("meta"):
        model = cls._from_config(config)
    return model.train(), inputs


def _image_size(config):
    size = getattr(config, "image_size", 224)
    if isinstance(size, (list, tuple)):
        return tuple(size[-2:])
    if isinstance(size, dict):
        return size.get("height", 224), size.get("width", 224)
    return size, size


def example(model, inputs):
    """The keyword inputs of one training step of ``model`` (meta tensors)."""
    config = model.config
    with torch.device("meta"):
        ids = torch.zeros((BATCH, SEQ), dtype=torch.long)
        if inputs == "tokens" and config.is_encoder_decoder:
            # The decoder's inputs given, not shifted from the labels: a default config may
            # name no start token (the pretrained ones do).
            return {"input_ids": ids, "decoder_input_ids": ids, "labels": ids}
        if inputs == "tokens":
            return {"input_ids": ids, "labels": ids}
        if inputs == "tokens-class":
            return {"input_ids": ids, "labels": torch.zeros(BATCH, dtype=torch.long)}
        labels = torch.zeros(BATCH, dtype=torch.long)
        if inputs == "image-class":
            channels = getattr(config, "num_channels", 3)
            h, w = _image_size(config)
            return {"pixel_values": torch.zeros((BATCH, channels, h, w)), "labels": labels}
        if inputs == "audio-class" and hasattr(config, "num_mel_bins"):
            # A spectrogram: the config's frames of its mel bins (Audio Spectrogram Transformer).
            frames = getattr(config, "max_length", 1024)
            values = torch.zeros((BATCH, frames, config.num_mel_bins))
            return {"input_values": values, "labels": labels}
        if inputs == "audio-class":  # a waveform: one second at 16 kHz
            return {"input_values": torch.zeros((BATCH, 16000)), "labels": labels}
    raise ValueError(inputs)


def trace_tiny(model_type):
    """The traced training step of the family's tiny model."""
    from ferry._trace import trace

    model, inputs = build(model_type)
    return trace(model, **example(model, inputs), loss_fn=_loss, name=f"{model_type}-tiny")


def _loss(out):
    """The head's loss of its labels, or, for a head that computes none (PP-LCNet's), the mean
    of its first output."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    first = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
    return first.float().mean()


def main(argv):
    types = argv or [t for t, mapping, _, _ in families() if mapping is not None]
    for model_type in types:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            result = dict(sorted(trace_tiny(model_type).uncosted.items()))
        except Exception as e:  # noqa: BLE001  (a survey: every failure is printed)
            result = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"{model_type}\t{wall:.1f}\t{cpu:.1f}\t{result}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
