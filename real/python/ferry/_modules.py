"""Where things are in a model: the model under its wrappers and its output head.

``offload_model``, the trace and ``offload(plan=...)`` all keep the output head's saved tensors
on the device; they find it here, one way. Free of ``ferry._C``.
"""

from __future__ import annotations

import torch


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside its wrappers: a DDP or FSDP wrapper's ``module``, a PEFT model's base
    model."""
    unwrapped = getattr(model, "module", model)
    if hasattr(unwrapped, "base_model") and hasattr(unwrapped, "peft_config"):
        unwrapped = unwrapped.base_model
    return unwrapped


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module whose saved tensors are not worth offloading (the reference's search):
    ``output`` (or ``output.linear``), ``lm_head``, ``decoder.output`` / ``decoder.lm_head``,
    ``final_layer_norm`` / ``ln_f``, ``head``; None when there is none. ``model`` is unwrapped
    already."""
    nn = torch.nn
    if hasattr(model, "output"):
        if isinstance(model.output, nn.Module):
            return model.output
        linear = getattr(model.output, "linear", None)
        return linear if isinstance(linear, nn.Module) else None
    if hasattr(model, "lm_head"):
        return model.lm_head if isinstance(model.lm_head, nn.Module) else None
    if hasattr(model, "decoder"):
        decoder = model.decoder
        for name in ("output", "lm_head"):
            head = getattr(decoder, name, None)
            if isinstance(head, nn.Module):
                return head
        return None
    if hasattr(model, "final_layer_norm") or hasattr(model, "ln_f"):
        head = getattr(model, "final_layer_norm", None) or getattr(model, "ln_f", None)
        return head if isinstance(head, nn.Module) else None
    head = getattr(model, "head", None)
    return head if isinstance(head, nn.Module) else None


def head_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output head of ``model``, wrapped or not (None when there is none)."""
    return output_head(unwrap(model))


def head_path(root: torch.nn.Module) -> str | None:
    """The path of ``root``'s output head among its named modules (None when there is none)."""
    head = head_of(root)
    if head is None:
        return None
    for path, module in root.named_modules():
        if module is head:
            return path
    return None
