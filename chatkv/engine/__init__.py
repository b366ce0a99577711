"""The engine: requests in, tokens out.

``core`` (Engine: the SDK's entry point and ``step`` = schedule -> run -> postprocess), ``loop``
(the one thread that drives the steps, and each request's stream), ``closing`` (the admission
gate and ``close(timeout)``), ``scheduler`` and ``sequence`` (continuous batching and a
request's state), ``model_runner`` (the pool's size, one flattened batch per step, the
forward, sampling), ``sampling``, ``text_tokens`` (text is data: only the chat template makes
special tokens), ``constraints`` (token masks for structured output),
``speculative`` (prompt lookup), ``detokenize`` (incremental text, stop strings) and ``metrics``
(Prometheus). Import the module you need: importing this package imports none of them.

``from chatkv.engine import Engine`` is ``chatkv.engine.core.Engine``, imported on first use:
programs written when ``chatkv.engine`` was the Engine's module keep working (``from chatkv
import Engine`` is the SDK's own spelling).
"""


def __getattr__(name: str):
    if name == "Engine":
        from chatkv.engine.core import Engine

        return Engine
    raise AttributeError(f"module 'chatkv.engine' has no attribute {name!r}")
