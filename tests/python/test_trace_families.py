"""Every model family the installed `transformers` registers traces with every op costed
(docs/trace.md, Costs): each config type of its auto mappings, built tiny with the first head
of `hf_families.HEADS` it has (`hf_families.py`), traced for one training step, has no
uncosted op. A family that cannot be traced this way is skipped with its reason in `SKIPS`,
one with no such head with that reason (pytest's `-rs` lists both, the headless ones as one
count). `test_the_skip_list_names_registered_families`
keeps the list honest: every entry is a family transformers registers and has a head for.

The families are dealt to two classes so that `pytest -n 2 --dist loadscope` (CI) runs each
half on its own worker.
"""

import pytest

transformers = pytest.importorskip("transformers")

import hf_families  # noqa: E402

#: model_type -> why a family with a head is not traced. Each reason is what stops it.
_ITEM = "reads a tensor's value in forward (`Tensor.item()`), which a fake trace does not have"
_DEFAULT = "transformers' default config builds no model"
SKIPS = {
    # The model's forward needs values.
    "blt": f"its patcher cuts the bytes into patches by its entropy model's output: {_ITEM}",
    "flaubert": f"checks its input lengths: {_ITEM}",
    "xlm": f"checks its input lengths: {_ITEM}",
    "fsmt": _ITEM,
    "ibert": f"its integer-only quantization bounds its activations by their range: {_ITEM}",
    "led": f"asks whether any token attends globally: {_ITEM}",
    "longformer": f"asks whether any token attends globally: {_ITEM}",
    "t5gemma2": "indexes by a mask of its inputs' values, a shape a fake trace cannot know",
    # Packages not installed.
    "dinat": "needs the `natten` package, which is not installed",
    "gemma3n": "its vision tower needs the `timm` and `pillow` packages, which are not installed",
    "timm_wrapper": "needs the `timm` and `pillow` packages, which are not installed",
    "layoutlmv2": "needs the `detectron2` package, which is not installed",
    # Defaults that build no model.
    "cohere_compass_text": f"{_DEFAULT} (KeyError 'full_attention' in its layers)",
    "dbrx": f"{_DEFAULT} (its attention config has no rope_theta)",
    "lfm2_moe": f"{_DEFAULT} (its layer_types are unset)",
    "qwen4_exp": f"{_DEFAULT} (its indexer's head counts and budget are unset)",
    "qwen4_exp_text": f"{_DEFAULT} (its indexer's head counts and budget are unset)",
    "zamba": "building it on the meta device fails in its post_init (RuntimeError: Cannot swap "
    "t2 because it has weakref associated with it)",
    "esm": f"{_DEFAULT}: its vocabulary and padding token come from its tokenizer",
    "musicgen": f"{_DEFAULT} (a composite of a text encoder, an audio codec and a decoder with "
    "no default; no `dropout`)",
    "musicgen_melody": f"{_DEFAULT} (the same composite as MusicGen's; no `dropout`)",
    "xmod": "needs a default language (`set_default_language`), which its checkpoints set",
    "imagegpt": "its causal image head (ImageGPTForCausalImageModeling) rejects `input_ids` "
    "passed by keyword in transformers 5.23 ('You have to specify either input_ids or "
    "inputs_embeds')",
    # Inputs no generic example makes.
    "git": "an image-captioning model: its loss expects the image's tokens before the text",
    "perceiver": "its masked LM decodes a fixed max_position_embeddings (2048) positions, which "
    "labels of another length do not match",
    "siglip2": "takes images as sequences of patches with their spatial shapes",
    "wav2vec2-bert": "its classifier takes filterbank features (`input_features`), not a waveform",
    "shieldgemma2": "an image safety classifier: needs images with its prompts",
    "voxtral_realtime": "a speech model: needs audio features (`input_features`)",
    "reformer": "in training its axial position embeddings need a sequence of "
    "prod(axial_pos_shape) = 4096 tokens",
    # What the trace cannot follow.
    "switch_transformers": "its router casts its own weights in forward (`Module.to`), which "
    "swaps the parameters the trace holds as fake tensors (RuntimeError: Cannot swap t2 because "
    "it has weakref associated with it)",
    # Layouts the tiny config cannot keep.
    "zamba2": "its shared-attention layout (`hybrid_layer_ids`) does not survive cutting its "
    "layers",
    "gemma4_assistant": "a draft model whose layers read its target model's keys and values: "
    "its config does not validate once its layers are cut",
    "gemma4_unified_assistant": "a draft model whose layers read its target model's keys and "
    "values: its cache layout does not validate once its layers are cut",
}

FAMILIES = hf_families.families()
#: The families traced, in the order transformers' config mapping sorts them.
TRACED = [t for t, mapping, _, _ in FAMILIES if mapping is not None and t not in SKIPS]
#: The families with no head of `hf_families.HEADS` (vision-language, detection, segmentation,
#: speech-to-text and text-to-speech models, and the sub-configs of composite ones).
HEADLESS = [t for t, mapping, _, _ in FAMILIES if mapping is None]


HEADLESS_REASON = (
    "no causal LM, seq2seq LM, masked LM or sequence, image or audio classification head in "
    "transformers' auto mappings"
)


def _params(families):
    params = []
    for t in families:
        if t in SKIPS:
            marks = [pytest.mark.skip(reason=f"{t}: {SKIPS[t]}")]
        elif t in HEADLESS:  # one reason for all: pytest -rs counts them on one line
            marks = [pytest.mark.skip(reason=HEADLESS_REASON)]
        else:
            marks = []
        params.append(pytest.param(t, id=t, marks=marks))
    return params


ALL = [t for t, _, _, _ in FAMILIES]


def test_the_skip_list_names_registered_families():
    with_head = {t for t, mapping, _, _ in FAMILIES if mapping is not None}
    assert set(SKIPS) <= with_head, sorted(set(SKIPS) - with_head)
    assert all(reason.strip() for reason in SKIPS.values())
    # Every registered family is traced, skipped with its reason, or has no head.
    assert len(TRACED) + len(SKIPS) + len(HEADLESS) == len(FAMILIES)
    assert TRACED, "no family to trace: transformers' auto mappings were not read"


def _check(model_type):
    traced = hf_families.trace_tiny(model_type)
    assert traced.uncosted == {}, f"{model_type}: ops with no cost model: {traced.uncosted}"
    forward, backward = traced.flops()
    assert forward > 0 and backward > 0, model_type


class TestFamiliesFirstHalf:
    @pytest.mark.parametrize("model_type", _params(ALL[0::2]))
    def test_family_has_no_uncosted_op(self, model_type):
        _check(model_type)


class TestFamiliesSecondHalf:
    @pytest.mark.parametrize("model_type", _params(ALL[1::2]))
    def test_family_has_no_uncosted_op(self, model_type):
        _check(model_type)
