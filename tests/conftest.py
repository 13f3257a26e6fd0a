"""Shared fixtures: the tiny random model, and the guard that keeps real models out of the fast tier.

Helpers that tests import live in ``tests/helpers/`` (a package; ``tests/`` is on ``sys.path``
under pytest, so tests write ``from helpers.meshkit import mesh``).
"""

from __future__ import annotations

import asyncio
import faulthandler
import inspect
import os
import sys

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


#: Seconds an asyncio test may run before the watchdog prints every task's stack and cancels it,
#: so a hang fails with the awaits that never finished instead of stalling the run for the rest
#: of CI's 90 minutes. Far above the slowest test on one loaded core (the stalled-hop failover
#: test of the default model, a few minutes); ``MESHINFER_TEST_WATCHDOG_S`` overrides it.
WATCHDOG_S = float(os.environ.get("MESHINFER_TEST_WATCHDOG_S", "900"))


def pytest_collection_modifyitems(config, items):
    """Give every asyncio test the :func:`_hang_watchdog` fixture."""
    for item in items:
        if inspect.iscoroutinefunction(getattr(item, "function", None)):
            item.fixturenames.append("_hang_watchdog")


@pytest.fixture
async def _hang_watchdog(request):
    """Arm a timer on the test's event loop: after :data:`WATCHDOG_S` it prints the stack of
    every task and every thread to stderr, then cancels the test's task (it fails with
    CancelledError). A blocked event loop cannot run the timer; pytest's own
    ``faulthandler_timeout`` (pyproject.toml) dumps the threads then."""
    loop = asyncio.get_running_loop()
    code = request.node.function.__code__

    def fire():
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():  # to the terminal now, not the test's captured output
            print(f"\n=== watchdog: {request.node.nodeid} still running after {WATCHDOG_S:.0f} s; "
                  "every task's awaits follow ===", file=sys.stderr)
            for task in asyncio.all_tasks(loop):
                print(f"--- {task.get_name()}:", " <- ".join(_awaits(task.get_coro())), file=sys.stderr)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for task in asyncio.all_tasks(loop):
            if any(frame.f_code is code for frame in task.get_stack(limit=200)):
                task.cancel(f"watchdog: still running after {WATCHDOG_S:.0f} s")

    handle = loop.call_later(WATCHDOG_S, fire)
    yield
    handle.cancel()


def _awaits(coro) -> list[str]:
    """``file:line function`` of ``coro`` and of each coroutine it awaits, outermost first
    (``Task.print_stack`` shows only the outermost frame of a suspended task)."""
    out = []
    while coro is not None and len(out) < 60:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            out.append(type(coro).__name__)
            break
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out
