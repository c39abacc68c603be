"""A local Prefect server on any port, alone or for a command: `make prefect` and `make prefect-server` use this.

    python -m flows.local_server --port 4200 -- python -m flows.serve   # `make prefect`
    python -m flows.local_server --host 127.0.0.1 --port 4200           # `make prefect-server`

Starts ``prefect server start`` with its UI pointed at its own API (``server_env``: the UI reads
its API URL from the server's ``/ui-settings``, which Prefect fills from ``PREFECT_UI_API_URL``, else
``PREFECT_API_URL``, else the default port 4200, whatever ``--port`` says), waits until the API
answers, then runs the command with ``PREFECT_API_URL`` pointing at it, or serves until stopped.
SIGINT (Ctrl-C), SIGTERM or SIGHUP, or the command ending, stops the command, the server and
everything they started.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flows import ServerStartupTimeout, startup_timeout, startup_timeout_advice

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """A stop signal arrived."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def wait_http(url: str, timeout: float, process: subprocess.Popen, what: str) -> None:
    """Wait until ``url`` answers 200; fail early if ``process`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{what}: {url} did not answer within {timeout:.0f} s")


def server_env(host: str, port: int, env: dict) -> dict:
    """``env`` for a server on ``host:port`` whose UI and clients call its own API."""
    api_url = f"http://{host}:{port}/api"
    return env | {
        "PREFECT_SERVER_API_HOST": host, "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_API_URL": api_url, "PREFECT_UI_API_URL": api_url, "PREFECT_UI_URL": f"http://{host}:{port}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


def start_server(port: int, env: dict, host: str = "127.0.0.1") -> tuple[subprocess.Popen, str]:
    """A ``prefect server start`` child process (its own session) and its API URL, once it answers."""
    env = server_env(host, port, env)
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
        env=env, start_new_session=True,
    )
    try:
        wait_http(f"{env['PREFECT_API_URL']}/health", startup_timeout(), server, "prefect server")
    except BaseException as err:
        stop_server(server)
        if isinstance(err, TimeoutError):
            raise ServerStartupTimeout(startup_timeout_advice(f"prefect server on port {port}")) from err
        raise
    return server, env["PREFECT_API_URL"]


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, whatever session or process group it moved to (/proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def stop_server(process: subprocess.Popen, timeout: float = 20.0) -> None:
    """Stop a child started in its own session (a server, a command) and its process group:
    SIGTERM, then SIGKILL after ``timeout``."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _raise_stopped(signum: int, _frame) -> None:
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4200)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run (none: serve until stopped)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    started: list[subprocess.Popen] = []
    try:
        server, api_url = start_server(args.port, dict(os.environ), args.host)
        started.append(server)
        print(f"Prefect server up: UI http://{args.host}:{args.port}  API {api_url}", flush=True)
        if not command:
            return server.wait()
        # Its own session too: a stop signal reaches it (and the flow runs it starts) from here, once.
        child = subprocess.Popen(command, env=server_env(args.host, args.port, dict(os.environ)), start_new_session=True)
        started.append(child)
        return child.wait()
    except Stopped as stop:
        print(f"{stop}: stopping", file=sys.stderr, flush=True)
        return 128 + stop.signum
    finally:
        for signum in STOP_SIGNALS:  # a second signal must not interrupt the clean-up
            signal.signal(signum, signal.SIG_IGN)
        below = descendants(os.getpid())
        for process in reversed(started):  # the command before the server it talks to
            stop_server(process)
        for pid in below:  # anything that left its process group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    sys.exit(main())
