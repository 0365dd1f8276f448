"""The public surface of ``ferry``: ``__all__`` names what the package exports, every name in it
is annotated (parameters and return, public methods of the classes included), the annotations
resolve, and the package ships its ``py.typed`` marker."""

import inspect
import os
import typing

import pytest

import ferry


def _own_callables(name):
    """(qualified name, function) of ``ferry.<name>``: the function itself, or for a class its
    ``__init__`` and public methods defined by ferry's classes (torch's bases left out)."""
    value = getattr(ferry, name)
    if not inspect.isclass(value):
        return [(name, value)]
    found = {}
    for cls in reversed(value.__mro__):
        if not cls.__module__.startswith("ferry"):
            continue
        for attr, member in vars(cls).items():
            public = not attr.startswith("_") or attr in ("__init__", "__enter__", "__exit__")
            if public and inspect.isfunction(member):
                found[attr] = (f"{cls.__qualname__}.{attr}", member)
    return list(found.values())


def test_all_names_exist_and_include_the_public_types():
    for name in ferry.__all__:
        assert hasattr(ferry, name), name
    assert {"TracedModel", "AutoOffload", "PlanError", "ModelSpecError"} <= set(ferry.__all__)
    assert issubclass(ferry.PlanError, ValueError)


def test_the_trl_names_are_re_exports_of_ferry_compat():
    from ferry.compat import hf, trl

    assert ferry.OffloadActivations is trl.OffloadActivations
    assert ferry.NoOpManager is trl.NoOpManager
    assert ferry.get_act_offloading_ctx_manager is trl.get_act_offloading_ctx_manager
    assert ferry.enable_gradient_checkpointing is hf.enable_gradient_checkpointing
    assert ferry.gradient_checkpointing_offload is hf.gradient_checkpointing_offload


@pytest.mark.parametrize(
    "qualname, function",
    [pair for name in ferry.__all__ for pair in _own_callables(name)],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_every_public_callable_is_fully_annotated(qualname, function):
    signature = inspect.signature(function)
    missing = [
        p.name
        for p in signature.parameters.values()
        if p.name != "self" and p.annotation is inspect.Parameter.empty
    ]
    assert not missing, f"{qualname}: parameters without a type hint: {missing}"
    assert signature.return_annotation is not inspect.Signature.empty, (
        f"{qualname}: no return type hint"
    )
    typing.get_type_hints(function)  # every hint names something that exists


def test_every_public_function_documents_its_arguments():
    for name in ferry.__all__:
        value = getattr(ferry, name)
        if inspect.isclass(value) or not inspect.signature(value).parameters:
            continue
        assert "Args:" in (value.__doc__ or ""), f"ferry.{name}: no Args: section"
        assert "Returns:" in value.__doc__, f"ferry.{name}: no Returns: section"


def test_the_package_is_marked_typed():
    assert os.path.isfile(os.path.join(os.path.dirname(ferry.__file__), "py.typed"))
