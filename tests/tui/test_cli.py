"""The chatkv command on a tiny model: one-shot, a saved chat, --list and --resume."""

from __future__ import annotations

import io

import pytest

from chatkv.tui.cli import main

pytestmark = pytest.mark.tiny_model("llama", seed=4)


def test_one_shot_prints_reply_and_stats(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    assert main(["--model", model_dir, "--max-tokens", "5", "--stats", "Hello there"]) == 0
    out = capsys.readouterr()
    assert "5 generated" in out.err or "generated" in out.err
    assert out.out.endswith("\n")


def test_chat_is_saved_listed_and_resumed(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n/exit\n"))
    assert main(["--model", model_dir, "--max-tokens", "4", "--stats"]) == 0
    err = capsys.readouterr().err
    conv_id = err.split("conversation ")[1].split(".")[0]
    assert main(["--model", model_dir, "--list"]) == 0
    listing = capsys.readouterr().out
    assert conv_id in listing and "What is the capital of France?" in listing
    monkeypatch.setattr("sys.stdin", io.StringIO("And Italy?\n"))
    assert main(["--model", model_dir, "--max-tokens", "4", "--stats", "--resume", conv_id]) == 0
    err = capsys.readouterr().err
    assert "restored" in err and " 0 restored" not in err  # the history came back from disk


def test_errors_are_reported_not_raised(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    assert main(["--model", str(tmp_path / "missing"), "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--temperature", "-1", "hi"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_a_bad_line_is_reported_and_the_chat_goes_on(model_dir, tmp_path, monkeypatch, capsys):
    """Invalid UTF-8 and a lone surrogate on stdin: one error line each, then the next message is answered."""
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    raw = io.BytesIO(
        b"\xff\xfe not utf-8\n" + "bad \ud800 surrogate\n".encode("utf-8", "surrogatepass") + b"Hello\n/exit\n"
    )
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(raw, encoding="utf-8", errors="strict"))
    assert main(["--model", model_dir, "--max-tokens", "3", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "not valid UTF-8" in err
    assert "Traceback" not in err and "generated" in err  # the third line got a reply with its stats


# -- the app only on a terminal, pipe mode, --resume [ID], empty prompts, safe text --------------


class _Stream(io.StringIO):
    """A text stream that says whether it is a terminal."""

    def __init__(self, text: str = "", tty: bool = False):
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _pipe(text: str) -> io.TextIOWrapper:
    """stdin as `echo ... | chatkv` gives it: bytes underneath, not a terminal."""
    return io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8")


def _fake_app(monkeypatch) -> list[dict]:
    """Replace chatkv.tui.app (whether or not it exists yet) by a run_app that records its call."""
    import sys
    import types

    calls: list[dict] = []
    mod = types.ModuleType("chatkv.tui.app")
    mod.run_app = lambda **kw: calls.append(kw) or 0
    monkeypatch.setitem(sys.modules, "chatkv.tui.app", mod)
    return calls


def _stored_reply(model_dir: str, data_dir, conv_id: str) -> str:
    from chatkv.engine.core import Engine

    with Engine.from_pretrained(model_dir, data_dir=str(data_dir)) as engine:
        return [m for m in engine.resume(conv_id).messages() if m.role == "assistant"][-1].content


def test_pipe_mode_prints_the_reply_alone_on_stdout(model_dir, tmp_path, monkeypatch, capsys):
    """echo "What is the capital of France?" | chatkv: the reply (and only it) on stdout, exit 0, no app."""
    calls = _fake_app(monkeypatch)
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    stdin = _pipe("What is the capital of France?\n")
    assert not stdin.isatty()
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["--model", model_dir, "--max-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert calls == []
    conv_id = out.err.split("conversation ")[1].split(".")[0]
    from chatkv.tui.terminal_text import safe_text

    assert out.out == safe_text(_stored_reply(model_dir, tmp_path, conv_id)) + "\n"  # no banner, no "> " prompts
    assert "> " not in out.out and "conversation" not in out.out


def test_pipe_mode_in_a_real_process(model_dir, tmp_path):
    """The console script's code path through a real pipe: exit 0, stdout holds one reply line, stderr no traceback."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, CHATKV_HOME=str(tmp_path))
    p = subprocess.run(
        [sys.executable, "-m", "chatkv.cli", "--model", model_dir, "--max-tokens", "5"],
        input=b"What is the capital of France?\n",
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr.decode()
    assert p.stdout.decode().count("\n") == 1 and not p.stdout.startswith(b"> ")
    assert b"Traceback" not in p.stderr


@pytest.mark.parametrize("stdin_tty,stdout_tty", [(True, True), (True, False), (False, True), (False, False)])
def test_the_app_opens_only_when_stdin_and_stdout_are_terminals(
    model_dir, tmp_path, monkeypatch, stdin_tty, stdout_tty
):
    calls = _fake_app(monkeypatch)
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", _Stream("", tty=stdin_tty))  # line mode: at once at the end of input
    monkeypatch.setattr("sys.stdout", _Stream(tty=stdout_tty))
    argv = [
        "--model",
        model_dir,
        "--data-dir",
        str(tmp_path / "d"),
        "--system",
        "Be terse.",
        "--temperature",
        "0.5",
        "--overflow",
        "truncate",
    ]
    assert main(argv) == 0
    if stdin_tty and stdout_tty:
        assert calls == [
            dict(
                model=model_dir,
                data_dir=str(tmp_path / "d"),
                resume=None,
                system="Be terse.",
                kb=None,
                sampling={"temperature": 0.5},
                engine_options={"overflow": "truncate"},
            )
        ]
    else:
        assert calls == []


def test_app_options_chat_subcommand_and_plain(model_dir, tmp_path, monkeypatch):
    calls = _fake_app(monkeypatch)
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", _Stream("", tty=True))
    monkeypatch.setattr("sys.stdout", _Stream(tty=True))
    assert main(["chat", "--resume"]) == 0
    assert main(["--resume", "abc123", "--kb", "docs", "--model", model_dir]) == 0
    assert calls == [
        dict(model=None, data_dir=None, resume="latest", system=None, kb=None, sampling=None, engine_options={}),
        dict(model=model_dir, data_dir=None, resume="abc123", system=None, kb="docs", sampling=None, engine_options={}),
    ]
    assert main(["--plain", "--model", model_dir]) == 0  # line mode in a terminal
    assert main(["--model", model_dir, "--max-tokens", "2", "Hi"]) == 0  # a prompt: one-shot
    assert len(calls) == 2
    assert main(["--temperature", "-1"]) == 2 and len(calls) == 2  # bad options never reach the app


def test_resume_without_an_id_continues_the_latest(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", _pipe(""))
    assert main(["--model", model_dir, "--resume"]) == 2  # nothing saved yet: an error, not a new chat
    assert "no saved conversation" in capsys.readouterr().err
    ids = []
    for first in ("First chat", "Second chat"):
        monkeypatch.setattr("sys.stdin", _pipe(first + "\n"))
        assert main(["--model", model_dir, "--max-tokens", "3"]) == 0
        ids.append(capsys.readouterr().err.split("conversation ")[1].split(".")[0])
    monkeypatch.setattr("sys.stdin", _pipe("And then?\n"))
    assert main(["--model", model_dir, "--max-tokens", "3", "--stats", "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"conversation {ids[1]}." in err
    assert "restored" in err and " 0 restored" not in err  # the latest's KV came back from disk
    assert main(["--model", model_dir, "--list"]) == 0
    assert capsys.readouterr().out.count("\n") == 2  # no third conversation


def test_resume_with_an_empty_id_is_an_error(model_dir, tmp_path, monkeypatch, capsys):
    calls = _fake_app(monkeypatch)
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", _pipe("Hello\n"))
    for bad in ("", "  "):
        assert main(["--model", model_dir, "--resume", bad]) == 2
        out = capsys.readouterr()
        assert out.out == "" and out.err.count("\n") == 1 and "--resume needs a conversation id" in out.err
    monkeypatch.setattr("sys.stdin", _Stream("", tty=True))
    monkeypatch.setattr("sys.stdout", _Stream(tty=True))
    assert main(["--resume", ""]) == 2 and calls == []  # nor does the app start a new chat
    monkeypatch.undo()
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    assert main(["--model", model_dir, "--list"]) == 0
    assert capsys.readouterr().out == ""  # no conversation was created


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_an_empty_prompt_is_refused_as_the_sdk_refuses_an_empty_message(
    model_dir, tmp_path, monkeypatch, capsys, prompt
):
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    assert main(["--model", model_dir, prompt]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "prompt is empty" in out.err
    assert main(["--model", model_dir, "--kb", "docs", prompt]) == 2


def test_escape_sequences_in_a_title_do_not_reach_the_terminal(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    hostile = "\x1b]0;pwned\x07\x1b[2J\x1b[HHello \x1b[31mred\x1b[0m\x9b2J\r world\x1bc"
    monkeypatch.setattr("sys.stdin", _pipe(hostile + "\n"))
    assert main(["--model", model_dir, "--max-tokens", "3"]) == 0
    capsys.readouterr()
    assert main(["--model", model_dir, "--list"]) == 0
    listing = capsys.readouterr().out
    assert "Hello red world" in listing
    assert not any(c in listing for c in "\x1b\x07\x9b\r")
    # an error that echoes user input is made safe too
    assert main(["--model", model_dir, "--resume", "\x1b]0;pwned\x07nope"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "nope" in err


def test_streamed_replies_and_sources_are_made_safe(capsys):
    """A reply whose pieces split an escape sequence, and sources with control characters, print clean."""
    from types import SimpleNamespace

    from chatkv.outputs import Reply
    from chatkv.tui.cli import _chat

    src = SimpleNamespace(cited=True, number=1, source="docs/\x1b]0;x\x07evil.md", heading="Intro\x1b[2J")

    class FakeSession:
        id = "c1"

        def stream(self, text, params):
            yield from ["Par", "is\x1b", "[2J!", " \x1b]0;ti", "tle\x07ok", "\x07\r\n"]
            yield Reply(text="", usage=None, finish_reason="stop", message_id=1, sources=[src])

    assert _chat(FakeSession(), None, False, ["hi"]) == 0
    out = capsys.readouterr()
    assert out.out == "Paris! ok\n\n"
    assert out.err == "*[1] evil.md - Intro\n"


def test_safe_text():
    from chatkv.tui.terminal_text import SafeStream, safe_text

    assert safe_text("\x1b]0;pwned\x07Title") == "Title"  # OSC, BEL-terminated
    assert safe_text("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\") == "link"  # OSC, ST-terminated (hyperlink)
    assert safe_text("a\x1b[2Jb\x1b[1;31mc\x1b[?25l") == "abc"  # CSI
    assert safe_text("x\x1bcy\x1b(Bz\x1b7") == "xyz"  # other ESC sequences
    assert safe_text("\x9b31mC1\x9d0;t\x9c\x85") == "C1"  # 8-bit forms and C1 controls
    assert safe_text("r\rn\r\nz\x00\x08\x7f") == "rn\nz"
    assert safe_text("tab\tnl\n") == "tab\tnl\n" and safe_text("tab\tnl\n", oneline=True) == "tab nl "
    assert safe_text("héllo ✓ 日本 🙂") == "héllo ✓ 日本 🙂"
    assert "\x1b" not in safe_text("unterminated \x1b]0;abc") and "abc" in safe_text("unterminated \x1b]0;abc")
    st = SafeStream()
    pieces = ["hi \x1b", "[2", "J there \x1b]0;", "ti", "tle\x07 ok\r", "\nend\x1b"]
    assert "".join(st.feed(p) for p in pieces) + st.flush() == "hi  there  ok\nend"
    st = SafeStream()
    assert st.feed("a\x1b]0;t\x1b\\hello") == "ahello"  # a complete sequence is never held back


def test_a_message_longer_than_the_context_is_one_error_line_and_the_chat_goes_on(
    model_dir, tmp_path, monkeypatch, capsys
):
    import json
    import logging
    import shutil

    model = tmp_path / "model"  # a tokenizer that knows its limit, as real ones do: transformers would warn too
    shutil.copytree(model_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps(dict(cfg, model_max_length=1024)))
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    long = "the quick brown fox " * 1000  # the tiny model's context is 1024 tokens
    monkeypatch.setattr("sys.stdin", _pipe(f"Hello\n{long}\nAnd then?\n"))
    warned: list[logging.LogRecord] = []  # transformers' handler writes to a stderr captured before the test
    collect = logging.Handler()
    collect.emit = warned.append
    tok_log = logging.getLogger("transformers.tokenization_utils_base")
    tok_log.addHandler(collect)
    try:
        assert main(["--model", str(model), "--max-tokens", "3", "--stats"]) == 0
    finally:
        tok_log.removeHandler(collect)
    err = capsys.readouterr().err
    errors = [
        line
        for line in err.splitlines()
        if line.startswith("chatkv: ") and "conversation" not in line and "Type a message" not in line
    ]
    assert len(errors) == 1 and "context window of 1024" in errors[0], err
    assert not [r for r in warned if "Token indices" in r.getMessage()]  # no extra lines from transformers
    assert err.count("generated") == 2 and "Traceback" not in err  # the message after it got a reply


def test_kv_dtype_option_stores_the_conversation_quantised(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    monkeypatch.setattr("sys.stdin", _pipe("What is the capital of France?\n"))
    assert main(["--model", model_dir, "--max-tokens", "3", "--kv-dtype", "int8"]) == 0
    assert capsys.readouterr().out.strip()
    manifests = list((tmp_path / "kv").glob("*.json"))
    assert len(manifests) == 1 and '"kv_dtype": "int8@' in manifests[0].read_text()
    with pytest.raises(SystemExit) as e:
        main(["--model", model_dir, "--kv-dtype", "int4"])
    assert e.value.code == 2 and "--kv-dtype: invalid choice: 'int4'" in capsys.readouterr().err


def test_search_prints_one_line_a_hit_on_every_branch_and_exits_1_on_none(model_dir, tmp_path, monkeypatch, capsys):
    """chatkv --search TEXT: conversation id, title, role and snippet of each hit, one a
    line on stdout, exit 0; no hit is one line on stderr and exit 1; the app never opens."""
    from chatkv.engine.core import Engine

    calls = _fake_app(monkeypatch)
    monkeypatch.setenv("CHATKV_HOME", str(tmp_path))
    with Engine.from_pretrained(model_dir, data_dir=str(tmp_path)) as engine:
        with engine.session(title="Kitchen \x1b[31mtalk", params={"max_tokens": 3}) as s:
            s.send("Tell me about kettles")
            first = s.messages()[0].id
            s.edit(first, "Tell me about teapots")  # the kettle question is on a branch no longer current
        conv = s.id
    import sys

    captured = sys.stdout
    terminal = _Stream(tty=True)
    monkeypatch.setattr("sys.stdin", _Stream("", tty=True))
    monkeypatch.setattr("sys.stdout", terminal)  # in a terminal too: a listing, not the app
    assert main(["--model", model_dir, "--search", "kettles"]) == 0
    assert terminal.getvalue().splitlines() == [f"{conv}  Kitchen talk  user  Tell me about kettles"] and calls == []
    monkeypatch.setattr("sys.stdout", captured)
    assert main(["--model", model_dir, "--search", "teapots kettles"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["--model", model_dir, "--search", "zebra"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.splitlines()) == 1 and "no match" in out.err
    assert main(["--search", "  "]) == 2  # refused before any model loads
    assert "--search needs words" in capsys.readouterr().err and calls == []
    # listing and searching read the store alone: no model is loaded (this path names none)
    missing = str(tmp_path / "no-such-model")
    assert main(["--model", missing, "--search", "kettles"]) == 0 and conv in capsys.readouterr().out
    assert main(["--model", missing, "--list"]) == 0 and conv in capsys.readouterr().out
