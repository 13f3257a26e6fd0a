"""Shared fixtures: the tiny random model, and the guard that keeps real models out of the fast tier.

Helpers that tests import live in ``tests/helpers/`` (a package; ``tests/`` is on ``sys.path``
under pytest, so tests write ``from helpers.meshkit import mesh``).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    """(gguf path, weights hash, tokenizer, whole-model shard) of a tiny random qwen2 model, one per
    test module (module scope, as every module that defined it used).

    A module that needs another context or seed sets ``TINY_MODEL = {"context": ..., "seed": ...}``
    (the keyword arguments of ``helpers.meshkit.tiny_model``)."""
    from helpers.meshkit import tiny_model

    options = getattr(request.module, "TINY_MODEL", {})
    return tiny_model(tmp_path_factory.mktemp("tiny"), **options)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Record the test being set up, so that loading a real model in a test not marked
    ``realmodel`` fails (``helpers.realmodels.require_realmodel_marker``)."""
    from helpers import realmodels

    realmodels.running_test = item


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    from helpers import realmodels

    realmodels.running_test = None
