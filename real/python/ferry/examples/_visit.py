"""The models a GPU visit validates and benchmarks (``scripts/gpu.sh``, docs/validation.md,
"Where a GPU is lent"): a GPT-2-medium-like, a Llama of about 1B parameters and a tiny Mixtral,
built from ``transformers`` configs with random weights drawn from a fixed seed (nothing is
downloaded). ``scale="full"`` gives the visit's sizes; ``scale="rehearse"`` the same
architectures shrunk (2 layers, hidden 64) for the rehearsal on the CPU loopback device.
Each factory returns ``(model, inputs, loss_fn)`` as the bundled examples do."""

import torch

from ._hf import SEED, _tokens, _transformers

SCALES = ("full", "rehearse")


def _check(scale, who):
    if scale not in SCALES:
        raise ValueError(f"ferry.examples.{who}: scale must be one of {SCALES} (got {scale!r})")
    return scale == "full"


def gpt2_medium(scale="full", batch=None, seq=None):
    """GPT-2 medium's shape (24 layers, hidden 1024, 16 heads, vocabulary 50,257; about 355M
    parameters), batch 4 × 512 tokens, SDPA attention, dropout 0.1 as GPT-2's config has it."""
    full = _check(scale, "gpt2_medium")
    tf = _transformers()
    vocab = 50257 if full else 256
    batch, seq = batch or (4 if full else 2), seq or (512 if full else 32)
    config = tf.GPT2Config(
        vocab_size=vocab,
        n_embd=1024 if full else 64,
        n_layer=24 if full else 2,
        n_head=16 if full else 4,
        n_positions=max(seq, 1024 if full else seq),
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(SEED)
    model = tf.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").train()
    return model, _tokens(vocab, batch, seq), None


def llama_1b(scale="full", batch=None, seq=None):
    """Llama 3.2 1B's shape (16 layers, hidden 2048, MLP 8192, 32 heads over 8 key/value heads,
    vocabulary 128,256, tied embeddings; about 1.24B parameters), batch 1 × 1024 tokens, SDPA."""
    full = _check(scale, "llama_1b")
    tf = _transformers()
    vocab = 128256 if full else 256
    batch, seq = batch or (1 if full else 2), seq or (1024 if full else 32)
    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=2048 if full else 64,
        intermediate_size=8192 if full else 128,
        num_hidden_layers=16 if full else 2,
        num_attention_heads=32 if full else 4,
        num_key_value_heads=8 if full else 2,
        max_position_embeddings=max(seq, 2048 if full else seq),
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train()
    return model, _tokens(vocab, batch, seq), None


def mixtral_tiny(scale="full", batch=None, seq=None):
    """A small Mixtral (4 layers, hidden 512, 8 experts of MLP 1024 with 2 routed a token, 8
    heads over 2 key/value heads, vocabulary 32,000), batch 2 × 512 tokens, SDPA."""
    full = _check(scale, "mixtral_tiny")
    tf = _transformers()
    vocab = 32000 if full else 256
    batch, seq = batch or 2, seq or (512 if full else 32)
    config = tf.MixtralConfig(
        vocab_size=vocab,
        hidden_size=512 if full else 64,
        intermediate_size=1024 if full else 128,
        num_hidden_layers=4 if full else 2,
        num_attention_heads=8 if full else 4,
        num_key_value_heads=2,
        num_local_experts=8 if full else 4,
        num_experts_per_tok=2,
        max_position_embeddings=max(seq, 1024 if full else seq),
    )
    torch.manual_seed(SEED)
    model = tf.MixtralForCausalLM._from_config(config, attn_implementation="sdpa").train()
    return model, _tokens(vocab, batch, seq), None


#: The visit's models by the names its results use.
VISIT_MODELS = {"gpt2-medium": gpt2_medium, "llama-1b": llama_1b, "mixtral-tiny": mixtral_tiny}
