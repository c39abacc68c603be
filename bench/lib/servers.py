"""A server the serving benchmarks start in its own process (ours, ``python -m runtime serve`` or a benchmark's
own entry point, or llama.cpp's ``llama-server``), on a free loopback port, stopped with SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from bench.lib.report import REPO


class ServerProcess:
    """A server in its own process on a free loopback port; stopped with SIGTERM."""

    def __init__(self, name: str, cmd: list[str], log: Path, port: int | None = None, ready: str = "/ready"):
        self.name, self.log = name, log
        with open(log, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        if port is None:  # ours prints {"listening": "http://host:port", ...} first
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{name} did not start:\n{log.read_text()[-3000:]}")
            port = int(json.loads(line)["listening"].rsplit(":", 1)[1])
        self.port = port
        self.wait_ready(ready)

    def wait_ready(self, path: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout} s")
            time.sleep(0.2)

    def cpu_seconds(self) -> float:
        """User + system CPU the server process has used so far, every thread's."""
        times = psutil.Process(self.proc.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def our_server(world: dict, contexts: tuple[int, ...], max_tokens: int, threads: int, work: Path,
               label: str, options: dict) -> ServerProcess:
    """``python -m runtime serve`` on the release, its threads (and ``options``: device config keys such as
    ``ort_memory``, ``prefill_chunk``) from a device config, as a device runs it."""
    config = work / "device.json"
    config.write_text(json.dumps({"trusted_keys": [str(world["trusted_key"])], "engine": str(world["engine"]),
                                  "tokenizer": str(world["tokenizer"]), "threads": threads}
                                 | options))
    cmd = [sys.executable, "-m", "runtime", "serve", "--device-config", str(config), "--package", str(world["release"]),
           "--port", "0", "--max-context-tokens", str(max(contexts)), "--max-tokens", str(max(max_tokens, 256)),
           "--max-queue", str(max(len(contexts), 16))]
    return ServerProcess(label, cmd, work / f"{label.replace(' ', '-')}.log")
