"""`ferrolm chat`: a conversation on stdin with a tiny chat model (tests/tiny_chat.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from tiny_chat import CONVERSATIONS, tiny_chat_run
from tiny_lm import tiny_run


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    return tiny_chat_run(tmp_path_factory.mktemp("chat"))


def ferrolm(*argv: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ferrolm", *argv],
        input=stdin.encode("utf-8"),
        capture_output=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_chat_answers_each_line_streams_to_the_end_token_and_stops_at_exit(chat_run):
    ckpt, _ = chat_run
    (hello, hi), (json_q, json_a), (bye, goodbye) = CONVERSATIONS
    lines = [hello, "/reset", json_q, "", "/reset", bye, "/exit", hello]
    r = ferrolm("chat", "--checkpoint", str(ckpt), "--temperature", "0", stdin="\n".join(lines) + "\n")
    assert r.returncode == 0, r.stderr.decode()
    # One reply a line, the end token not shown, nothing answered after /exit.
    assert r.stdout.decode("utf-8").splitlines() == [hi, json_a, goodbye]
    assert r.stderr.decode().count("(history cleared)") == 2
    assert "<|end|>" not in r.stdout.decode()


def test_a_model_without_the_chat_tokens_is_a_clear_error(tmp_path):
    ckpt, _, _ = tiny_run(tmp_path, steps=1)
    r = ferrolm("chat", "--checkpoint", str(ckpt), stdin="Hello\n")
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert "ferrolm chat: error: this model cannot chat" in err and "--config sft" in err
    assert "Traceback" not in err and r.stdout == b""


def test_bad_sampling_options_are_refused_before_loading(tmp_path):
    r = ferrolm("chat", "--checkpoint", str(tmp_path / "missing.pt"), "--temperature", "-1")
    assert r.returncode == 2 and "temperature" in r.stderr.decode() and "Traceback" not in r.stderr.decode()


def test_the_session_keeps_the_history_and_reset_keeps_the_system_message(chat_run):
    from ferrolm.app.chat_command import ChatSession, converse
    from ferrolm.lm.checkpoint import load_model

    ckpt, _ = chat_run
    model, tok, _ = load_model(ckpt, "cpu")
    session = ChatSession(model, tok, (20, 0.0, None, None, tok.eos_id, None), system="Be brief.")
    out, notes = [], []
    converse(session, ["Hello\n", "Bye\n"], out.append, notes.append)
    roles = [m["role"] for m in session.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages[1]["content"] == "Hello" and session.messages[3]["content"] == "Bye"
    # What streamed is what the history keeps: the replies, each followed by a newline.
    assert "".join(out) == session.messages[2]["content"] + "\n" + session.messages[4]["content"] + "\n"
    converse(session, ["/reset"], out.append, notes.append)
    assert session.messages == [{"role": "system", "content": "Be brief."}]
