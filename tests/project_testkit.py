"""A fresh, clone-like copy of the project for tests that run the real monthly flow; the published project
the whole test run shares; and the check that a command's output says each thing once.

The copy procedure is the flow benchmarks' (``bench/lib/flow_project.py``), so the tests and the
benchmark measure the same thing.

The published project is the project after `make release` on the embedded default (params.yaml as
shipped): its DVC outputs, registry, remote, keys, update channel and MLflow store. A test run builds it
once (``published_project``, the first xdist worker to ask, the others wait for it), or takes it from the
checkout when `.ci/run` has just released there from the same tracked files: CI runs `make release`
before `make test`, and the suite would otherwise spend its longest minutes doing it again. Nobody
writes in it: a test copies it (``copy_published``) and changes its copy.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.lib.flow_project import ENV, REPO, copy_project, git  # noqa: F401

MODEL = "inspection-adapter"  # publish.model_name
# What a release adds to the tracked files (the rest of a checkout, .venv among it, is no release's):
# the DVC lock and cache, the stages' outputs, the registry and its remote, the keys, the update channel, MLflow.
RELEASE_OUTPUTS = ("dvc.lock", ".dvc", "data", "models", "engine", "artifacts", "registry", "dvc-remote", "keys",
                   "tuf", "mlflow.db", "mlruns")
# Set by .ci/run: a folder with what its `make release` printed (output.log) and the state of the
# checkout's tracked files it released from (tree, ``tree_state``).
RELEASE_RECORD = "CI_RELEASE_RECORD"
FLOW_TIMEOUT_S = 3000  # a release from scratch: 8-12 min on a quiet 2-core machine, 18-28 min beside other work

# What differs between two printings of one message: Prefect's console time ("12:03:04.567 | ") and the
# glog-style prefix torch's own logging writes ("W1202 02:46:02.278000 22791 ").
TIMESTAMPS = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3} \| |[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ )")


def repeated_lines(output: str) -> dict[str, int]:
    """Each non-blank line of ``output`` printed more than once, timestamps aside, with its count."""
    lines = (TIMESTAMPS.sub("", line).rstrip() for line in output.splitlines())
    return {line: n for line, n in Counter(line for line in lines if line.strip()).items() if n > 1}


@dataclass(frozen=True)
class Published:
    """A project in which `make release` published params.yaml's month from scratch. Read only: copy it
    (``copy_published``) to run anything in it."""

    root: Path
    output: str  # what the release printed, stdout and stderr
    source: str  # where it came from, for failure messages


def tree_state(root: Path = REPO) -> str:
    """The checkout's commit and its tracked files' changes since (dvc.lock aside), hashed: what .ci/run
    records before its release, with the same two git commands."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, check=True).stdout
    diff = subprocess.run(["git", "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", "--", ".",
                           ":(exclude)dvc.lock"], cwd=root, capture_output=True, check=True).stdout
    return hashlib.sha256(head + diff).hexdigest()


def released_checkout() -> tuple[Published | None, str]:
    """The checkout itself, if .ci/run has just published there from the tracked files as they are now;
    else None and why not."""
    folder = os.environ.get(RELEASE_RECORD)
    if not folder:
        return None, f"${RELEASE_RECORD} is not set (.ci/run sets it after its `make release`)"
    record = Path(folder)
    if not (record / "tree").is_file() or not (record / "output.log").is_file():
        return None, f"${RELEASE_RECORD} ({record}) holds no tree and output.log"
    if (record / "tree").read_text().strip() != tree_state():
        return None, "the checkout's tracked files changed since its release"
    output = (record / "output.log").read_text(errors="replace")
    if "published" not in output.splitlines():  # flows.monthly_release prints the outcome: "already published ..."
        return None, "the checkout's release did not publish (its month was published before)"
    return Published(REPO, output, "this checkout's `make release`, recorded by .ci/run"), "released in the checkout"


def build_published(root: Path) -> Published:
    """`make release` in a fresh copy of the project, in ``root``."""
    from service_testkit import run_in_group

    project = copy_project(root / "project")
    start = time.perf_counter()
    done = run_in_group([sys.executable, "-m", "flows.monthly_release", "--params", "params.yaml"], timeout=FLOW_TIMEOUT_S,
                        cwd=project, env=ENV | {"PREFECT_HOME": str(root / "prefect-home")})
    assert done.returncode == 0, f"the release to share did not publish (rc {done.returncode}): {done.stderr[-4000:]}"
    print(f"published project built in {time.perf_counter() - start:.0f} s")
    return Published(project, done.stdout + done.stderr, "built for this test run")


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def published_project(shared: Path) -> Published:
    """The test run's published project: the released checkout, else one built in ``shared`` (a folder every
    xdist worker of the run sees) by the first worker to ask, while the others wait for it."""
    record = shared / "published.json"
    with _locked(shared / "published.lock"):
        if not record.exists():
            published, why = released_checkout()
            try:
                published = published or build_published(shared / "published")
            except BaseException as err:  # the other workers fail at once rather than build it again
                record.write_text(json.dumps({"error": f"{type(err).__name__}: {err}"[-6000:]}))
                raise
            (shared / "published-output.log").write_text(published.output)
            record.write_text(json.dumps({"root": str(published.root), "source": f"{published.source} ({why})"}))
        saved = json.loads(record.read_text())
    assert "error" not in saved, f"building the published project failed in another worker: {saved['error']}"
    return Published(Path(saved["root"]), (shared / "published-output.log").read_text(), saved["source"])


def published_state(published: Published) -> tuple:
    """What a run in a copy would change if it wrote into the published project: its registry's head,
    its DVC remote's files, its MLflow store."""
    root = published.root
    return (git(root / "registry", "rev-parse", "HEAD"),
            sorted(str(p.relative_to(root)) for p in (root / "dvc-remote").rglob("*")),
            hashlib.sha256((root / "mlflow.db").read_bytes()).hexdigest())


def copy_published(published: Published, dest: Path) -> Path:
    """A project of its own in ``dest`` (a git repository of the tracked files, as ``copy_project``) holding
    what ``published`` published, with every absolute path it recorded moved to ``dest``."""
    if published.root == REPO:  # the checkout: its tracked files, then what its release added
        root = copy_project(dest)
        for name in RELEASE_OUTPUTS:
            src = REPO / name
            if src.is_dir():
                shutil.copytree(src, root / name, symlinks=True, dirs_exist_ok=True, ignore=_dvc_tmp)
            elif src.exists():
                shutil.copy2(src, root / name)
    else:  # a copy built for the run holds nothing else
        root = shutil.copytree(published.root, dest, symlinks=True, dirs_exist_ok=True, ignore=_dvc_tmp)
    relocate(root, published.root)
    return root


def _dvc_tmp(folder: str, names: list[str]) -> list[str]:
    """DVC's locks, hash state and indexes (rebuilt on use) stay behind; its cache comes along."""
    return ["tmp"] if Path(folder).name == ".dvc" else []


def relocate(root: Path, old: Path) -> None:
    """Make a project copied from ``old`` to ``root`` name ``root`` wherever it recorded an absolute path,
    so that nothing run in the copy reads or writes the original:

    - the DVC remote, which the project states in .dvc/config.local and the registry in a commit of its
      .dvc/config: the flow's own set-up step, run in the copy, states the copy's (the registry gets a
      commit "registry: DVC remote <the copy's>", as any moved project's does on its next release);
    - MLflow's artifact locations (experiment, runs, model versions) in mlflow.db.
    """
    done = subprocess.run([sys.executable, "-c", "from flows.monthly_release import set_up\n"
                           "from tasks.config import load_config\n"
                           "set_up.fn(load_config('params.yaml'))\n"],
                          cwd=root, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the flow's set-up in the copy of the published project: {done.stderr[-3000:]}"
    old_path, new_path = f"{old}/", f"{root}/"  # every path it recorded lies below the project
    with contextlib.closing(sqlite3.connect(root / "mlflow.db")) as conn, conn:
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for column in [c[1] for c in conn.execute(f'PRAGMA table_info("{table}")')
                           if any(t in c[2].upper() for t in ("CHAR", "TEXT", "CLOB"))]:
                conn.execute(f'UPDATE "{table}" SET "{column}" = replace("{column}", ?, ?) WHERE instr("{column}", ?) > 0',
                             (old_path, new_path, old_path))
