"""`python -m server` as launch.py runs it: connects to the engine, serves, stops on SIGTERM."""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ipc.tokenizer import Tokenizer
from server.args import add_server_args, server_child_args
from tests.ipc.client_fakes import FakeEngine, tiny_tokenizer_path

# {% break %} needs the loop controls transformers' environment has.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_m_server_serves_until_sigterm():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with FakeEngine() as engine:
        command = [
            sys.executable, "-m", "server", "--engine-address", engine.address,
            "--tokenizer", tiny_tokenizer_path(), "--api-host", "127.0.0.1",
            "--api-port", str(port), "--served-model-name", "tiny", "--api-key", "k",
            "--scheduling-policy", "fcfs", "--allowed-origins", '["https://ui.example"]',
            "--chat-template", TEMPLATE,
        ]  # fmt: skip
        process = subprocess.Popen(command, cwd=Path(__file__).parents[2])
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    assert httpx.get(url + "/health").status_code == 200
                    break
                except httpx.ConnectError:
                    assert process.poll() is None and time.monotonic() < deadline
                    time.sleep(0.05)
            body = {"model": "tiny", "prompt": "abc", "max_tokens": 5}
            headers = {"Authorization": "Bearer k"}
            answer = httpx.post(url + "/v1/completions", json=body, headers=headers).json()
            assert answer["choices"][0]["text"] == "abcab"  # the engine echoes the prompt
            urgent = httpx.post(
                url + "/v1/completions", json={**body, "priority": 1}, headers=headers
            )
            assert urgent.status_code == 400 and urgent.json()["error"]["param"] == "priority"
            chat = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
            tokens = httpx.post(url + "/tokenize", json=chat, headers=headers).json()["tokens"]
            tokenizer = Tokenizer.from_pretrained(tiny_tokenizer_path())
            assert tokens == tokenizer.encode("<user>hi", add_special_tokens=False)
            cors = httpx.get(url + "/version", headers={"Origin": "https://ui.example"})
            assert cors.headers["access-control-allow-origin"] == "https://ui.example"
            process.send_signal(signal.SIGTERM)
            assert process.wait(10) in (0, -signal.SIGTERM)
        finally:
            process.kill()


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    parser = add_server_args(argparse.ArgumentParser())
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    from_file = parser.parse_args(["--chat-template", str(tmp_path / "t.jinja")])
    assert from_file.chat_template == TEMPLATE
    args = parser.parse_args(["--chat-template", TEMPLATE])
    assert args.chat_template == TEMPLATE
    argv, _ = server_child_args(args)  # launch.py hands it to the server process
    assert argv[argv.index("--chat-template") + 1] == TEMPLATE
    for bad in (str(tmp_path / "missing.jinja"), "{% for m in messages %}"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--chat-template", bad])
