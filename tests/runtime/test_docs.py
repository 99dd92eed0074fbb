"""Docstring examples of the public API run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

import opweave.runtime as runtime

MODULES = ["batch", "graph"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(f"opweave.runtime._private.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_public_names_are_exported_and_documented():
    for name in runtime.__all__:
        obj = getattr(runtime, name)
        assert obj.__doc__ or isinstance(obj, dict), name
