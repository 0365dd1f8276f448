"""Random programs over saved tensors, run with and without ferry (the saved-tensor contract).

A program is a list of steps drawn from a seeded generator: ops that save tensors (unary,
products, matmuls), views (transpose, flatten, narrow, conj, real, imag: conjugate and negative
bits), in-place changes with and without grad, checkpointed segments and no-offload segments,
all inside one region (none, an offload region of either policy, or an offload region under
``torch.autograd.graph.allow_mutation_on_saved_tensors``). Run plainly (no ferry;
``torch.utils.checkpoint`` for checkpointed segments) and under ferry, a program must give equal
gradients, or the same error. See Note [Saved-tensor contract] in real/src/saved_tensors.hpp.
"""

import contextlib
import random
import re

import torch
import torch.utils.checkpoint as torch_checkpoint

import ferry
from ferry.testing import planted_offload

UNARY = ("sin", "cos", "exp", "tanh", "square", "self_mul", "mul_const")
VIEWS = ("transpose", "flatten", "narrow", "conj", "real", "imag")
REGIONS = ("none", "offload", "offload", "offload", "allow_mutation")


class Value:
    """What the generator knows of a tensor in the pool: its shape and whether it is complex."""

    def __init__(self, shape, cplx, leaf=False):
        self.shape = shape
        self.cplx = cplx
        self.leaf = leaf


class Program:
    """One random program; ``str(program)`` lists its steps (shown when a case fails)."""

    def __init__(self, seed):
        r = random.Random(seed)
        self.seed = seed
        self.region = r.choice(REGIONS)
        self.options = dict(
            loopback=True,
            policy=r.choice(("ferry", "ferry", "trl")),
            min_bytes=0,
            dedup=r.random() < 0.8,
        )
        if r.random() < 0.5:
            self.options["window_bytes"] = 0
        cplx = r.random() < 0.35
        self.leaves = [
            Value((4, 4), cplx and r.random() < 0.7, leaf=True) for _ in range(r.randint(1, 3))
        ]
        pool = list(self.leaves)
        self.steps = []
        used = []  # operands of earlier steps: what an in-place change most often hits
        for _ in range(r.randint(2, 9)):
            step = self._step(r, pool, used)
            if step is not None:
                self.steps.append(step)
                used.append(step[1])
        n = len(pool)
        self.loss = sorted({n - 1} | {i for i in range(n) if r.random() < 0.3})

    def _step(self, r, pool, used):
        kind = r.choices(
            (
                "unary",
                "mul",
                "matmul",
                "view",
                "inplace",
                "inplace_grad",
                "checkpoint",
                "no_offload",
            ),
            weights=(6, 3, 2, 4, 3, 1, 2, 1),
        )[0]
        i = r.randrange(len(pool))
        if kind in ("inplace", "inplace_grad") and used and r.random() < 0.7:
            i = r.choice(used)
        v = pool[i]
        if kind == "unary":
            fn = r.choice(UNARY)
            pool.append(Value(v.shape, v.cplx))
            return ("unary", i, fn)
        if kind == "mul":
            same = [j for j, w in enumerate(pool) if w.shape == v.shape]
            j = r.choice(same)
            pool.append(Value(v.shape, v.cplx or pool[j].cplx))
            return ("mul", i, j)
        if kind == "matmul":
            fits = [
                j
                for j, w in enumerate(pool)
                if len(w.shape) == 2
                and len(v.shape) == 2
                and w.shape[0] == v.shape[1]
                and w.cplx == v.cplx
            ]
            if not fits:
                return None
            j = r.choice(fits)
            pool.append(Value((v.shape[0], pool[j].shape[1]), v.cplx))
            return ("matmul", i, j)
        if kind == "view":
            choices = ["transpose", "flatten", "narrow"] if len(v.shape) == 2 else ["flatten"]
            if v.cplx:
                choices += ["conj", "conj", "real", "imag", "imag"]
            view = r.choice(choices)
            if view == "transpose":
                shape = (v.shape[1], v.shape[0])
            elif view == "flatten":
                shape = (v.shape[0] * v.shape[1],) if len(v.shape) == 2 else (v.shape[0] // 4, 4)
            elif view == "narrow":
                shape = (v.shape[0], max(1, v.shape[1] // 2))
            else:
                shape = v.shape
            pool.append(Value(shape, v.cplx and view not in ("real", "imag")))
            return ("view", i, view)
        if kind == "inplace":
            return ("inplace", i, r.choice(("mul_", "add_")))
        if kind == "inplace_grad":
            return ("inplace_grad", i, r.choice(("mul_", "add_")))
        if kind == "checkpoint":
            fns = [r.choice(UNARY) for _ in range(r.randint(1, 3))]
            pool.append(Value(v.shape, v.cplx))
            return ("checkpoint", i, tuple(fns))
        fns = [r.choice(UNARY) for _ in range(r.randint(1, 2))]
        pool.append(Value(v.shape, v.cplx))
        return ("no_offload", i, tuple(fns))

    def __str__(self):
        lines = [
            f"seed {self.seed}: region {self.region}, options {self.options}",
            "leaves: " + ", ".join(f"{v.shape}{' complex' if v.cplx else ''}" for v in self.leaves),
        ]
        lines += [f"  {step}" for step in self.steps]
        lines.append(f"  loss over {self.loss}")
        return "\n".join(lines)


def _unary(t, fn):
    if fn == "square":
        return t.pow(2)
    if fn == "self_mul":
        return t * t
    if fn == "mul_const":
        return t * 1.5
    return getattr(torch, fn)(t)


def _chain(fns):
    def run(t):
        for fn in fns:
            t = _unary(t, fn)
        return t

    return run


def _view(t, view):
    if view == "transpose":
        return t.t()
    if view == "flatten":
        return t.reshape(-1) if t.dim() == 2 else t.view(-1, 4)
    if view == "narrow":
        return t.narrow(1, 0, max(1, t.shape[1] // 2))
    if view == "conj":
        return t.conj()
    return getattr(t, view)


def run(program, with_ferry, faults=()):
    """The leaves' gradients after the program's forward and backward, or the error raised
    (its type and message). ``faults`` plants breaches of the contract in ferry's regions
    (``ferry.testing.FAULTS``)."""
    gen = torch.Generator().manual_seed(program.seed)
    leaves = []
    for v in program.leaves:
        dtype = torch.complex64 if v.cplx else torch.float32
        leaves.append(torch.randn(v.shape, dtype=dtype, generator=gen).requires_grad_())
    session = None
    if with_ferry:
        session = (
            planted_offload(faults=faults, **program.options)
            if faults
            else ferry.offload(**program.options)
        )
    outer = (
        torch.autograd.graph.allow_mutation_on_saved_tensors()
        if program.region == "allow_mutation"
        else contextlib.nullcontext()
    )
    region = session if with_ferry and program.region != "none" else contextlib.nullcontext()
    checkpoint = ferry.checkpoint if with_ferry else torch_checkpoint.checkpoint
    try:
        with outer:
            pool = list(leaves)
            with region:
                for kind, i, arg in program.steps:
                    t = pool[i]
                    if kind == "unary":
                        pool.append(_unary(t, arg))
                    elif kind == "mul":
                        pool.append(t * pool[arg])
                    elif kind == "matmul":
                        pool.append(t @ pool[arg])
                    elif kind == "view":
                        pool.append(_view(t, arg))
                    elif kind == "inplace":
                        with torch.no_grad():
                            getattr(t, arg)(2)
                    elif kind == "inplace_grad":
                        getattr(t, arg)(2)
                    elif kind == "checkpoint":
                        pool.append(checkpoint(_chain(arg), t, use_reentrant=False))
                    else:  # no_offload
                        inner = (
                            ferry.no_offload()
                            if with_ferry and program.region != "none"
                            else contextlib.nullcontext()
                        )
                        with inner:
                            pool.append(_chain(arg)(t))
                loss = sum(
                    (pool[k].real if pool[k].is_complex() else pool[k]).sum() for k in program.loss
                )
            loss.backward()
    except Exception as e:  # noqa: BLE001 (any error is an outcome to compare)
        return ("error", type(e).__name__, str(e))
    finally:
        if session is not None:
            del session
    return ("grads", [None if t.grad is None else t.grad.clone() for t in leaves])


def without_node(message):
    """An error message without the node it names for the changed tensor: for a view whose base
    changed in place, torch names the node it regenerates at unpack (AsStridedBackward0), ferry
    the one the view had when it was saved."""
    return re.sub(r", which is output \d+ of \w+,", "", message)


def same_outcome(a, b):
    """Whether two outcomes of ``run`` agree: the same error, or gradients bitwise equal."""
    if a[0] != b[0]:
        return False
    if a[0] == "error":
        return a[1] == b[1] and without_node(a[2]) == without_node(b[2])
    return all(
        (x is None and y is None) or (x is not None and y is not None and _identical(x, y))
        for x, y in zip(a[1], b[1])
    )


def _identical(x, y):
    """Equal values, NaN where the other has NaN (programs may overflow, the same way in both)."""
    return (
        x.shape == y.shape
        and x.dtype == y.dtype
        and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)
    )


def first_failure(seeds, faults=()):
    """The first seed whose program ferry (with ``faults`` planted) runs differently from plain
    torch, with both outcomes; None when every one agrees."""
    for seed in seeds:
        program = Program(seed)
        plain = run(program, with_ferry=False)
        under_ferry = run(program, with_ferry=True, faults=faults)
        if not same_outcome(plain, under_ferry):
            return program, plain, under_ferry
    return None
