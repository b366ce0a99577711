"""The chatkv command on a tiny model: one-shot, a saved chat, --list and --resume."""

from __future__ import annotations

import io

import pytest

from chatkv.tui.cli import main
from tests.tiny import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli-model")
    make_model(d, "llama", seed=4)
    return str(d)


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
    raw = io.BytesIO(b"\xff\xfe not utf-8\n" + "bad \ud800 surrogate\n".encode("utf-8", "surrogatepass") + b"Hello\n/exit\n")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(raw, encoding="utf-8", errors="strict"))
    assert main(["--model", model_dir, "--max-tokens", "3", "--stats"]) == 0
    err = capsys.readouterr().err
    assert "not valid UTF-8" in err
    assert "Traceback" not in err and "generated" in err  # the third line got a reply with its stats
