"""The two edges of the simulator take the same options: `ferry.simulate / compare / plan(...)`
in this process and `ferry simulate / compare / plan ... --json` refuse the same values with the
same message (Python's ValueError or PlanError is the text the CLI prints after "error: ",
exit 2), and accept the same values with equal documents (Note [One check for both edges] in
sim/include/ferry/sim/api/requests.hpp).

The property draws each numeric option in and out of its bounds, and the text options from good
and bad values, from one seeded generator; a failure names the seed and the case. A number out
of its bounds must be refused by both, the message naming one that is out. Accepted runs are
kept cheap (a tiny model, one or two steps, no checker)."""

import json
import random
import re
import subprocess
import time

import pytest

import ferry
from ferry_cli import cli

MODEL = "tiny-llama"
DEVICE = "a100-pcie4"
SEED = 34

#: Python's name -> (the CLI's flag, lowest, highest): the bounds each edge must enforce.
RUN_BOUNDS = {
    "steps": ("--steps", 1, 1000),
    "stash": ("--stash", 1, 2**20),
    "min_bytes": ("--min-bytes", 0, 2**50),
    "window_mib": ("--window-mib", 0, 2**30),
    "prefetch_mib": ("--prefetch-mib", 0, 2**30),
    "host_cap_gib": ("--host-cap-gib", 0, 2**20),
}
FSDP_BOUNDS = {
    "fsdp": ("--fsdp", 1, 1_000_000),
    "nodes": ("--nodes", 1, 1_000_000),
    "hsdp": ("--hsdp", 1, 1_000_000),
}
#: Tensor and context parallelism's: drawn apart (TP_DRAWS, CP_DRAWS), mostly in bounds, as
#: most meshes refuse.
TP_BOUNDS = {"tp": ("--tp", 1, 1024), "cp": ("--cp", 1, 1024), "ep": ("--ep", 1, 1024)}
#: tp values: accepted (1, 2), out of bounds, and in bounds but refused by the model or the
#: device (3: not a divisor of a node's GPUs; 8: more than the model's heads).
TP_DRAWS = [1, 2, 2, 0, 1025, -1, 3, 8]
#: cp values: accepted with fsdp (1, 2, 4), out of bounds, and in bounds but refused (3: not a
#: divisor of the tokens; any without fsdp).
CP_DRAWS = [1, 2, 2, 4, 0, 1025, -1, 3]
#: ep values: in bounds but refused (a dense model: no experts to split; 1 is none), out of
#: bounds.
EP_DRAWS = [1, 2, 0, 1025]
PLAN_BOUNDS = {"steps": ("--steps", 1, 100), **FSDP_BOUNDS, **TP_BOUNDS}
#: The options Python takes as 32-bit integers: out-of-bounds draws stay parseable.
INT32 = {"steps", "stash", "fsdp", "nodes", "hsdp", "tp", "cp", "ep"}
#: Values kept small where a run is accepted, so that it is quick.
CHEAP = {"steps": 2, "fsdp": 16, "nodes": 16, "hsdp": 16}

TEXT = {
    "policy": ["none", "trl", "trl-seed", "trl-1.7", "ferry", "lifo", ""],
    "checkpoint": ["none", "every:1", "every:zero", "selective", "segments:2", "bogus"],
    "horizon": ["auto", "none", "1GiB", "0", "lots", "-1"],
}
RESHARD = [True, False, 2, 4, 1, 0, -3]
#: Mostly good names: a bad one refuses the run, and the draws must still reach "ok" often.
ALLOCATORS = ["default", "expandable", "expandable", "default", "expandable", "expandable_segments"]
#: Mostly good names, as ALLOCATORS.
FSDP_IMPLS = ["fsdp2", "simple", "simple", "fsdp2", "SimpleFSDP", "fsdp2-torch2.4"]
REDUCE_DTYPES = ["param", "float32", "float32", "float32", "bf16"]
BUDGETS = [None, "1GiB", "24MiB", " ", "40 parsecs", "-5", 2**30, "1KiB"]
#: Plan margins, percent of the budget: numbers and text, in bounds (0..50) and not.
MARGINS = [None, "6", "5.5%", 0, 12.5, 50, "50.1", 51, -1, "six", "5.55", " 7 % "]
SWITCHES = {"prefetch": "--no-prefetch", "dedup": "--no-dedup", "early_stop": "--no-early-stop"}
#: Choices left to a default by None, each value named by its flag (Python: True, False).
FLAGS = {"set_to_none": {True: "--set-to-none", False: "--keep-grads"}}


def draw_int(rng, name, lo, hi, inside):
    """An integer for option `name` within lo..hi or outside: often at or just past a bound,
    sometimes anywhere, or far past."""
    if inside:
        return rng.choice([lo, hi, rng.randint(lo, min(hi, lo + 8)), rng.randint(lo, hi)])
    top = 2**31 - 1 if name in INT32 else 2**62
    return rng.choice([lo - 1, hi + 1, rng.randint(-top, lo - 1), rng.randint(hi + 1, top)])


def out_of_bounds(options, bounds):
    """(flag, value) of each number in `options` that is outside its bounds."""
    return [
        (bounds[k][0], v)
        for k, v in options.items()
        if k in bounds and not bounds[k][1] <= v <= bounds[k][2]
    ]


def cheapened(options, bounds):
    """`options` with expensive in-bounds values made small when nothing is out of bounds (the
    run would be accepted and simulated)."""
    if out_of_bounds(options, bounds):
        return options
    return {
        k: min(v, CHEAP[k]) if k in CHEAP and isinstance(v, int) else v for k, v in options.items()
    }


def draw_numbers(rng, bounds, rate):
    """Some of the options in `bounds` (each with probability `rate`), all within their bounds
    in about 65 % of the cases, one or more outside in the others."""
    names = [k for k in bounds if rng.random() < rate]
    outside = set()
    if names and rng.random() < 0.35:
        outside = set(rng.sample(names, rng.randint(1, len(names))))
    return {k: draw_int(rng, k, bounds[k][1], bounds[k][2], k not in outside) for k in names}


def draw_fsdp(rng, options):
    if rng.random() < 0.3:
        options["reshard_after_forward"] = rng.choice(RESHARD)
    # Mostly with fsdp: without it, any but the default is refused.
    if rng.random() < (0.4 if "fsdp" in options else 0.03):
        options["fsdp_impl"] = rng.choice(FSDP_IMPLS)
    if rng.random() < (0.15 if "fsdp" in options else 0.01):
        options["reduce_dtype"] = rng.choice(REDUCE_DTYPES)
    if rng.random() < 0.25:
        options["allocator"] = rng.choice(ALLOCATORS)
    if rng.random() < 0.1:
        options["tp"] = rng.choice(TP_DRAWS)
    if rng.random() < 0.1:
        options["cp"] = rng.choice(CP_DRAWS)
        # Mostly with fsdp, which context parallelism needs.
        if "fsdp" not in options and rng.random() < 0.7:
            options["fsdp"] = rng.choice([1, 2])
    if rng.random() < 0.04:
        options["ep"] = rng.choice(EP_DRAWS)
    return options


def draw_flags(rng, options):
    for name in FLAGS:
        if rng.random() < 0.3:
            options[name] = rng.choice([True, False])
    return options


def draw_simulate(rng):
    options = draw_numbers(rng, RUN_BOUNDS, 0.3) | draw_numbers(rng, FSDP_BOUNDS, 0.15)
    for name, values in TEXT.items():
        if rng.random() < 0.25:
            options[name] = rng.choice(values)
    for name in SWITCHES:
        if rng.random() < 0.15:
            options[name] = False
    draw_flags(rng, options)
    return cheapened(draw_fsdp(rng, options), {**RUN_BOUNDS, **FSDP_BOUNDS, **TP_BOUNDS})


def draw_compare(rng):
    options = draw_numbers(rng, RUN_BOUNDS, 0.3) | draw_numbers(rng, FSDP_BOUNDS, 0.15)
    return cheapened(
        draw_fsdp(rng, draw_flags(rng, options)), {**RUN_BOUNDS, **FSDP_BOUNDS, **TP_BOUNDS}
    )


def draw_plan(rng):
    options = draw_numbers(rng, {"steps": PLAN_BOUNDS["steps"]}, 0.5) | draw_numbers(
        rng, FSDP_BOUNDS, 0.15
    )
    for name in ("budget", "host_budget"):
        if rng.random() < 0.4:
            options[name] = rng.choice(BUDGETS)
    if rng.random() < 0.3:
        options["margin"] = rng.choice(MARGINS)
    # A plan is searched: an accepted one is kept to the default budget, or one that refuses.
    options = cheapened(draw_fsdp(rng, options), PLAN_BOUNDS)
    if not out_of_bounds(options, PLAN_BOUNDS) and options.get("budget") in (
        "1GiB",
        "24MiB",
        2**30,
    ):
        options["budget"] = None
    return options


def flags(options):
    """`options` as the CLI's flags (None: the option left out)."""
    out = []
    for name, value in options.items():
        if value is None:
            continue
        if name in SWITCHES:
            if value is False:
                out.append(SWITCHES[name])
            continue
        if name in FLAGS:
            out.append(FLAGS[name][value])
            continue
        if name == "reshard_after_forward" and isinstance(value, bool):
            value = "true" if value else "false"
        out += ["--" + name.replace("_", "-"), str(value)]
    return out


def python_edge(command, options):
    """("ok", document) or ("refused", exit code, message) from `ferry.<command>`."""
    try:
        if command == "simulate":
            return ("ok", ferry.simulate(MODEL, device=DEVICE, check=False, **options))
        if command == "compare":
            return ("ok", ferry.compare(MODEL, device=DEVICE, check=False, **options))
        return ("ok", dict(ferry.plan(MODEL, device=DEVICE, **options)))
    except ferry.PlanError as e:
        text = str(e)
        for prefix in ("ferry plan: ", "ferry plan refused: "):
            if text.startswith(prefix):
                text = text[len(prefix) :]
                break
        return ("refused", e.exit_code, text)
    except ValueError as e:
        return ("refused", 2, str(e))


def cli_edge(command, options):
    """("ok", document) or ("refused", exit code, message) from `ferry <command> --json`."""
    args = [cli(), command, "--model", MODEL, "--device", DEVICE, "--json", *flags(options)]
    if command != "plan":
        args.append("--no-checker")
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode == 2:
        prefix = f"ferry {command}: error: "
        assert done.stderr.startswith(prefix) and done.stderr.endswith("\n"), done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        return ("refused", 2, done.stderr[len(prefix) : -1])
    if command == "plan" and done.returncode == 1:
        prefix = "ferry plan: "
        assert done.stderr.startswith(prefix), done.stderr
        return ("refused", 1, done.stderr[len(prefix) :].rstrip("\n"))
    assert done.returncode in (0, 1), (done.returncode, done.stderr)
    return ("ok", json.loads(done.stdout))


def disagreement(command, options, python=python_edge):
    """Why the edges (or the bounds) disagree on `options`, or None."""
    py, cl = python(command, options), cli_edge(command, options)
    if py != cl:
        return f"python {py!r:.600}\n   cli {cl!r:.600}"
    bounds = PLAN_BOUNDS if command == "plan" else {**RUN_BOUNDS, **FSDP_BOUNDS, **TP_BOUNDS}
    outside = out_of_bounds(options, bounds)
    if outside and py[:2] != ("refused", 2):
        return f"{outside} is out of bounds, yet: {py!r:.600}"
    named = BOUNDS_MESSAGE.match(py[2]) if py[0] == "refused" else None
    if named:
        flag, value = named.group(1), int(named.group(2))
        if (flag, value) not in outside or named.group(3) != bounds_of(bounds, flag):
            return f"refused as out of bounds, of {outside} out of bounds: {py!r:.600}"
    return None


#: A message that says a number is out of bounds: the option, the value, the bounds.
BOUNDS_MESSAGE = re.compile(r"^(--[a-z-]+): (-?[0-9]+) is not in ([0-9]+\.\.[0-9]+)$")


def bounds_of(bounds, flag):
    lo, hi = next((lo, hi) for f, lo, hi in bounds.values() if f == flag)
    return f"{lo}..{hi}"


DRAW = {"simulate": draw_simulate, "compare": draw_compare, "plan": draw_plan}
CASES = {"simulate": 400, "compare": 200, "plan": 200}


def cases(command, seed=SEED):
    rng = random.Random(f"{seed}:{command}")
    return [DRAW[command](rng) for _ in range(CASES[command])]


@pytest.mark.parametrize("command", list(CASES))
def test_both_edges_give_one_verdict(command):
    start = time.monotonic()
    verdicts = []
    for i, options in enumerate(cases(command)):
        why = disagreement(command, options)
        assert why is None, f"seed {SEED}, {command} case {i}: {options}\n{why}"
        verdicts.append(python_edge(command, options)[0])
    # The draws reach both verdicts, often enough for each to be tested.
    assert verdicts.count("ok") > len(verdicts) // 5, verdicts.count("ok")
    assert verdicts.count("refused") > len(verdicts) // 5, verdicts.count("refused")
    assert time.monotonic() - start < 60


def old_binding(command, options):
    """A planted fault: the Python edge as it was, where fsdp and nodes of 0 meant "not given"
    and so were never refused."""
    kept = {k: v for k, v in options.items() if not (k in ("fsdp", "nodes") and v == 0)}
    return python_edge(command, kept)


def test_the_property_catches_a_python_edge_that_drifts():
    for command in CASES:
        for options in cases(command):
            if disagreement(command, options, python=old_binding):
                return
    pytest.fail(f"no case of seed {SEED} tells the old binding from the CLI")


#: Values the Python edge once accepted (issue 34) and both edges now refuse, with the message.
REFUSED = [
    ("simulate", {"steps": 0}, "--steps: 0 is not in 1..1000"),
    ("simulate", {"steps": 1001}, "--steps: 1001 is not in 1..1000"),
    ("simulate", {"stash": 0}, "--stash: 0 is not in 1..1048576"),
    ("simulate", {"min_bytes": -1}, "--min-bytes: -1 is not in 0..1125899906842624"),
    ("simulate", {"window_mib": -5}, "--window-mib: -5 is not in 0..1073741824"),
    ("simulate", {"prefetch_mib": -1}, "--prefetch-mib: -1 is not in 0..1073741824"),
    ("simulate", {"host_cap_gib": -1}, "--host-cap-gib: -1 is not in 0..1048576"),
    ("simulate", {"host_cap_gib": 2**20 + 1}, "--host-cap-gib: 1048577 is not in 0..1048576"),
    ("simulate", {"fsdp": 0}, "--fsdp: 0 is not in 1..1000000"),
    ("simulate", {"fsdp": -1}, "--fsdp: -1 is not in 1..1000000"),
    ("simulate", {"nodes": 0}, "--nodes: 0 is not in 1..1000000"),
    ("simulate", {"fsdp": 8, "nodes": 0}, "--nodes: 0 is not in 1..1000000"),
    ("compare", {"steps": 0}, "--steps: 0 is not in 1..1000"),
    ("compare", {"stash": 0}, "--stash: 0 is not in 1..1048576"),
    ("compare", {"fsdp": 0}, "--fsdp: 0 is not in 1..1000000"),
    ("compare", {"pp": 0}, "--pp: 0 is not in 1..64"),
    ("compare", {"pp": 65}, "--pp: 65 is not in 1..64"),
    ("simulate", {"pp": 65}, "--pp: 65 is not in 1..64"),
    ("plan", {"pp": 0}, "--pp: 0 is not in 1..64"),
    ("compare", {"micro_batches": 1025}, "--micro-batches: 1025 is not in 1..1024"),
    ("plan", {"steps": 0}, "--steps: 0 is not in 1..100"),
    ("plan", {"steps": 101}, "--steps: 101 is not in 1..100"),
    ("plan", {"nodes": 0}, "--nodes: 0 is not in 1..1000000"),
    ("simulate", {"allocator": "cuda"}, '--allocator: "cuda" is not default or expandable'),
    ("compare", {"allocator": ""}, '--allocator: "" is not default or expandable'),
    ("plan", {"allocator": "Expandable"}, '--allocator: "Expandable" is not default or expandable'),
    ("plan", {"margin": 51}, "--margin: 51 % is not in 0..50 %"),
    (
        "plan",
        {"margin": "5.55"},
        '--margin: "5.55" is not a percentage of the budget such as 6, 5.5 or 6%',
    ),
]


@pytest.mark.parametrize("command, options, message", REFUSED)
def test_a_value_out_of_bounds_is_refused_on_both_edges(command, options, message):
    error = ferry.PlanError if command == "plan" else ValueError
    with pytest.raises(error) as e:
        python_edge_raw(command, options)
    assert str(e.value) == (f"ferry plan: {message}" if command == "plan" else message)
    if command == "plan":
        assert e.value.exit_code == 2
    assert cli_edge(command, options) == ("refused", 2, message)


def python_edge_raw(command, options):
    if command == "plan":
        return ferry.plan(MODEL, device=DEVICE, **options)
    return getattr(ferry, command)(MODEL, device=DEVICE, check=False, **options)


NEED_FSDP = "--nodes, --hsdp, --reshard-after-forward, --fsdp-impl and --reduce-dtype need --fsdp N"


@pytest.mark.parametrize(
    "command, options, message",
    [
        # With --fsdp only, as the command line has it.
        ("simulate", {"nodes": 2}, NEED_FSDP),
        ("compare", {"hsdp": 2}, NEED_FSDP),
        ("plan", {"reshard_after_forward": False}, NEED_FSDP),
        ("simulate", {"fsdp_impl": "simple"}, NEED_FSDP),
        ("plan", {"reduce_dtype": "float32"}, NEED_FSDP),
    ],
)
def test_fsdp_only_options_need_fsdp_on_both_edges(command, options, message):
    assert python_edge(command, options) == ("refused", 2, message)
    assert cli_edge(command, options) == ("refused", 2, message)


@pytest.mark.parametrize(
    "options",
    [
        {"hsdp": 1},
        {"reshard_after_forward": True},
        {"fsdp_impl": "fsdp2"},
        {"reduce_dtype": "param"},
    ],
)
def test_the_fsdp_defaults_need_no_fsdp(options):
    # hsdp 1 and resharding after forward are the defaults: given, they need no fsdp.
    assert python_edge("simulate", options) == cli_edge("simulate", options)
    assert python_edge("simulate", options)[0] == "ok"
