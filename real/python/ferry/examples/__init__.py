"""Small models to validate ferry's predictions on (``python -m ferry validate NAME``).

Each example is a factory of no arguments that returns ``(model, inputs, loss_fn)``: a model in
training mode with random weights drawn from a fixed seed, its inputs (a tuple of positional
arguments or a dict of keywords) and the function that turns its output into the loss (None:
the output's ``.loss``). ``gpt`` is written here with torch alone; ``llama``, ``gpt2`` and
``bert`` are built from ``transformers`` configs (random init, nothing downloaded), so they
need that package.
"""

from ._gpt import gpt
from ._hf import bert, gpt2, llama

EXAMPLES = {"gpt": gpt, "llama": llama, "gpt2": gpt2, "bert": bert}

__all__ = ["EXAMPLES", "gpt", "llama", "gpt2", "bert"]
