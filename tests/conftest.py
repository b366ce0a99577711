"""Shared test set-up.

Quantised weight modes check themselves against the float path when they load and cache the
verdict per machine (chatkv.model.self_check); the suite keeps that cache in one temporary
directory of its own, shared by every test and child process of the run, so the user's cache
is never touched and each mode is checked once per run.

The fixtures more than one test module uses live here: ``model_dir`` (a module's seeded random
tiny model, chosen with the ``tiny_model`` marker); ``tool_model_dir`` and ``tool_engine`` (the
tiny Qwen2-style model with a tool template, and a module's engine on it); ``postgres`` (one
real PostgreSQL server for the run, a fresh database per ``database()`` call); ``anyio_backend``
(asyncio, for the Textual Pilot tests); ``default_model_dir`` (the packaged default model,
converted once for the run) and ``default_model_home`` (a CHATKV_HOME that already holds it).
Plain helpers that are not fixtures are modules of tests/: ``tests.support.tiny`` (the tiny
models), ``tests.support.fakes`` (a fake tokenizer and request for the KV manager and scheduler
tests), ``tests.support.pilot`` (driving the Textual app), ``tests.support.pg`` (the PostgreSQL
server itself)."""

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
        "`model_dir` fixture builds for a test module (tests.support.tiny.make_model's arguments)",
    )


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> str:
    """A seeded random tiny model directory, built once per test module, as a command line gives
    it (a str). The module says which model with ``pytestmark = pytest.mark.tiny_model(...)``
    (the arguments of ``tests.support.tiny.make_model``); without one, make_model's default."""
    from tests.support.tiny import make_model  # torch: only for the tests that use a model

    mark = request.node.get_closest_marker("tiny_model")
    args, kwargs = (mark.args, mark.kwargs) if mark is not None else ((), {})
    d = tmp_path_factory.mktemp("model")
    make_model(d, *args, **kwargs)
    return str(d)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> str:
    """The tiny Qwen2-style model with a tool-capable chat template (``tests.support.tiny.make_tool_model``,
    seed 1), built once per run: every test reads it, none writes it."""
    from tests.support.tiny import make_tool_model

    d = tmp_path_factory.mktemp("toolmodel")
    make_tool_model(d, seed=1)
    return str(d)


@pytest.fixture(scope="module")
def tool_engine(tool_model_dir, tmp_path_factory):
    """An engine on ``tool_model_dir`` with a data directory of the module's own."""
    from chatkv.config import EngineConfig
    from chatkv.engine.core import Engine

    e = Engine(tool_model_dir, EngineConfig(data_dir=str(tmp_path_factory.mktemp("data")), num_blocks=1024))
    yield e
    e.close()


@pytest.fixture(scope="session")
def postgres():
    """A running PostgreSQL server (tests/support/pg.py), one for the whole run: initdb and a start cost
    seconds, and every test takes a fresh empty database from it (``postgres.database()``), so
    no test sees another's rows. Missing binaries fail the tests that ask for it, saying what is
    missing (this machine and CI have them: a skip would only hide an untested store)."""
    from tests.support.pg import PostgresServer, find_bin_dir, missing_reason

    why = missing_reason()
    if why:
        pytest.fail(f"PostgreSQL tests cannot run: {why}")
    server = PostgresServer(find_bin_dir())
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def anyio_backend():
    """The Textual app runs on asyncio (the anyio-marked Pilot tests)."""
    return "asyncio"


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory):
    """The packaged default model (SmolLM2-135M GGUF) converted once for the whole run
    (``ensure_default_model`` into a home of the run's own), as a Path. The conversion costs
    ~25 s of CPU, so no module converts its own; none writes
    into it (the tests that damage its files damage a copy). The conversion itself is tested
    in test_gguf_convert and, as a new user meets it, in test_cli_tmux."""
    from chatkv.weights import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("default-home"))


@pytest.fixture(scope="session")
def default_model_home(default_model_dir):
    """``home(path)``: make ``path`` a CHATKV_HOME whose models/ already holds the run's converted
    default model (a link to ``default_model_dir``), so ``Engine.from_pretrained()`` there finds
    it as a second start would, without converting again; ``path`` is returned."""
    from pathlib import Path

    def home(path) -> Path:
        models = Path(path) / "models"
        models.mkdir(parents=True, exist_ok=True)
        link = models / default_model_dir.name
        if not link.exists():
            link.symlink_to(default_model_dir, target_is_directory=True)
        return Path(path)

    return home
