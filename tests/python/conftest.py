"""Shared setup of ferry's Python tests.

Nothing is skipped silently: the only skips are the `gpu` tests on a machine without CUDA, the
CPU-only misuse test on a machine with it, and the model families `test_trace_families.py`
does not trace, each with its reason (pytest.ini shows them).
A missing `ferry` module is an error, never a skip: install it first with
`scripts/package.sh BUILD_DIR` (or `pip install --no-build-isolation --no-deps .`).

Loopback sessions run their streams asynchronously (Note [The asynchronous loopback device]):
copies on worker threads with seeded delays, so that a missing wait gives wrong gradients. The
package reads no environment; here FERRY_LOOPBACK ("sync", "async", "async:SEED" or
"async:SEED:MAX_DELAY_US"; "async:1" unless set) becomes ``ferry.offload``'s typed options
(``loopback_streams``, ``loopback_seed``, ``loopback_max_delay_us``) for each loopback region
made without them. CI runs the real-backend suites with several seeds. Every loopback session a
test makes without planted faults must end with no race observed.
"""

import functools
import os
import re
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("FERRY_LOOPBACK", "async:1")

import ferry  # noqa: E402  (an ImportError here fails the whole run, as it should)
import ferry_cli  # noqa: E402

#: ``ferry.offload``'s options that say how a loopback device runs its streams.
LOOPBACK_OPTIONS = ("loopback_streams", "loopback_seed", "loopback_max_delay_us")


def loopback_options(text):
    """FERRY_LOOPBACK's text as ``ferry.offload``'s typed options; a malformed text raises
    ValueError naming the variable."""
    mode, *numbers = text.split(":")
    if text in ("", "sync"):
        return {"loopback_streams": "sync"}
    if mode != "async" or len(numbers) > 2 or not all(re.fullmatch("[0-9]+", n) for n in numbers):
        raise ValueError(
            f"FERRY_LOOPBACK={text!r}: expected sync, async, async:SEED or async:SEED:MAX_DELAY_US"
        )
    options = {"loopback_streams": "async"}
    for name, number in zip(("loopback_seed", "loopback_max_delay_us"), numbers):
        options[name] = int(number)
    return options


def _harness_loopback(init):
    """``ferry.offload.__init__`` that gives a loopback region made without stream options
    those FERRY_LOOPBACK names (read at each call: a test may set it)."""

    @functools.wraps(init)
    def wrapped(self, **options):
        if options.get("loopback") and not any(name in options for name in LOOPBACK_OPTIONS):
            options.update(loopback_options(os.environ.get("FERRY_LOOPBACK", "async:1")))
        init(self, **options)

    return wrapped


ferry.offload.__init__ = _harness_loopback(ferry.offload.__init__)

HAVE_CUDA = torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (skipped, with the reason shown, when torch sees none)"
    )


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords and not HAVE_CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _deterministic():
    """Each test starts from the same random state and leaves no region open behind it."""
    torch.manual_seed(0)
    yield
    # A region left open would change what the next test's saved tensors go through: both
    # ferry's region stack (per thread; _pop of an empty stack raises) and torch's stack of
    # saved-tensor hooks must be empty between tests.
    with pytest.raises(RuntimeError, match="regions must nest"):
        ferry._C._pop("offload")
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


@pytest.fixture(autouse=True)
def _no_races(monkeypatch):
    """Every session made through ferry.offload (planted faults aside) ends the test with no
    race seen by the asynchronous loopback device."""
    sessions = []
    make = ferry.offload._make_session

    def recording(options):
        session = make(options)
        sessions.append(session)
        return session

    monkeypatch.setattr(ferry.offload, "_make_session", staticmethod(recording))
    yield
    races = sum(s.races() for s in sessions)
    assert races == 0, f"the asynchronous loopback device saw {races} race(s)"


@pytest.fixture
def cli():
    """The CLI binary `python -m ferry` finds (FERRY_CLI, the package's copy, or PATH); the test
    is skipped, with the places searched, where there is none (CI sets FERRY_CLI)."""
    return ferry_cli.cli()


def run_module(*args, env=None, timeout=300):
    """`python -m ferry ARGS...` in a child process, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "ferry", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
