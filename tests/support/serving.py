"""Helpers of the server tests: a tiny model's engine, uvicorn in a thread on a free loopback
port, raw HTTP requests (for what a client library would not send), and the module-scoped
fixtures both test modules import."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from chatkv.engine.core import Engine
from chatkv.server import create_app
from tests.support.tiny import make_model

MODEL = "tiny"
KEY = "sekret-key"
BLOCK = 4


class Running:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def tiny_model(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("model")
    make_model(model_dir, "llama", max_position_embeddings=4096)
    return model_dir


def default_engine(default_model_dir, tmp_path_factory):
    """An engine on the run's converted default model with a data directory of its own, for a
    module's ``engine`` fixture (``yield from``): checked and closed after, its loop thread gone."""
    eng = Engine.from_pretrained(str(default_model_dir), data_dir=str(tmp_path_factory.mktemp("data")))
    yield eng
    eng.check_integrity()
    eng.close()
    assert not any(t.name == "chatkv-engine" and t.is_alive() for t in threading.enumerate())


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_pretrained(
        str(tiny_model(tmp_path_factory)),
        data_dir=str(tmp_path_factory.mktemp("data")),
        block_size=BLOCK,
        num_blocks=2048,
        dtype="float32",
    )
    yield eng
    eng.check_integrity()
    eng.close()
    assert not any(t.name == "chatkv-engine" and t.is_alive() for t in threading.enumerate())


@pytest.fixture(scope="module")
def server(engine):
    run = Running(create_app(engine, model_name=MODEL))
    yield run
    run.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw(url: str, path: str, body=None, headers=None, method=None) -> tuple[int, dict | str, dict]:
    """(status, JSON body or text, lower-cased headers) of one request; ``body``: bytes or JSON-able."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path,
        data=data,
        method=method or ("POST" if data is not None else "GET"),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, text, hdrs = r.status, r.read().decode(), r.headers
    except urllib.error.HTTPError as e:
        status, text, hdrs = e.code, e.read().decode(), e.headers
    hdrs = {k.lower(): v for k, v in hdrs.items()}
    try:
        return status, json.loads(text), hdrs
    except ValueError:
        return status, text, hdrs


def serve_process(model_dir, data, *args: str):
    """``chatkv serve`` in its own process on a free loopback port, once its /health answers:
    ``(process, url)``. ``args``: more command-line options."""
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from chatkv.cli import main; sys.exit(main())",
            "serve",
            "--model",
            str(model_dir),
            "--data-dir",
            str(data),
            "--port",
            str(port),
            *args,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read())
        try:
            if raw(url, "/health")[0] == 200:
                return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("chatkv serve did not come up")
        time.sleep(0.1)


# a chat-completions tool the tool-capable tiny model is asked to call (its city one of two)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
