"""llama.cpp's own server tests, run against ``chatkv serve`` as a peer suite, each test classed.

llama.cpp ships pytest tests for ``llama-server`` (``tools/server/tests/unit`` in its tree); with
``DEBUG_EXTERNAL=1 PORT=<port>`` their fixture talks to a server already running instead of
starting one. This script starts ``chatkv serve`` (the packaged default model, a free port, a
fresh data directory), runs the peer's files one at a time against it with a time limit per file
and per test, and classes every test, by reading it, as one of:

- ``a``: OpenAI-API behaviour (request and reply shapes, status codes, the SDK's calls) that any
  OpenAI-compatible server should pass whatever its model;
- ``b``: llama-server's own (routes such as ``/completion``, ``/slots``, ``/props``,
  ``/apply-template``; its timings, slots, CLI options, extension fields, web UI, CORS policy);
- ``c``: tied to its test model (a regex on the stories260K/tinyllama model's text, exact token
  counts of its vocabulary or of bge-small's, a real model named by the test).

The peer's test files are never edited. They import ``wget`` (for model downloads that an
external server does not need); this module is also passed to pytest as a plugin (``-p``) that
puts a stand-in ``wget`` in place, records each test's outcome as JSON lines, and stops a test
that runs past its limit. ``test_security.py`` expects the server to hold the API key
``sk-this-is-the-secret-key``, so it gets a server of its own started with that key. Tests marked
``slow`` (they download named real models) are deselected, as the peer's ``tests.sh`` does, and
listed as such.

The module is over 400 lines because most of it is the classification table, one entry per test
(or parameter) of the peer's files; the plugin and the runner are short and belong with it.

    .venv/bin/python scripts/llama_server_tests.py [--peer-dir DIR] [--files a.py,b.py]
        [--file-timeout 900] [--test-timeout 240] [--output results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PEER = Path("/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/tools/server/tests")
FILES = [
    "test_chat_completion.py",
    "test_completion.py",
    "test_tool_call.py",
    "test_compat_oai_responses.py",
    "test_embedding.py",
    "test_tokenize.py",
    "test_security.py",
]
SECURITY_KEY = "sk-this-is-the-secret-key"  # the key test_security.py sends
SERVER_ARGS = {"test_security.py": ["--api-key", SECURITY_KEY]}
RESULTS_ENV = "LLAMA_PEER_RESULTS"
TIMEOUT_ENV = "LLAMA_PEER_TEST_TIMEOUT"
WHERE = re.compile(r" \+ where .*?(?= \(server: |$)")  # pytest's "+ where <object at 0x...>" detail
SERVER_ERROR = re.compile(r'"error": \{\s*"message": "((?:[^"\\]|\\.)*)"')

A, B, C = "a", "b", "c"
# "file::test" classes every parameter of a test; "file::test[id]" one parameter (looked up first).
CLASSES: dict[str, tuple[str, str]] = {
    # test_chat_completion.py
    "test_chat_completion.py::test_chat_completion": (
        C,
        "regex on stories260K's reply and its exact prompt token counts",
    ),
    "test_chat_completion.py::test_chat_completion_cached_tokens": (
        C,
        "exact prompt and cached token counts of the stories vocabulary and template",
    ),
    "test_chat_completion.py::test_chat_completion_stream": (
        C,
        "regex on stories260K's text, its token counts, and the --alias name",
    ),
    "test_chat_completion.py::test_chat_completion_with_openai_library": (
        C,
        "regex 'Suddenly' on stories260K's reply (and a 'b<build>' system_fingerprint)",
    ),
    "test_chat_completion.py::test_chat_template": (B, "--chat-template llama3 and the __verbose debug field"),
    "test_chat_completion.py::test_chat_template_assistant_prefill": (
        B,
        "--chat-template-file and the rendered prompt in __verbose",
    ),
    "test_chat_completion.py::test_chat_template_continue_final_message_vllm_compat": (
        B,
        "the rendered prompt in __verbose (continue_final_message is a vLLM extension)",
    ),
    "test_chat_completion.py::test_chat_template_continue_final_message_mutual_exclusion": (
        B,
        "vLLM/llama-server's add_generation_prompt + continue_final_message fields, not OpenAI's",
    ),
    "test_chat_completion.py::test_apply_chat_template": (B, "the /apply-template route, --chat-template command-r"),
    'test_chat_completion.py::test_completion_with_response_format[response_format0-6-"42"]': (
        B,
        "a schema inside type json_object is llama-server's extension",
    ),
    "test_chat_completion.py::test_completion_with_response_format[response_format1-10-[ -3000 ]]": (
        C,
        "json_object+schema extension and the stories model's exact '[ -3000 ]'",
    ),
    'test_chat_completion.py::test_completion_with_response_format[response_format2-10-"foooooo"]': (
        A,
        "response_format json_schema with a const: the reply must be that JSON string",
    ),
    "test_chat_completion.py::test_completion_with_response_format[response_format3-10-(\\\\{|John)+]": (
        A,
        "response_format json_object: the reply is a JSON object, so it holds '{'",
    ),
    "test_chat_completion.py::test_completion_with_response_format[response_format4-0-None]": (
        A,
        "an unknown response_format type ('sound') is a 400 with an error",
    ),
    "test_chat_completion.py::test_completion_with_response_format[response_format5-0-None]": (
        B,
        "an invalid schema inside json_object (llama-server's extension) is a 400",
    ),
    "test_chat_completion.py::test_completion_with_response_format[response_format6-0-None]": (
        B,
        "an invalid schema inside json_object (llama-server's extension) is a 400",
    ),
    "test_chat_completion.py::test_completion_with_response_format[response_format7-0-None]": (
        B,
        "an invalid schema inside json_object (llama-server's extension) is a 400",
    ),
    "test_chat_completion.py::test_completion_with_json_schema": (B, "the top-level json_schema request field"),
    "test_chat_completion.py::test_completion_with_grammar": (B, "the GBNF grammar request field"),
    "test_chat_completion.py::test_completion_with_invalid_grammar": (B, "the GBNF grammar request field"),
    "test_chat_completion.py::test_invalid_chat_completion_req": (
        A,
        "malformed messages (none, a string, non-objects, bad role/content) get an error",
    ),
    "test_chat_completion.py::test_invalid_chat_completion_req[messages7]": (
        B,
        "two assistant messages in a row are valid in OpenAI's API; llama-server refuses them",
    ),
    "test_chat_completion.py::test_chat_completion_with_timings_per_token": (
        B,
        "timings_per_token and llama-server's timings object",
    ),
    "test_chat_completion.py::test_logprobs": (A, "logprobs/top_logprobs through the openai SDK"),
    "test_chat_completion.py::test_logprobs_stream": (A, "streamed logprobs/top_logprobs through the openai SDK"),
    "test_chat_completion.py::test_logit_bias": (
        A,
        "logit_bias through the openai SDK (token ids from /tokenize, which vLLM and llama-server share)",
    ),
    "test_chat_completion.py::test_context_size_exceeded": (
        B,
        "error type exceed_context_size_error and n_ctx = --ctx-size / --parallel",
    ),
    "test_chat_completion.py::test_context_size_exceeded_stream": (
        B,
        "error type exceed_context_size_error and n_ctx = --ctx-size / --parallel",
    ),
    "test_chat_completion.py::test_return_progress": (B, "return_progress events counted in --batch-size batches"),
    "test_chat_completion.py::test_chat_completions_multiple_choices": (
        B,
        "sends llama-server's own id_slot field, which chatkv refuses as it refuses every field it does not "
        "take (n=2 alone: tests/server/test_server_n.py)",
    ),
    "test_chat_completion.py::test_chat_completions_token_count": (B, "the /chat/completions/input_tokens route"),
    "test_chat_completion.py::test_verbose_debug": (B, "the verbose field and __verbose reply"),
    # test_completion.py: all but the SDK tests use llama-server's /completion route
    "test_completion.py::test_completion": (B, "the /completion route, its timings and fields"),
    "test_completion.py::test_completion_stream": (B, "the /completion route, generation_settings, stop_type"),
    "test_completion.py::test_completion_stream_vs_non_stream": (B, "the /completion route"),
    "test_completion.py::test_completion_with_openai_library": (
        C,
        "regex '(going|bed)' on stories260K's text (and a 'b<build>' system_fingerprint)",
    ),
    "test_completion.py::test_completion_stream_with_openai_library": (
        C,
        "regex '(going|bed)' on stories260K's streamed text",
    ),
    "test_completion.py::test_completion_stream_with_openai_library_stops": (
        C,
        "slow: Phi-3.5-mini's joke matched by regex",
    ),
    "test_completion.py::test_consistent_result_same_seed": (B, "the /completion route, cache_prompt, --parallel"),
    "test_completion.py::test_different_result_different_seed": (B, "the /completion route, cache_prompt, --parallel"),
    "test_completion.py::test_consistent_result_different_batch_size": (B, "the /completion route, --batch-size"),
    "test_completion.py::test_cache_vs_nocache_prompt": (B, "/completion's cache_prompt (skipped by the peer)"),
    "test_completion.py::test_nocache_long_input_prompt": (B, "the /completion route at a 512-token --ctx-size"),
    "test_completion.py::test_json_prompt_no_mtmd": (B, "the /completion route's JSON prompt objects"),
    "test_completion.py::test_json_prompt_mtm_error_when_not_supported": (
        B,
        "the /completion route's multimodal_data prompts",
    ),
    "test_completion.py::test_completion_with_tokens_input": (B, "the /completion route and /tokenize add_special"),
    "test_completion.py::test_completion_parallel_slots": (B, "the /completion and /slots routes"),
    "test_completion.py::test_completion_unified": (B, "the /completion route, --kv-unified, --ctx-size"),
    "test_completion.py::test_completion_response_fields": (B, "the /completion route's response_fields"),
    "test_completion.py::test_n_probs": (B, "the /completion route's n_probs"),
    "test_completion.py::test_n_probs_stream": (B, "the /completion route's n_probs"),
    "test_completion.py::test_n_probs_post_sampling": (B, "the /completion route's post_sampling_probs"),
    "test_completion.py::test_n_probs_post_backend_sampling": (B, "the /completion route, --backend_sampling"),
    "test_completion.py::test_logit_bias": (B, "the /completion route's logit_bias forms (strings, pairs)"),
    "test_completion.py::test_cancel_request": (B, "the /completion and /slots routes"),
    "test_completion.py::test_completion_prompt_cache": (B, "the /completion route's timings and token counts"),
    # test_tool_call.py: the fast test renders the Llama 3.3 template given by --chat-template-file
    "test_tool_call.py::test_completion_without_tool_call_fast": (
        A,
        "no tools, or tool_choice 'none': the reply has no tool_calls",
    ),
    "test_tool_call.py::test_completion_without_tool_call_fast"
    "[meta-llama-Llama-3.3-70B-Instruct-128-tools1-None-CompletionMode.NORMAL]": (
        C,
        "tool_choice auto: whether the model calls the tool is the model's choice",
    ),
    "test_tool_call.py::test_completion_without_tool_call_fast"
    "[meta-llama-Llama-3.3-70B-Instruct-128-tools1-None-CompletionMode.STREAMED]": (
        C,
        "tool_choice auto: whether the model calls the tool is the model's choice",
    ),
    "test_tool_call.py::test_completion_with_required_tool_real_model": (C, "slow: named real models"),
    "test_tool_call.py::test_completion_without_tool_call_slow": (C, "slow: named real models' templates and replies"),
    "test_tool_call.py::test_weather": (C, "slow: named real models; regex on 'Istanbul'"),
    "test_tool_call.py::test_calc_result": (C, "slow: named real models; regex on the computed value"),
    "test_tool_call.py::test_thoughts": (C, "slow: named reasoning models' text"),
    "test_tool_call.py::test_hello_world": (C, "slow: named real models; regex on the code written"),
    # test_compat_oai_responses.py
    "test_compat_oai_responses.py::test_responses_with_openai_library": (
        C,
        "regex 'Suddenly' on stories260K's text (resp_/msg_ ids are OpenAI's)",
    ),
    "test_compat_oai_responses.py::test_responses_stream_with_openai_library": (
        C,
        "regex 'Suddenly' on stories260K's text (event ids are OpenAI's)",
    ),
    "test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry": (
        B,
        "prompt_progress and timings in Responses events",
    ),
    # test_embedding.py (the peer's model is bge-small started with --embedding and --pooling)
    "test_embedding.py::test_embedding_single": (A, "/v1/embeddings of a string: one unit-norm vector"),
    "test_embedding.py::test_embedding_multiple": (A, "/v1/embeddings of 4 strings: 4 vectors"),
    "test_embedding.py::test_embedding_multiple_with_fa": (A, "/v1/embeddings of 4 inputs of about 256 tokens"),
    "test_embedding.py::test_embedding_mixed_input[-False]": (
        B,
        "an empty string embeds (OpenAI refuses an empty input)",
    ),
    "test_embedding.py::test_embedding_mixed_input[string-False]": (A, "input as a string"),
    "test_embedding.py::test_embedding_mixed_input[input2-False]": (A, "input as an array of token ids"),
    "test_embedding.py::test_embedding_mixed_input[input3-False]": (B, "strings mixed into a token-id array"),
    "test_embedding.py::test_embedding_mixed_input[input4-True]": (A, "input as an array of strings"),
    "test_embedding.py::test_embedding_mixed_input[input5-True]": (B, "a string and a token array in one list"),
    "test_embedding.py::test_embedding_mixed_input[input6-True]": (A, "input as an array of token-id arrays"),
    "test_embedding.py::test_embedding_mixed_input[input7-True]": (B, "strings mixed into a token-id array"),
    "test_embedding.py::test_embedding_mixed_input[input8-False]": (B, "llama-server's prompt_string object"),
    "test_embedding.py::test_embedding_mixed_input[input9-False]": (B, "llama-server's multimodal content object"),
    "test_embedding.py::test_embedding_mixed_input[input10-True]": (B, "llama-server's prompt objects in a list"),
    "test_embedding.py::test_embedding_content_text_same_as_string": (B, "llama-server's multimodal content object"),
    "test_embedding.py::test_embedding_invalid_input": (
        A,
        "an empty list or an object that is no OpenAI input shape is refused (not 200)",
    ),
    "test_embedding.py::test_embedding_pooling_mean": (A, "/v1/embeddings of a string: one unit-norm vector"),
    "test_embedding.py::test_embedding_pooling_mean_multiple": (A, "/v1/embeddings of 3 strings: 3 vectors"),
    "test_embedding.py::test_embedding_pooling_none": (B, "the /embeddings route's per-token vectors (--pooling none)"),
    "test_embedding.py::test_embedding_pooling_none_oai": (B, "a 400 because the server runs with --pooling none"),
    "test_embedding.py::test_embedding_openai_library_single": (A, "embeddings.create of a string through the SDK"),
    "test_embedding.py::test_embedding_openai_library_multiple": (A, "embeddings.create of 4 strings through the SDK"),
    "test_embedding.py::test_embedding_error_prompt_too_long": (
        B,
        "llama-server's 'too large' wording at its 512-token --ctx-size",
    ),
    "test_embedding.py::test_same_prompt_give_same_result": (A, "5 copies of one input give equal vectors"),
    "test_embedding.py::test_embedding_usage_single": (C, "exact token counts of bge-small's vocabulary"),
    "test_embedding.py::test_embedding_usage_multiple": (C, "exact token counts of bge-small's vocabulary"),
    "test_embedding.py::test_embedding_openai_library_base64": (
        A,
        "encoding_format base64 decodes to the float vector",
    ),
    # test_tokenize.py
    "test_tokenize.py::test_tokenize_detokenize": (
        A,
        "/tokenize then /detokenize gives the text back (the pair vLLM and llama-server share)",
    ),
    "test_tokenize.py::test_tokenize_with_bos": (C, "the stories vocabulary's BOS id is 1"),
    "test_tokenize.py::test_tokenize_with_pieces": (B, "llama-server's with_pieces field"),
    # test_security.py
    "test_security.py::test_access_public_endpoint": (A, "/health answers without an API key"),
    "test_security.py::test_access_static_assets_without_api_key": (B, "llama-server's web UI files"),
    "test_security.py::test_incorrect_api_key": (
        B,
        "the 401 is OpenAI's, but error type authentication_error is llama-server's"
        " (OpenAI answers invalid_request_error, code invalid_api_key)",
    ),
    "test_security.py::test_correct_api_key": (B, "the /completions reply's 'content' field is llama-server's shape"),
    "test_security.py::test_correct_api_key_anthropic_header": (
        B,
        "the X-Api-Key header and llama-server's 'content' field",
    ),
    "test_security.py::test_openai_library_correct_api_key": (
        A,
        "the SDK with the right key, base URL without /v1",
    ),
    "test_security.py::test_cors_options": (B, "llama-server's CORS policy and header values"),
    "test_security.py::test_cors_origins_localhost_reflects": (B, "the --cors-origins option"),
    "test_security.py::test_cors_origins_localhost_rejects": (B, "the --cors-origins option"),
    "test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled": (B, "the --tools option's CORS"),
    "test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": (B, "the /cors-proxy route"),
    "test_security.py::test_local_media_file": (B, "--media-path and the tinygemma3 vision model"),
}


def classify(nodeid: str) -> tuple[str, str]:
    """The class and reason of a node id such as ``unit/test_x.py::test_y[p]``."""
    key = nodeid.split("/", 1)[-1]
    if key in CLASSES:
        return CLASSES[key]
    base = key.split("[", 1)[0]
    return CLASSES.get(base, ("unclassified", "not in the table"))


# ---- the pytest plugin (this module passed as ``-p llama_server_tests``) -------------------------

if "wget" not in sys.modules:
    # The peer's utils.py imports wget for model downloads; an external server needs none.
    _wget = types.ModuleType("wget")

    def _no_download(url, out=None):
        raise RuntimeError(f"wget stand-in: no downloads while testing an external server ({url})")

    _wget.download = _no_download
    sys.modules["wget"] = _wget


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[2])
    return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""


def pytest_runtest_logreport(report):
    """Append each phase's outcome to the file named by $LLAMA_PEER_RESULTS."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    if report.when == "call" or report.outcome != "passed":
        row = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
        if report.outcome != "passed":
            row["message"] = _message(report)
            # The peer's make_request prints each reply; a bare status assertion says more with the
            # server's own error message beside it.
            said = SERVER_ERROR.findall(report.capstdout or "")
            if said and said[-1] not in row["message"]:
                row["message"] += f" (server: {said[-1]})"
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


class PeerTestTimeout(BaseException):
    """A test ran past its limit. Not an OSError, so HTTP clients do not take it for a network
    error and retry; not an Exception, so the peer's ``except Exception`` blocks let it through."""


def _alarm(signum, frame):
    raise PeerTestTimeout(f"test ran past {os.environ.get(TIMEOUT_ENV)} s")


def pytest_runtest_call(item):
    """Arm a per-test alarm ($LLAMA_PEER_TEST_TIMEOUT seconds); pytest_runtest_teardown disarms it."""
    limit = int(os.environ.get(TIMEOUT_ENV, "0"))
    if limit > 0:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(limit)


def pytest_runtest_teardown(item):
    signal.alarm(0)


# ---- the runner ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, data_dir: Path, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """Start ``chatkv serve`` on ``port`` and wait for /health; return the process and served model."""
    cmd = [str(REPO / ".venv/bin/chatkv"), "serve", "--port", str(port), "--data-dir", str(data_dir), *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chatkv serve exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return proc, json.loads(r.read()).get("model", "?")
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise TimeoutError(f"chatkv serve did not answer /health within 600 s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def runner_env(port: int, results: Path, test_timeout: int) -> dict[str, str]:
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "DEBUG_EXTERNAL": "1",
        "PORT": str(port),
        "PYTHONPATH": path,
        RESULTS_ENV: str(results),
        TIMEOUT_ENV: str(test_timeout),
    }


def collect(peer: Path, files: list[str], marker: str | None, env: dict[str, str]) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "llama_server_tests", "--collect-only"]
    cmd += ["-q", *(["-m", marker] if marker else []), *(f"unit/{f}" for f in files)]
    out = subprocess.run(cmd, cwd=peer, env=env, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if line.startswith("unit/") and "::" in line]


def outcomes(results: Path) -> dict[str, tuple[str, str]]:
    """Node id -> (result, message) from the plugin's JSON lines."""
    seen: dict[str, tuple[str, str]] = {}
    if not results.exists():
        return seen
    for line in results.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        nodeid, when, outcome = row["nodeid"], row["when"], row["outcome"]
        result = {"passed": "passed", "skipped": "skipped"}.get(outcome, "failed" if when == "call" else "error")
        if nodeid not in seen or seen[nodeid][0] == "passed":
            seen[nodeid] = (result, row.get("message", ""))
    return seen


def cell(text: str, limit: int = 160) -> str:
    text = WHERE.sub("", " ".join(text.split()))
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|") or " "


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer-dir", type=Path, default=DEFAULT_PEER, help="llama.cpp's tools/server/tests")
    ap.add_argument("--files", default=",".join(FILES), help="comma-separated test files under unit/")
    ap.add_argument("--file-timeout", type=int, default=900, help="seconds one file may run")
    ap.add_argument("--test-timeout", type=int, default=240, help="seconds one test may run")
    ap.add_argument("--output", type=Path, help="also write the report (markdown) here")
    args = ap.parse_args()
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    peer = args.peer_dir.resolve()

    work = Path(tempfile.mkdtemp(prefix="llama-peer-"))
    results = work / "results.jsonl"
    log = work / "serve.log"
    port = free_port()
    env = runner_env(port, results, args.test_timeout)
    everything = collect(peer, files, None, env)
    fast = set(collect(peer, files, "not slow", env))

    groups: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for f in files:
        groups[tuple(SERVER_ARGS.get(f, []))].append(f)
    timed_out: list[str] = []
    models: set[str] = set()
    started = time.time()
    for n, (extra, group) in enumerate(groups.items()):
        proc, model = start_server(port, work / f"data-{n}", list(extra), log)
        models.add(model)
        try:
            for f in group:
                cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "llama_server_tests"]
                cmd += ["-q", "-m", "not slow", f"unit/{f}"]
                print(f"running {f} against chatkv serve on port {port} {' '.join(extra)}", flush=True)
                with (work / f"{f}.log").open("wb") as out:
                    try:
                        subprocess.run(cmd, cwd=peer, env=env, timeout=args.file_timeout, stdout=out, stderr=out)
                    except subprocess.TimeoutExpired:
                        timed_out.append(f)
        finally:
            stop_server(proc)
    elapsed = time.time() - started

    seen = outcomes(results)
    rows = []
    counts: dict[str, Counter] = defaultdict(Counter)
    for nodeid in everything:
        klass, _ = classify(nodeid)
        if nodeid in seen:
            result, message = seen[nodeid]
        elif nodeid not in fast:
            result, message = "deselected", "marked slow: needs a named real model"
        elif nodeid.split("::")[0].removeprefix("unit/") in timed_out:
            result, message = "not run", "its file ran past --file-timeout"
        else:
            result, message = "not run", "pytest reported no outcome (see the file's log)"
        counts[klass][result] += 1
        rows.append((nodeid, klass, result, message))

    lines = [
        "# llama.cpp's server tests against chatkv serve",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- CPU: {cpu_model()}",
        f"- command: `.venv/bin/python scripts/llama_server_tests.py {' '.join(sys.argv[1:])}`".replace("  ", " "),
        f"- peer: `{peer}` (`DEBUG_EXTERNAL=1 PORT={port}`, pytest `-m 'not slow'`, one file at a time)",
        f"- server: `chatkv serve` with its default model ({', '.join(sorted(models))}); "
        f"test_security.py against one started with `--api-key {SECURITY_KEY}`",
        f"- wall time: {elapsed:.0f} s" + (f"; files past --file-timeout: {', '.join(timed_out)}" if timed_out else ""),
        "",
        "Classes: a = OpenAI-API behaviour, b = llama-server's own (routes, timings, slots, props, CLI options,"
        " extension fields), c = tied to its test model (text regexes, its vocabulary's token counts, named real"
        " models).",
        "",
        "## Counts",
        "",
        "| class | tests | passed | failed | error | skipped | deselected | not run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    kinds = ["passed", "failed", "error", "skipped", "deselected", "not run"]
    for klass in sorted(counts):
        c = counts[klass]
        lines.append(f"| {klass} | {sum(c.values())} | " + " | ".join(str(c[k]) for k in kinds) + " |")
    total = sum((counts[k] for k in counts), Counter())
    lines.append(f"| all | {sum(total.values())} | " + " | ".join(str(total[k]) for k in kinds) + " |")
    lines += ["", "## Each test", "", "| test | class | result | what it saw |", "|---|---|---|---|"]
    for nodeid, klass, result, message in rows:
        lines.append(f"| {cell(nodeid, 140)} | {klass} | {result} | {cell(message) if result != 'passed' else ' '} |")
    lines += ["", "## Why each test has its class", "", "| test | class | reason |", "|---|---|---|"]
    for key, (klass, reason) in CLASSES.items():
        lines.append(f"| {cell(key, 200)} | {klass} | {cell(reason, 200)} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.output:
        args.output.write_text(report, encoding="utf-8")
    print(f"server log and raw results: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
