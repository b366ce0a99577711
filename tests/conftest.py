"""Shared test set-up.

Quantised weight modes check themselves against the float path when they load and cache the
verdict per machine (chatkv.weight_check); the suite keeps that cache in one temporary
directory of its own, shared by every test and child process of the run, so the user's cache
is never touched and each mode is checked once per run.

The fixtures more than one test module uses live here: ``model_dir`` (a module's seeded random
tiny model, chosen with the ``tiny_model`` marker). Plain helpers that are not fixtures are
modules of tests/: ``tests.tiny`` (the tiny models), ``tests.fakes`` (a fake tokenizer and
request for the KV manager and scheduler tests)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if "CHATKV_CACHE_DIR" not in os.environ:  # one per run, removed when the run ends
    _cache = tempfile.mkdtemp(prefix="chatkv-test-cache-")
    os.environ["CHATKV_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "tiny_model(model_type='llama', seed=0, **config): the seeded random tiny model that the "
        "`model_dir` fixture builds for a test module (tests.tiny.make_model's arguments)",
    )


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> str:
    """A seeded random tiny model directory, built once per test module, as a command line gives
    it (a str). The module says which model with ``pytestmark = pytest.mark.tiny_model(...)``
    (the arguments of ``tests.tiny.make_model``); without one, make_model's default."""
    from tests.tiny import make_model  # torch: only for the tests that use a model

    mark = request.node.get_closest_marker("tiny_model")
    args, kwargs = (mark.args, mark.kwargs) if mark is not None else ((), {})
    d = tmp_path_factory.mktemp("model")
    make_model(d, *args, **kwargs)
    return str(d)
