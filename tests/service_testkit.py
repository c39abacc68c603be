"""Long-lived services for tests of production mode: free loopback ports, process groups that stop cleanly.

Services (``prefect server``, ``mlflow server``, ``prefect worker``) start in their own process group
(``start_new_session``), so ``stop_group`` ends the process and everything it spawned; ``processes_in``
finds anything still running in a directory (a flow run's process works in the project copy).
The project copy itself comes from ``project_testkit.copy_project``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_in_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=...)`` in a process group of its own,
    which is SIGKILLed when the command ends, times out or the test is interrupted: a flow's ephemeral
    Prefect server and its running stage are children that ``subprocess.run`` would leave running."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start_service(cmd: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """A long-lived child in its own process group, its output in ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _stat(pid: str) -> tuple[str, int] | None:
    """(state, process group) of a live process, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(entry.name)
            if stat is not None and stat[0] != "Z" and stat[1] == pgid:
                out.append(int(entry.name))
    return out


def processes_in(directory: Path) -> list[int]:
    """Live processes (other than this one) whose working directory is ``directory`` or below it."""
    directory, out = Path(directory).resolve(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            continue
        stat = _stat(entry.name)
        if stat is not None and stat[0] != "Z" and (cwd == directory or directory in cwd.parents):
            out.append(int(entry.name))
    return out


def stop_group(process: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM the process group, SIGKILL what is left after ``timeout``; reap the leader."""
    pgid = process.pid

    def signal_group(sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.poll()
        if not group_members(pgid):
            break
        time.sleep(0.2)
    else:
        signal_group(signal.SIGKILL)
    process.wait(timeout=10)


def kill_pids(pids: list[int]) -> None:
    """SIGKILL the process groups of ``pids`` (processes this test started that outlived their parent)."""
    for pid in pids:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_group_when(proc: subprocess.Popen, marker: str, delay: float) -> str:
    """SIGKILL the process group of ``proc`` (started with ``start_new_session`` and text stdout on a pipe)
    ``delay`` s after ``marker`` appears in its output; return the output read until then."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            time.sleep(delay)
            break
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
    assert any(marker in line for line in seen), "".join(seen)[-3000:]
    return "".join(seen)


def live(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are still running (not zombies)."""
    return [pid for pid in pids if (stat := _stat(str(pid))) is not None and stat[0] != "Z"]
