"""Run a command against a local Prefect server started for it: `make prefect` uses this.

    python -m flows.local_server --port 4200 -- python -m flows.serve

Starts ``prefect server start`` on 127.0.0.1, waits until its API answers, runs the command with
``PREFECT_API_URL`` pointing at it, and stops the server when the command ends (or on Ctrl-C).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request


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


def start_server(port: int, env: dict) -> tuple[subprocess.Popen, str]:
    """A ``prefect server start`` child process and its API URL, once it answers."""
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env, start_new_session=True,
    )
    api_url = f"http://127.0.0.1:{port}/api"
    try:
        wait_http(f"{api_url}/health", 120, server, "prefect server")
    except BaseException:
        stop_server(server)
        raise
    return server, api_url


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4200)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    server, api_url = start_server(args.port, env)
    print(f"Prefect server up: UI http://127.0.0.1:{args.port}  API {api_url}", flush=True)
    try:
        return subprocess.call(command, env={**env, "PREFECT_API_URL": api_url})
    except KeyboardInterrupt:
        return 130
    finally:
        stop_server(server)


if __name__ == "__main__":
    sys.exit(main())
