"""Helpers of the serving tests: a byte-level tokenizer for the tiny models, a checkpoint that has one, and a server
process on 127.0.0.1 (started as users start it, stopped with SIGTERM)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# A chat template of the simplest kind: each message on a line after its role.
CHAT_TEMPLATE = ("{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """A tokenizer whose 256 ids are the 256 bytes (BOS 1, EOS 2, padding 0, as the tiny configs say), with a chat
    template: real text in and out of the tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _bytes_to_unicode()
    model = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    model.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, pad_token=chars[0], bos_token=chars[1],
                                        eos_token=chars[2])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The pids of `pid`'s child processes (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def engine_pids(pid: int) -> list[int]:
    """The engine processes `pid` started (multiprocessing's spawned children, not its resource tracker)."""
    found = []
    for child in children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            pass
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Server:
    """A server process started with `command` (the arguments after the interpreter) on a free port of 127.0.0.1."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 900.0, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen([*args, "--port", str(self.port)], stdout=self._log,
                                        stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        import httpx2 as httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}):\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server was not ready in {timeout} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(**{"base_url": f"{self.url}/v1", "api_key": "unused", "max_retries": 0, "timeout": 300,
                                **kwargs})

    def stop(self, sig=signal.SIGTERM, timeout: float = 120.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "optimum_neuronx.serve", *args]
