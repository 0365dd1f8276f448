"""What a trace assumes where a model's shapes depend on values (docs/trace.md, Routing): the
routing assumption that stands in for the router's choice, the values that follow from it, and
grouped matmuls in dtypes the fake kernel refuses. Free of ``ferry._C``: tracing needs torch
only.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .._names import writes

# Note [Routing as a stated assumption]
# A mixture-of-experts layer sends each token to the k experts its router scores highest
# (`topk`). On fake tensors the scores have no values, so neither has the choice. Where the
# model computes every routed row whatever the choice (the grouped matmul over all
# tokens x k rows, which group boundaries only split), the shapes need no values, but the rows
# of each group (each expert's, which expert parallelism prices) are the choice. Where it
# gathers each expert's tokens (`nonzero`, `torch.where(mask)`, a loop over the experts hit),
# the shapes are the choice, and a fake run stops. So the trace states the choice: a `topk`
# over scores it cannot see returns the indices the routing assumption gives (balanced, given
# per-expert loads, or seeded random with a capacity factor), and from there on the trace
# knows the values of what is computed from known values only (`Values`), on real CPU tensors
# beside the fake ones. An op whose output shape or result is data (tagged
# `dynamic_output_shape` or `data_dependent_output`: `nonzero`, `item`) is then run on the
# known values, and its fake result is made from the real one; a grouped matmul whose offsets
# are known records each group's rows (`Values.group_rows`). The ops are classified by what
# they are (their tags, `topk`), never by module or op names.

#: Values that follow from a routing choice are kept for tensors up to this many bytes (the
#: routing's indices and masks: a few bytes a token and expert); larger ones are left to the
#: fake run alone.
MAX_KNOWN_BYTES = 256 << 20
#: Other known values (what factories make: `arange`, a mask of ones) up to this many bytes: a
#: causal mask built from `ones` is as large as the sequence squared, and no routing needs it.
MAX_OTHER_BYTES = 1 << 20
#: The most bytes of known values held at once; the oldest are forgotten beyond it (what a
#: data-dependent op reads was computed just before, in the same layer).
KNOWN_BUDGET = 1 << 30

_ASSUMPTIONS = ("balanced", "loads", "random")
#: The grouped matrix products, whose offsets split the rows among the experts.
_GROUPED = ("_grouped_mm", "_scaled_grouped_mm")


class Routing:
    """The routing assumption of a trace: which experts each router choice (``topk`` over
    scores the trace cannot see) picks.

    ``"balanced"``: every expert receives the same number of rows (within one). ``"loads=W0,
    W1,..."``: expert e receives rows in proportion to W_e (one weight per candidate of each
    choice). ``"random"``, ``"random,seed=S"``, ``"random,seed=S,capacity=C"``: each row picks
    k distinct experts uniformly at random from a generator seeded by S (default 0), the
    choice's module and its shape; with a capacity factor C (at least 1), no expert receives
    more than ceil(C x rows x k / experts) rows: the rows cut from the experts above it go to
    the least loaded experts, and the experts' rows are dealt to the rows in a seeded order.

    Args:
        spec: The assumption as text (above), or a Routing.

    Raises:
        ValueError: A spec that is none of the above, with the part that is wrong.
    """

    def __init__(self, spec: str | Routing = "balanced") -> None:
        if isinstance(spec, Routing):
            spec = spec.spec
        if not isinstance(spec, str):
            raise TypeError(f"ferry.trace: routing: expected a string, got {type(spec).__name__}")
        self.spec = spec
        self.assumption, self.loads, self.seed, self.capacity = _parse(spec)

    def to_json(self) -> dict[str, Any]:
        """The assumption as the document records it (docs/model-format.md, Routing)."""
        out: dict[str, Any] = {"assumption": self.assumption}
        if self.assumption == "loads":
            out["loads"] = list(self.loads)
        if self.assumption == "random":
            out["seed"] = self.seed
            if self.capacity is not None:
                out["capacity_factor"] = self.capacity
        return out

    def choose(self, rows: int, candidates: int, k: int, where: str) -> torch.Tensor:
        """The indices a choice of ``k`` of ``candidates`` for each of ``rows`` rows returns.

        Args:
            rows: The rows choosing (tokens).
            candidates: The experts each row chooses among.
            k: The experts each row picks (distinct).
            where: The module the choice runs in: names it in errors, and seeds random routing.

        Returns:
            An int64 tensor ``[rows, k]``, each row's experts distinct.
        """
        if self.assumption == "random":
            return self._random(rows, candidates, k, where)
        if self.assumption == "balanced":
            weights = [1.0] * candidates
        else:
            if len(self.loads) != candidates:
                raise ValueError(
                    f"ferry.trace: routing {self.spec!r}: {len(self.loads)} loads, but the "
                    f"router at {where or 'the model'} chooses among {candidates} experts"
                )
            weights = list(self.loads)
        counts = _counts(weights, rows, k)
        # Experts in order, each repeated its count, laid down the slots column by column: an
        # expert's run of at most `rows` positions never meets one row twice.
        order = torch.repeat_interleave(torch.arange(candidates), torch.tensor(counts))
        return order.reshape(k, rows).t().contiguous()

    def _random(self, rows, candidates, k, where):
        key = f"{self.seed}:{where}:{rows}x{candidates}:{k}"
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        picks = torch.rand(rows, candidates, generator=generator).argsort(dim=-1)[:, :k]
        if self.capacity is None:
            return picks
        cap = math.ceil(self.capacity * rows * k / candidates)
        counts = torch.bincount(picks.reshape(-1), minlength=candidates).tolist()
        if max(counts) <= cap:
            return picks
        # Each expert's rows cut to the capacity; what is cut goes to the least loaded experts
        # (the lowest index of a tie), and the experts' rows are dealt to the rows in a seeded
        # random order, each row its k distinct experts.
        excess = sum(max(c - cap, 0) for c in counts)
        counts = [min(c, cap) for c in counts]
        for _ in range(excess):
            e = min(
                (x for x in range(candidates) if counts[x] < min(cap, rows)),
                key=lambda x: (counts[x], x),
            )
            counts[e] += 1
        order = torch.repeat_interleave(torch.arange(candidates), torch.tensor(counts))
        dealt = order.reshape(k, rows).t()
        out = torch.empty_like(dealt)
        out[torch.randperm(rows, generator=generator)] = dealt
        return out


def _parse(spec):
    name, _, rest = spec.partition("=") if spec.startswith("loads") else spec.partition(",")
    name = name.strip()
    where = f"ferry.trace: routing {spec!r}"
    if name not in _ASSUMPTIONS:
        raise ValueError(
            f"{where}: unknown assumption {name!r} (expected balanced, loads=W0,W1,... or "
            "random[,seed=S][,capacity=C])"
        )
    if name == "balanced":
        if rest:
            raise ValueError(f"{where}: balanced takes no options")
        return name, None, None, None
    if name == "loads":
        try:
            loads = [float(w) for w in rest.split(",")]
        except ValueError:
            raise ValueError(f"{where}: loads must be numbers, comma-separated") from None
        if not all(math.isfinite(w) and w >= 0 for w in loads) or not any(loads):
            raise ValueError(f"{where}: loads must be finite, non-negative and not all zero")
        return name, tuple(int(w) if w.is_integer() else w for w in loads), None, None
    seed, capacity = 0, None
    for option in filter(None, (o.strip() for o in rest.split(","))):
        key, _, value = option.partition("=")
        if key == "seed":
            seed = _number(value, int, lambda x: 0 <= x < 1 << 63)
            if seed is None:
                raise ValueError(
                    f"{where}: seed must be an integer from 0 to 2^63 - 1, got {value!r}"
                )
        elif key == "capacity":
            capacity = _number(value, float, lambda x: math.isfinite(x) and x >= 1)
            if capacity is None:
                raise ValueError(f"{where}: capacity must be a number >= 1, got {value!r}")
        else:
            raise ValueError(f"{where}: unknown option {key!r} (seed, capacity)")
    return name, None, seed, capacity


def _number(text, kind, ok):
    """``text`` as a ``kind`` for which ``ok`` holds, else None."""
    try:
        value = kind(text)
    except ValueError:
        return None
    return value if ok(value) else None


def _counts(weights, rows, k):
    """Rows per expert: ``rows * k`` in proportion to ``weights`` (the rounding's remainder to
    the largest fractions, the lowest index first), none above ``rows`` (an expert appears once
    in a row): what is above goes to the heaviest experts with room, each filled in turn."""
    total = rows * k
    if k > len(weights):
        raise ValueError(f"ferry.trace: a router picks {k} of {len(weights)} experts")
    scale = sum(weights)
    exact = [total * w / scale for w in weights]
    counts = [math.floor(x) for x in exact]
    by_fraction = sorted(range(len(weights)), key=lambda e: (counts[e] - exact[e], e))
    for e in by_fraction[: total - sum(counts)]:
        counts[e] += 1
    excess = sum(max(c - rows, 0) for c in counts)
    counts = [min(c, rows) for c in counts]
    for e in sorted(range(len(weights)), key=lambda e: (-weights[e], e)):
        moved = min(excess, rows - counts[e])
        counts[e] += moved
        excess -= moved
    return counts


def _fake_types():
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


_DATA_DEPENDENT = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_UNINITIALIZED = frozenset(
    "empty empty_like empty_strided new_empty new_empty_strided empty_permuted".split()
)


def _packet_name(func):
    packet = getattr(func, "_overloadpacket", None)
    return packet.__name__ if packet is not None else ""


class Values:
    """The values a trace knows beside its fake tensors (Note [Routing as a stated
    assumption]): real CPU tensors for the fake ones computed from known values only."""

    def __init__(self, fake_mode: Any, routing: Routing) -> None:
        self.fake_mode = fake_mode
        self.routing = routing
        self.known: dict[int, tuple[torch.Tensor, torch.Tensor, bool]] = {}  # in insertion order
        self.known_bytes = 0
        self.decided = False  # a routing choice's values shaped the trace
        self.fake_type = _fake_types()

    def _value(self, t):
        """(real value, routed) of ``t``, or None where the trace does not know it."""
        if not isinstance(t, self.fake_type):
            if t.device.type == "meta" or _bytes(t) > MAX_OTHER_BYTES:
                return None
            # A real tensor the model holds: its own value, copied (an op run on known values
            # may write in place, and must not write the model's tensor).
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes(), torch.no_grad():
                return t.detach().clone(), False
        entry = self.known.get(id(t))
        if entry is None or entry[0] is not t:
            return None
        return entry[1], entry[2]

    def _real_args(self, args, kwargs):
        """The call's arguments with known values for fake tensors and whether a routing
        choice is among them; None where one is unknown."""
        flat, spec = tree_flatten((args, kwargs))
        routed = False
        real = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                value = self._value(x)
                if value is None:
                    return None
                real.append(value[0])
                routed |= value[1]
            else:
                real.append(x)
        return tree_unflatten(real, spec), routed

    def _remember(self, out, real_out, routed):
        flat, _ = tree_flatten(out)
        real, _ = tree_flatten(real_out)
        for t, r in zip(flat, real):
            if isinstance(t, self.fake_type) and isinstance(r, torch.Tensor):
                self._drop(id(t))
                self.known[id(t)] = (t, r, routed)
                self.known_bytes += _bytes(r)
        while self.known_bytes > KNOWN_BUDGET:
            self._drop(next(iter(self.known)))

    def _drop(self, key):
        entry = self.known.pop(key, None)
        if entry is not None:
            self.known_bytes -= _bytes(entry[1])

    def _forget_written(self, func, args, kwargs):
        named = _named(func, args, kwargs)
        for argument in func._schema.arguments:
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            for t in tree_flatten(named.get(argument.name))[0]:
                if isinstance(t, torch.Tensor):
                    key = t.untyped_storage()._cdata
                    stale = [
                        i for i, e in self.known.items() if e[0].untyped_storage()._cdata == key
                    ]
                    for i in stale:
                        self._drop(i)

    def run(self, func: Any, args: tuple, kwargs: dict, where: str) -> Any:
        """Runs ``func`` on the fake arguments, and on the known values where it can (see the
        Note); returns the fake result."""
        from torch.utils._python_dispatch import _disable_current_modes

        tags = getattr(func, "tags", ())
        name = _packet_name(func)
        known = self._real_args(args, kwargs)
        size_ok = known is not None and _bytes(known[0]) <= MAX_KNOWN_BYTES
        if any(tag in tags for tag in _DATA_DEPENDENT):
            # The fake kernel answers where it can (an integer index has a shape of its own).
            from torch._subclasses.fake_tensor import (
                DataDependentOutputException,
                DynamicOutputShapeException,
            )

            try:
                out = func(*args, **kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException):
                return self._from_values(func, known if size_ok else None, where)
            self._follow(func, args, kwargs, out, known if size_ok else None)
            return out
        out = grouped_mm_any_dtype(func, args, kwargs)
        if out is None:
            out = func(*args, **kwargs)
        if name == "topk" and known is None:
            # A router's choice among scores the trace cannot see: the assumption's.
            named = _named(func, args, kwargs)
            indices = out[1]
            if indices.numel():
                dim = named.get("dim", -1) % max(indices.dim(), 1)
                k, candidates = indices.shape[dim], named["self"].shape[dim]
                rows = indices.numel() // k
                shape = [n for i, n in enumerate(indices.shape) if i != dim] + [k]
                with _disable_current_modes():
                    chosen = self.routing.choose(rows, candidates, k, where)
                    value = chosen.reshape(shape).movedim(-1, dim).contiguous()
                self._remember(indices, value, True)
            return out
        self._follow(func, args, kwargs, out, known if size_ok else None)
        return out

    def group_rows(self, func: Any, args: tuple, kwargs: dict) -> list[int] | None:
        """Each group's rows of a grouped matmul that splits its rows (2-D rows against 3-D
        weights) by offsets that follow a routing choice: the rows the router gave each
        expert. None for any other call, or where the offsets are not known."""
        if _packet_name(func) not in _GROUPED:
            return None
        named = _named(func, args, kwargs)
        offs, rows, weights = named.get("offs"), named.get("self"), named.get("mat2")
        if not all(isinstance(t, torch.Tensor) for t in (offs, rows, weights)):
            return None
        if rows.dim() != 2 or weights.dim() != 3:
            return None
        value = self._value(offs)
        if value is None or not value[1]:
            return None
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            ends = [int(n) for n in value[0].tolist()]
        self.decided = True
        return [end - start for start, end in zip([0, *ends[:-1]], ends)]

    def _from_values(self, func, known, where):
        """The fake result of a call whose result is data, made from the known values."""
        from torch.utils._python_dispatch import _disable_current_modes

        if known is None:
            raise RuntimeError(
                f"ferry.trace: {func} at {where or 'the model'} needs the values of a tensor, "
                "and a fake trace has its shape only; the trace knows the values that follow "
                "from a router's topk under the routing assumption (routing=, docs/trace.md), "
                "and this one does not follow from it"
            )
        (real_args, real_kwargs), routed = known
        with _disable_current_modes():
            real_out = func(*real_args, **real_kwargs)
        self.decided |= routed
        out = tree_map(
            lambda x: self.fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x,
            real_out,
        )
        self._remember(out, real_out, routed)
        return out

    def _follow(self, func, args, kwargs, out, known):
        """Computes the values of ``out`` where they follow from known ones, else forgets the
        values of what the call wrote."""
        from torch.utils._python_dispatch import _disable_current_modes

        tags = getattr(func, "tags", ())
        if (
            known is not None
            and _bytes(out) <= (MAX_KNOWN_BYTES if known[1] else MAX_OTHER_BYTES)
            and _packet_name(func) not in _UNINITIALIZED
            and torch.Tag.nondeterministic_seeded not in tags
        ):
            (real_args, real_kwargs), routed = known
            with _disable_current_modes():
                real_out = func(*real_args, **real_kwargs)
            self._remember(out, real_out, routed)
        elif writes(func):
            self._forget_written(func, args, kwargs)


def _named(func, args, kwargs):
    """The call's arguments by their names in the operator's schema."""
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    return named


def _bytes(tree):
    return sum(
        t.numel() * t.element_size() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)
    )


# Note [Grouped matmuls in any dtype]
# The CPU kernel of `_grouped_mm` runs float32 (torch 2.11; transformers calls it for a float32
# model's experts), but its meta kernel, which a fake run calls, checks for bf16 operands. Its
# output shape does not depend on the dtype, so the trace runs the fake kernel on bf16
# stand-ins of the operands and returns a fake tensor of that shape in the dtype the call
# produces: the operands' (or `out_dtype`).


def grouped_mm_any_dtype(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The fake result of a ``_grouped_mm`` call on operands that are not bf16; None for any
    other call (Note [Grouped matmuls in any dtype])."""
    if _packet_name(func) != "_grouped_mm":
        return None
    named = _named(func, args, kwargs)
    a, b = named.get("self"), named.get("mat2")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return None
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return None
    dtype = named.get("out_dtype") or a.dtype
    rest = {key: named[key] for key in ("offs", "bias") if named.get(key) is not None}
    if "bias" in rest:
        rest["bias"] = rest["bias"].to(torch.bfloat16)
    shaped = func(a.to(torch.bfloat16), b.to(torch.bfloat16), **rest)
    return torch.empty_strided(shaped.shape, shaped.stride(), dtype=dtype, device=shaped.device)
