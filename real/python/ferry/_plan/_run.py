"""``PlanRun``: what ``ferry.offload(plan=...)`` does around each forward. It names the real ops
as the trace did and matches them to the plan's (Note [Naming the real ops]), keeps or offloads
each saved tensor by its op's decision (Note [Which op is saving]), and checkpoints each region's
call with a selective policy per op (``_RegionPolicy``)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.utils.checkpoint as _tc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import _C
from .._checkpoint import checkpoint, runtime_call
from .._modules import head_path
from .._names import CUT_COLLECTIVES, OpNames, base_of, cut_collective, is_named, op_path, writes
from .._regions import no_offload
from ._cache import copy_cache, is_cache, replay_cache
from ._format import LOSS_OP, PlanError, fail, load_plan
from ._layout import called_module, regions_of, under

_POLICY = {
    "keep": _tc.CheckpointPolicy.MUST_SAVE,
    "offload": _tc.CheckpointPolicy.MUST_CPU_OFFLOAD,
    "recompute": _tc.CheckpointPolicy.PREFER_RECOMPUTE,
}


# Note [Naming the real ops]
# A trace names each aten op forward runs `<module path>/<op>`, with `#k` for the k-th repeat in
# one module, counting every op that returns a tensor or writes one (docs/trace.md), and leaves
# out of its document the ops that produce, save and cost nothing. The real forward is named the
# same way, by the same code (`ferry/_names.py`): forward hooks on every module keep the module
# path, a dispatch mode counts the ops.
# The plan's ops are then a subsequence of the real ones, in the same order. The real forward
# may also run ops the trace did not: code that branches on values takes another path on the
# trace's fake tensors (Hugging Face's mask preparation checks whether a mask is all ones for
# real, and skips the check under a trace), which shifts the `#k` of later ops in that module.
# So a real op is matched by its name without `#k` to the next plan op not yet met; one that
# does not match is an op the plan lacks, allowed as long as it saves nothing for backward.
# The trace may also run ops the real forward does not, on the same grounds: Hugging Face's
# check for packed sequences cannot read the trace's position ids either, so the trace builds
# a causal mask and attention expands K and V for it, where the real forward runs SDPA causal.
# The ops after such a branch have their own names again (`self_attn/view#3` follows SDPA in
# both), so a real op whose full name, `#k` included, is a later plan op of the same module,
# with only ops of that module between, is that op: the plan ops between did not run. Plan
# ops of a region that its call did not run are skipped alike when the call ends.
#
# Note [Kept outputs written in place]
# Selective checkpointing hands a kept (or offloaded) output back to the replay as forward
# stored it, and refuses one that changed since ("Tensor cached during selective activation
# checkpoint has been mutated"). Forward may write such an output later in the region: the
# CPU's dropout fills `empty_like`'s output with `bernoulli_` and scales it with `div_`. So
# when an op is about to write an output of an earlier op of the call, the outputs kept or
# offloaded that share its storage leave the checkpoint's storage and are recomputed, and so
# is the writing op: handing back its stored output would skip the write on the replay's
# tensor, which the code after it reads (dropout multiplies by its noise tensor, not by what
# `div_` returned). An op writing what the call did not make (a batch norm's running
# statistics) keeps the plan's decision: kept, the replay does not write it a second time.
#
# Note [Kept tensors hold no graph]
# What a pack hook returns is held by the autograd node that saved the tensor, and torch's
# unpack rebuilds the tensor from what the unpack hook returns, with the node's grad_fn for an
# output. An op that saves its own output would, if the hook kept that output as it is, make
# a cycle through the autograd graph (output -> grad_fn -> saved value -> output) that Python's
# collector cannot see: a forward whose graph is dropped without backward would never be freed,
# nor the checkpoint states and offloaded tensors reachable from it. So a kept tensor is held
# as `detach()` gives it, which shares its storage and version counter (the version check still
# sees in-place changes) and holds no graph, as ferry's own KeptAsIs does in C++.
#
# Note [Which op is saving]
# Autograd saves an op's inputs in the op's autograd kernel before the op reaches the dispatch
# mode, and its outputs after; the node being filled is the last one created on the thread
# (sequence number minus one). If that node was created before the last op the mode saw ran, the
# tensor is that op's output (or a custom Function's, saved after its forward's ops ran); if
# after, the op saving it has not reached the mode yet. Such a tensor is held as it is until the
# op arrives, matched to the plan, and then kept or packed by the session: no node is created in
# between, so the session names the same node as at the save.
#
# Note [A plan for a rank's cut]
# A plan made under `--tp N` is for one rank's cut of the model (docs/parallelism.md, "A rank's
# model"): the whole model's ops, each named as the trace of the whole model names it, and the
# collectives the cut inserts, each named after the op it was inserted for
# (`model.layers.0.self_attn.q_proj/mm/tp.all_gather`, `.../o_proj/mm/tp.reduce_scatter`).
# After `parallelize_module` a rank runs the same modules; the dispatch mode sees each op on
# DTensors once, as the op of the whole model (`q_proj/mm` on the sharded weight), and the
# ops on local tensors where a style hands them out (`use_local_output`). So the model's ops
# are matched by name as without parallelism, and their decisions apply to the DTensors autograd
# saves (an offload copies each one's local shard). DTensor's redistributions run in the
# styles' hooks, as `_c10d_functional` ops: the all-gather before the colwise projections, the
# reduce-scatter after a rowwise one under sequence parallelism. Each is matched, by the op that
# issues it, to the cut's next collective of that kind not yet met, before the next region
# boundary (inside the region whose call runs): a hook runs before the ops of its module that
# the cut placed ahead of the collective (a view of the projection's input), so collectives are
# met out of order and leave the cursor where it is. A region's recomputation then keeps or
# re-issues the collective as the plan decided it. The cut's collectives a rank does not issue
# (without sequence parallelism a rowwise output is all-reduced, and nothing is gathered before
# the next projection) are skipped, and a collective the cut lacks (that all-reduce) is an op
# the plan lacks, which saves nothing. A collective a region offloads is kept instead: the
# selective checkpoint stores an op's output when the op returns, and a `_c10d_functional`
# collective returns before its `wait_tensor`, so a copy would race the exchange still writing
# it; kept, the recomputation reads it after forward's wait.


class _OpNamer(TorchDispatchMode):
    def __init__(self, run):
        super().__init__()
        self._run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch._C._current_autograd_node() is None:  # forward only, not a replay in backward
            flat = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            if is_named(func, flat):
                self._run.on_op(func, flat)
        return out


def _collective_kind(func):
    """The ``_c10d_functional`` op ``func`` is, where it issues a collective a rank's cut
    inserts (``all_gather_into_tensor``, ...); else None."""
    if getattr(func, "namespace", None) != "_c10d_functional":
        return None
    name = func._overloadpacket.__name__
    return name if name in CUT_COLLECTIVES.values() else None


def _returns_tensor(func):
    return any("Tensor" in str(ret.type) for ret in func._schema.returns)


class _Saved:
    """What the pack hook returns: the tensor kept as it is, or what the session packed. Until
    the op saving it is decided it holds the tensor itself; kept, a detached alias (Note [Kept
    tensors hold no graph])."""

    __slots__ = ("tensor", "packed")

    def __init__(self, tensor):
        self.tensor = tensor
        self.packed = None

    def keep(self):
        """Holds the tensor as a detached alias: its storage and version counter, no grad_fn."""
        if self.tensor is not None:
            self.tensor = runtime_call(torch.Tensor.detach, self.tensor)


class _RegionPolicy:
    """The selective checkpoint policy of one region's call. Forward decides by the op's name;
    the recomputation repeats forward's decisions call by call (Note [Naming the real ops]:
    names are counted in forward only). An op that writes an output of an earlier op of the
    call is recomputed, and so is that output where it was kept or offloaded (Note [Kept
    outputs written in place])."""

    def __init__(self, run, region):
        self._run = run
        self._region = region
        self.forward = []  # [func, policy, plan op index or None, storages of its outputs]
        self.cursor = 0
        self.storage = None  # the selective checkpoint's outputs by op, during forward

    def contexts(self):
        """The selective checkpoint's contexts, whose storage this policy edits."""
        forward, recompute = _tc.create_selective_checkpoint_contexts(self)
        self.storage = forward.storage
        return forward, recompute

    def __call__(self, ctx, func, *args, **kwargs):
        if not ctx.is_recompute:
            index = self._run.peek(func) if _returns_tensor(func) else None
            choice = _tc.CheckpointPolicy.PREFER_RECOMPUTE
            writing = isinstance(func, torch._ops.OpOverload) and writes(func)
            if writing and self._unsave(func, args, kwargs):
                pass  # it writes what this call made: recomputed
            elif index is not None and self._region.first <= index < self._region.end:
                choice = _POLICY[self._run.ops[index]["saved"]]
                offloaded = choice == _POLICY["offload"]
                if offloaded and self._run.is_collective(index) and self._run.waits_collectives:
                    # Its output is copied out when the collective returns, before the wait
                    # (Note [A plan for a rank's cut]): kept instead.
                    choice = _POLICY["keep"]
            self.forward.append([func, choice, index, None])
            return choice
        k = self.cursor
        self.cursor += 1
        if k >= len(self.forward) or self.forward[k][0] is not func:
            ran = self.forward[k][0] if k < len(self.forward) else "nothing"
            raise RuntimeError(
                f"ferry.offload(plan=...): the recomputation of regions[{self._region.index}] "
                f"(module {self._region.path!r}) ran {func} as its call {k}, where forward ran "
                f"{ran}"
            )
        _, choice, index, _ = self.forward[k]
        if index is not None and choice == _tc.CheckpointPolicy.PREFER_RECOMPUTE:
            self._run.recomputed[index] = self._run.recomputed.get(index, 0) + 1
        return choice

    def outputs(self, func, tensors):
        """The op this policy decided last ran and returned ``tensors``."""
        if self.forward and self.forward[-1][0] is func:
            self.forward[-1][3] = {_storage_of(t) for t in tensors}

    def _unsave(self, func, args, kwargs):
        """``func`` is about to write its arguments. Whether it writes an output of an earlier
        op of this call; the outputs kept or offloaded that it writes are dropped from the
        checkpoint's storage and recomputed."""
        schema = func._schema.arguments
        values = list(args) + [kwargs.get(a.name) for a in schema[len(args) :]]
        written = {
            _storage_of(v)
            for a, v in zip(schema, values)
            if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor)
        } - {None}
        made_here = False
        stored = {}  # per op, how many of its entries come before
        for record in self.forward:
            op, choice, _, storages = record
            hit = bool(storages and storages & written)
            made_here |= hit
            if choice == _tc.CheckpointPolicy.PREFER_RECOMPUTE:
                continue
            position = stored.get(op, 0)
            if hit:
                del self.storage[op][position]
                record[1] = _tc.CheckpointPolicy.PREFER_RECOMPUTE
            else:
                stored[op] = position + 1
        return made_here


def _storage_of(t):
    """What identifies ``t``'s storage (None for a tensor without one of its own)."""
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return None


class PlanRun:
    """What ``ferry.offload(plan=...)`` does around each forward: names the real ops, matches
    them to the plan, decides each saved tensor, and checkpoints the plan's regions."""

    def __init__(self, plan, session_region, model=None):
        self.plan = load_plan(plan)
        self.ops = self.plan["ops"]
        self._index = {}
        for i, op in enumerate(self.ops):
            if op["name"] in self._index:
                fail(f"ops[{i}].name", f"{op['name']!r} is also ops[{self._index[op['name']]}]")
            self._index[op["name"]] = i
        # Note [A plan for a rank's cut]: the collectives the cut inserted, by the op that
        # issues each on a rank; they have no base name a real op of the model could match.
        self._collective = [cut_collective(op["name"]) for op in self.ops]
        self._collective = [c[1] if c is not None else None for c in self._collective]
        self._bases = [
            base_of(op["name"]) if c is None else None for op, c in zip(self.ops, self._collective)
        ]
        self._paths_of = [op_path(op["name"]) for op in self.ops]
        self.regions = regions_of(self.plan)
        self._region_of = {}
        for region in self.regions:
            for i in range(region.first, region.end):
                self._region_of[i] = region
        self._session_region = session_region
        # False only where ferry.testing plants the fault of offloading a collective's output
        # before its wait.
        faults = getattr(session_region, "_plan_faults", ())
        self.waits_collectives = "offload_collectives_early" not in faults
        self._model = model
        self._exit_stack = None
        self._root = None
        self._head = None
        self._reset()

    def _reset(self):
        self.saved = {}  # plan op index -> ids of the distinct tensors it saved (this forward)
        self.recomputed = {}  # plan op index -> times it was re-run in backward
        self._policies = []
        self._paths = []
        self._names = OpNames()
        self._cursor = 0
        self._met = set()  # the cut's collectives matched to a rank's (this forward)
        self._last = None  # plan index of the last op met (None: an op the plan lacks)
        self._last_name = None
        self._last_base = None
        self._last_seq = -1
        self._active = None
        self._deferred = []

    # Entering and leaving ------------------------------------------------------------------

    def enter(self):
        self._reset()
        stack = contextlib.ExitStack()
        try:
            if self._model is not None:
                self._attach(stack, self._model)
            else:
                # The first module called inside is the model: its paths name the ops.
                def first_call(module, args):
                    if self._root is None:
                        self._root = module
                        self._attach(stack, module)
                        self._paths.append("")  # its own pre-hook comes from the next call

                self._root = None
                stack.callback(
                    torch.nn.modules.module.register_module_forward_pre_hook(first_call).remove
                )
            stack.enter_context(_OpNamer(self))
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack

    def active(self):
        return self._exit_stack is not None

    def exit(self, failed):
        stack, self._exit_stack = self._exit_stack, None
        stack.close()
        # Tensors saved by an op that never reached the dispatch mode stay kept, as detached
        # aliases (Note [Kept tensors hold no graph]).
        deferred, self._deferred = self._deferred, []
        for saved in deferred:
            saved.keep()
        if failed:
            return
        remaining = [
            i
            for i in range(self._cursor, len(self.ops))
            if not (i == len(self.ops) - 1 and self.ops[i]["name"] == LOSS_OP)
            and self._collective[i] is None
        ]
        if self._cursor > 0 and remaining:
            i = remaining[0]
            raise PlanError(
                f"ferry.offload(plan=...): the forward ended before op {self.ops[i]['name']!r} "
                f"(ops[{i}]) of the plan ran ({self._cursor} of {len(self.ops)} ops met); run "
                "the whole step the plan was made for inside the region, the loss included"
            )

    def _attach(self, stack, root):
        head = head_path(root)
        self._head = head
        for p in list(root.parameters()) + list(root.buffers()):
            self._session_region._session.exclude(p)
        modules = dict(root.named_modules())
        for path, module in modules.items():
            stack.callback(
                module.register_forward_pre_hook(functools.partial(self._pre, path)).remove
            )
            stack.callback(module.register_forward_hook(self._post, always_call=True).remove)
        for region in self.regions:
            region.path = called_module(self.ops, modules, region)
            module = modules.get(region.path)
            if module is None:
                fail(
                    f"regions[{region.index}]",
                    f"the model has no module {region.path!r} (ops[{region.first}] is "
                    f"{self.ops[region.first]['name']!r}); the plan was made for another model",
                )
            self._wrap(stack, module, region)

    def _pre(self, path, module, args):
        self._paths.append(path)

    def _post(self, module, args, output):
        if self._paths:
            self._paths.pop()

    # Naming and matching (Note [Naming the real ops]) ---------------------------------------

    def _name(self, func):
        path = self._paths[-1] if self._paths else ""
        return self._names.next(path, func)

    def _match(self, base, name, ahead=False):
        """The plan index the op of this base name is: the next plan op not yet met (past the
        cut's collectives, Note [A plan for a rank's cut]); else the plan op of its full name
        when only ops of its module lie between; else, with ``ahead`` (the op saves tensors,
        so the plan must have it), a later one of the same base name before the next region
        boundary. The plan ops skipped did not run for real (Note [Naming the real ops]).
        None: an op the plan lacks."""
        cursor = self._cursor
        while cursor < len(self.ops) and self._collective[cursor] is not None:
            cursor += 1
        if cursor < len(self.ops) and self._bases[cursor] == base:
            return cursor
        region = self._region_of.get(self._cursor)
        if region is not None:
            limit = region.end
        else:
            later = [r.first for r in self.regions if r.first >= self._cursor]
            limit = min(later, default=len(self.ops))
        k = self._index.get(name)
        if k is not None and cursor < k < limit:
            path = base.rpartition("/")[0]
            if all(
                self._paths_of[i] == path or self._collective[i] is not None
                for i in range(cursor, k)
            ):
                return k
        if not ahead:
            return None
        for k in range(cursor, limit):
            if self._bases[k] == base:
                return k
        return None

    def _match_collective(self, kind):
        """The plan index of the cut's next collective of ``kind`` not yet met, in the region
        whose call runs (before the next region outside one): the collective DTensor issues
        is that one (Note [A plan for a rank's cut]). None: the plan has none there."""
        if self._active is not None:
            limit = self._active.end
        else:
            later = [r.first for r in self.regions if r.first >= self._cursor]
            limit = min(later, default=len(self.ops))
        for k in range(self._cursor, limit):
            if self._collective[k] == kind and k not in self._met:
                return k
        return None

    def is_collective(self, index):
        """Whether plan op ``index`` is a collective the rank's cut inserted."""
        return self._collective[index] is not None

    def _match_func(self, func, base, name, ahead=False):
        """The plan index of the op ``func`` of this base name and name."""
        kind = _collective_kind(func)
        if kind is not None:
            return self._match_collective(kind)
        return self._match(base, name, ahead)

    def peek(self, func):
        """The plan index of the op ``func`` is about to be (None: the plan lacks it)."""
        return self._match_func(func, *self._name(func))

    def on_op(self, func, outputs=()):
        if self._active is not None and self._policies:
            self._policies[-1].outputs(func, outputs)
        base, name = self._name(func)
        self._names.count(base)
        deferred, self._deferred = self._deferred, []
        index = self._match_func(func, base, name, ahead=bool(deferred))
        if deferred and index is None:
            at = (
                f"ops[{self._cursor}] ({self.ops[self._cursor]['name']!r})"
                if self._cursor < len(self.ops)
                else "past its last op"
            )
            raise PlanError(
                f"ferry.offload(plan=...): the model ran {name!r}, which saves tensors for "
                f"backward, where the plan is at {at} and has no op of that name before its next "
                "region boundary; the plan was made for another model or other inputs"
            )
        self._meet(index, name)
        for saved in deferred:
            self._decide(saved, index)
        self._last = index
        self._last_base = base
        self._last_name = name
        self._last_seq = torch._C._autograd._get_sequence_nr()

    def _meet(self, index, name):
        """Op ``index`` of the plan ran, as ``name``."""
        if index is not None:
            region = self._region_of.get(index)
            if region is not self._active:
                want = (
                    f"inside regions[{region.index}] (the call of {region.path!r})"
                    if region is not None
                    else "outside every region"
                )
                raise PlanError(
                    f"ferry.offload(plan=...): op {name!r} (ops[{index}]) ran "
                    f"{'outside' if region is not None else 'inside'} the checkpointed call it "
                    f"belongs to: the plan has it {want}"
                )
            if self._collective[index] is not None:
                self._met.add(index)  # met out of order: the cursor stays
            else:
                self._cursor = index + 1

    # Saved tensors (Note [Which op is saving]) ---------------------------------------------

    def pack(self, t):
        if t.numel() == 0:
            return runtime_call(torch.Tensor.detach, t)  # Note [Kept tensors hold no graph]
        node = torch._C._autograd._get_sequence_nr() - 1
        if self._last_seq <= node:
            # Saved by the op about to reach the dispatch mode: decided when it does (the
            # session then still names the same node, the last one created).
            saved = _Saved(t)
            self._deferred.append(saved)
            return saved
        if self._last is None:
            # An op that saves only its outputs, not matched when it ran: the plan has it later.
            self._last = self._match(self._last_base, self._last_name, ahead=True)
            self._meet(self._last, self._last_name)
        if self._last is None:
            raise PlanError(
                f"ferry.offload(plan=...): op {self._last_name!r} saved a tensor for backward, "
                "but the plan has no op of that name here; the plan was made for another model "
                "or other inputs"
            )
        return self._decide(_Saved(t), self._last)

    def _decide(self, saved, owner):
        self.saved.setdefault(owner, set()).add(id(saved.tensor))
        if self._offloads(owner):
            saved.packed = runtime_call(_C._pack, saved.tensor)
            saved.tensor = None
        else:
            saved.keep()
        return saved

    def _offloads(self, index):
        """Whether op ``index``'s saved tensors go to the session: the plan offloads them and
        the op is not in the output head (which the offloader keeps, as the simulator does)."""
        head = self._head is not None and under(self._paths_of[index], self._head)
        return self.ops[index]["saved"] == "offload" and not head

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.packed is None:
            return saved.tensor
        return _C._unpack(saved.packed)

    # Regions ---------------------------------------------------------------------------------

    def _wrap(self, stack, module, region):
        forward = module.forward
        had_own = "forward" in module.__dict__

        def checkpointed(*args, **kwargs):
            if self._active is not None or self._cursor > region.first:
                at = (
                    self.ops[self._cursor]["name"]
                    if self._cursor < len(self.ops)
                    else "the end of the plan"
                )
                raise PlanError(
                    f"ferry.offload(plan=...): module {region.path!r} (regions[{region.index}]) "
                    f"was called where the plan is at ops[{self._cursor}] ({at!r}), not at its "
                    f"first op ops[{region.first}]"
                )
            self._cursor = region.first  # plan ops before it that did not run saved nothing
            policy = _RegionPolicy(self, region)
            self._policies.append(policy)
            calls = [0]
            caches = []  # (the cache argument, a copy of it as the call found it)

            def run(*a, **k):
                if calls[0] == 0:
                    # Note [A cache written in a region]
                    caches.extend(
                        (v, copy_cache(v)) for v in list(a) + list(k.values()) if is_cache(v)
                    )
                else:  # a recomputation
                    policy.cursor = 0
                    if caches:
                        a = [replay_cache(v, caches) for v in a]
                        k = {key: replay_cache(v, caches) for key, v in k.items()}
                calls[0] += 1
                return forward(*a, **k)

            keep = no_offload() if region.inputs == "keep" else contextlib.nullcontext()
            context = policy.contexts
            self._active = region
            try:
                with keep:
                    out = checkpoint(
                        run,
                        *args,
                        use_reentrant=False,
                        context_fn=context,
                        offload=self._session_region,
                        **kwargs,
                    )
            finally:
                self._active = None
                policy.storage = None  # the checkpoint's own, freed with it after backward
            if self._cursor == region.first:
                raise PlanError(
                    f"ferry.offload(plan=...): the call of {region.path!r} (regions"
                    f"[{region.index}]) ran none of the plan's ops {region.first}..{region.end - 1}"
                    f" (the first: {self.ops[region.first]['name']!r}); the plan was made for "
                    "another model or other inputs"
                )
            # Its plan ops the call did not run are a branch the real forward did not take
            # (Note [Naming the real ops]).
            self._cursor = region.end
            return out

        module.forward = checkpointed

        def restore():
            if had_own:
                module.forward = forward
            else:
                del module.forward

        stack.callback(restore)

    # Counts ----------------------------------------------------------------------------------

    def counts(self):
        """What the last forward (and its backward so far) did, by the plan's decision: the
        distinct tensors saved by ops outside regions that were kept and offloaded, the region
        ops whose outputs were saved, offloaded and recomputed (each op once), the ops re-run
        in backward, and for a plan made under ``--tp`` the cut's collectives the rank issued."""
        out = {
            "kept": 0,
            "offloaded": 0,
            "saved_outputs": 0,
            "offloaded_outputs": 0,
            "recomputed": 0,
        }
        for index, ids in self.saved.items():
            out["offloaded" if self._offloads(index) else "kept"] += len(ids)
        seen = set()
        for policy in self._policies:
            for _, choice, index, _ in policy.forward:
                if index is None or index in seen:
                    continue
                seen.add(index)
                if choice == _POLICY["keep"]:
                    out["saved_outputs"] += 1
                elif choice == _POLICY["offload"]:
                    out["offloaded_outputs"] += 1
        out["recomputed"] = len(self.recomputed)
        if any(c is not None for c in self._collective):
            out["collectives"] = len(self._met)
        return out
