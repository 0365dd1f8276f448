"""A Hugging Face key/value cache passed to a checkpointed region's call: each replay gets a copy
of it as the call found it (Note [A cache written in a region])."""

from __future__ import annotations

import copy

import torch

# Note [A cache written in a region]
# A Hugging Face layer called with a key/value cache (`past_key_values`, which the model makes
# by default, `use_cache=True`, in training too) appends its keys and values to it:
# `DynamicLayer.update` creates the empty tensors on its first call (`lift_fresh`) and
# concatenates. A checkpointed region's replay would append them a second time and run other
# ops (`cat` where forward ran `lift_fresh`), on twice the keys. Transformers' own gradient
# checkpointing drops the cache (`use_cache=False`); that changes the forward's ops from the
# traced ones, and its bits (attention gets the rotary output, not the contiguous copy the
# cache returns). Instead the forward runs with the cache as traced, and each replay gets a
# copy of the cache as the call found it: its objects, lists and dicts copied, its tensors
# shared (a dynamic cache rebinds them, never writes them). The replay then runs forward's
# ops on forward's values and leaves the model's cache as forward left it.


def is_cache(value):
    """Whether ``value`` is a Hugging Face key/value cache (a ``transformers`` ``Cache``)."""
    return any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers.")
        for c in type(value).__mro__
    )


def _cache_part(value):
    return not isinstance(value, torch.nn.Module) and any(
        c.__module__.startswith("transformers.") and "cache" in c.__module__
        for c in type(value).__mro__
    )


def copy_cache(value, memo=None):
    """A copy of a cache's state (Note [A cache written in a region]): the cache's objects and
    their lists, tuples and dicts copied, anything else (tensors included) shared."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    if type(value) in (list, tuple, set):
        out = type(value)(copy_cache(v, memo) for v in value)
    elif type(value) is dict:
        out = {key: copy_cache(v, memo) for key, v in value.items()}
    elif _cache_part(value) and hasattr(value, "__dict__"):
        out = copy.copy(value)
        memo[id(value)] = out
        out.__dict__.update({key: copy_cache(v, memo) for key, v in vars(value).items()})
    else:
        return value
    memo[id(value)] = out
    return out


def replay_cache(value, caches):
    """What a replay passes for the argument ``value``: a fresh copy of the cache as forward
    found it, or ``value`` itself."""
    for cache, found in caches:
        if value is cache:
            return copy_cache(found)
    return value
