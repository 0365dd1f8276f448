"""Small Llama, GPT-2 and BERT models built from ``transformers`` configs, random init."""

import torch

SEED = 0


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "ferry.examples: the llama, gpt2 and bert examples need transformers "
            "(pip install transformers)"
        ) from e
    return transformers


def _tokens(vocab, batch, seq):
    ids = torch.randint(0, vocab, (batch, seq))
    return {"input_ids": ids, "labels": ids.clone()}


def llama(batch=2, seq=64, layers=2):
    """A Llama of ``layers`` layers (2), hidden 64, 4 heads over 2 key/value heads, MLP 128,
    SDPA."""
    tf = _transformers()
    config = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
    )
    torch.manual_seed(SEED)
    model = tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train()
    return model, _tokens(256, batch, seq), None


def gpt2(batch=2, seq=64):
    """A GPT-2 of 2 layers, hidden 64, 4 heads, tied head, dropout 0.1."""
    tf = _transformers()
    config = tf.GPT2Config(
        vocab_size=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=seq,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(SEED)
    model = tf.GPT2LMHeadModel._from_config(config, attn_implementation="eager").train()
    return model, _tokens(256, batch, seq), None


def bert(batch=2, seq=64):
    """A BERT masked LM of 2 layers, hidden 64, 4 heads, intermediate 128, dropout 0.1. The
    token type ids are passed (zeros), as a data pipeline does: left out, BERT expands a
    buffer's slice to the batch, a view whose logical bytes exceed its storage's, which the
    model format cannot say (docs/validation.md)."""
    tf = _transformers()
    config = tf.BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=seq,
    )
    torch.manual_seed(SEED)
    model = tf.BertForMaskedLM._from_config(config, attn_implementation="eager").train()
    inputs = _tokens(256, batch, seq)
    inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    return model, inputs, None
