"""The DVC side of a release: set-up, the params file DVC reads, and one stage at a time.

``dvc.yaml`` is the record of lineage: each stage names its code, its ``params.yaml`` keys, its
outputs and metrics, so ``dvc repro`` alone reproduces a release and recomputes only what
changed. The Prefect flow drives the same stages one by one through ``reproduce_stage`` (DVC
holds one repository lock, so never two at once) and reads back whether each stage ran.

A run triggered with other parameters (from the Prefect UI, say) must reach DVC through
``params.yaml``: ``write_params_file`` rewrites only the values that differ, in place (a ruamel.yaml
round trip), so the file keeps its comments and layout and a diff shows exactly what the run changed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from runtime.engine.atomic_files import atomic_write
from tasks.config import ReleaseConfig, StageError, changed_settings, dotted, parse_config
from tasks.progress import PROGRESS_ENV, ProgressReader

DVC_ENV = {"DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
DVC_LOGGERS = ("dvc", "dvc_objects", "dvc_data")
DVC_STAGE_START_LOGGER = "dvc.stage.run"  # logs "Running stage 'x':" and "> its command"
REMOTE_NAME = "storage"
PARAMS_FILE = "params.yaml"  # what dvc.yaml's stages read


class PipelineError(StageError):
    """A DVC stage that failed, or a repository the pipeline cannot run in."""


@dataclass(frozen=True)
class StageRun:
    name: str
    reproduced: bool  # False: DVC found the stage up to date and ran nothing
    seconds: float
    started: float  # wall clock (Unix seconds) when the stage began and ended
    ended: float
    outputs: tuple[str, ...] = ()  # what it wrote (its dvc.yaml outs, metrics and plots); () when up to date

    def describe(self) -> str:
        """One line for the flow's log: name, what happened, wall time, what it wrote."""
        if not self.reproduced:
            return f"{self.name}: up to date ({self.seconds:.1f} s)"
        return f"{self.name}: ran in {self.seconds:.1f} s, wrote {', '.join(self.outputs) or 'nothing'}"


def stage_names(root: Path) -> list[str]:
    """The stages of ``dvc.yaml``, in the order they are written (which is the order they run)."""
    stages = yaml.safe_load((Path(root) / "dvc.yaml").read_text()).get("stages") or {}
    return list(stages)


def _env() -> None:
    os.environ.update(DVC_ENV)
    _dvc_logs_once()
    # Stage commands run `python -m tasks.<stage>`: the interpreter running the pipeline must be first.
    bindir = str(Path(os.sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")


def _dvc_logs_once() -> None:
    """DVC's messages in this process, each once: where a stage begins, warnings and errors.

    ``import dvc`` gives its loggers the console handlers of its CLI, and they also propagate to the
    root logger, where Prefect's console handler prints them a second time. Only the root's path is
    kept (Prefect's console under the flow; Python's last-resort stderr handler elsewhere). Of DVC's
    information, "Running stage 'x':" and the stage's command stay (a stage runs for minutes; the fault
    tests wait for that line); its lock-file, skip and push chatter goes, since the flow logs one line
    per stage instead (``StageRun.describe``). ``dvc repro`` on the command line is its own process.
    """
    from dvc.logger import LoggerHandler

    for name in DVC_LOGGERS:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, LoggerHandler)]:
            logger.removeHandler(handler)
        logger.setLevel(logging.WARNING)
    logging.getLogger(DVC_STAGE_START_LOGGER).setLevel(logging.INFO)


def remote_url(root: Path, remote: str) -> str:
    """``publish.remote_dir`` as DVC takes it: a URL (``s3://bucket/path``) unchanged, a folder made
    absolute against ``root`` and created."""
    if "://" in str(remote):
        return str(remote)
    path = Path(remote)
    path = (path if path.is_absolute() else Path(root) / path).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def ensure_dvc_repo(root: Path, remote_dir: str) -> str:
    """Make ``root`` a DVC repository with ``remote_dir`` as its default remote; return the remote URL.

    The remote is recorded in ``.dvc/config.local`` (not committed): its path is this machine's.
    """
    from dvc.repo import Repo

    _env()
    root = Path(root).resolve()
    if not (root / ".git").exists():
        raise PipelineError(f"{root} is not a git repository: DVC records lineage in git (run `git init` first)")
    if not (root / ".dvc").exists():
        Repo.init(str(root))
    remote = remote_url(root, remote_dir)
    with Repo(str(root)) as repo:
        with repo.config.edit("local") as conf:
            conf.setdefault("remote", {})[REMOTE_NAME] = {"url": remote}
            conf.setdefault("core", {})["remote"] = REMOTE_NAME
    return remote


def reproduce_stage(root: Path, name: str, force: bool = False,
                    on_progress: Callable[[dict], None] | None = None) -> StageRun:
    """Run one stage if its dependencies changed (or ``force``); never its upstream stages.

    ``on_progress`` receives the stage's progress records (``tasks/progress.py``) while it runs,
    from another thread; the stage's command inherits ``RELEASE_PROGRESS_FILE`` from this process.
    """
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    _env()
    started, start = time.time(), time.perf_counter()
    reader = None
    if on_progress is not None:
        reader = ProgressReader(Path(root) / ".dvc" / "tmp" / "progress" / f"{name}.jsonl", on_progress)
        os.environ[PROGRESS_ENV] = str(reader.path.resolve())
    try:
        with contextlib.chdir(root), Repo(str(root)) as repo:  # DVC resolves stage paths against the cwd
            # Not its advice to `git add dvc.lock` / set core.autostage after each stage: the flow commits
            # nothing in the project, and autostage would stage files a release must leave unstaged.
            repo.scm_context.quiet = True
            ran = repo.reproduce(targets=[name], single_item=True, force=force)
            outputs = tuple(out.def_path for stage in ran for out in stage.outs)
    except DvcException as err:
        cause = err.__cause__ or err
        raise PipelineError(f"DVC stage '{name}' failed: {cause}") from err
    finally:
        if reader is not None:
            os.environ.pop(PROGRESS_ENV, None)
            reader.close()
    return StageRun(name, bool(ran), time.perf_counter() - start, started, time.time(), outputs)


def push_outputs(root: Path) -> int:
    """Push every cached pipeline output to the default remote; return the number of files sent."""
    from dvc.repo import Repo

    _env()
    with contextlib.chdir(root), Repo(str(root)) as repo:
        return repo.push()


# ---------------------------------------------------------------- params.yaml, edited in place

def _round_trip_yaml():
    """ruamel.yaml in round-trip mode, set to write this project's layout back unchanged."""
    from ruamel.yaml import YAML

    rt = YAML()
    rt.preserve_quotes = True
    rt.width = 4096  # never fold a long line
    rt.indent(mapping=2, sequence=4, offset=2)  # block lists as `  key:` then `    - item`
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return rt


def _set_list(seq, values: list) -> None:
    """Make the list ``seq`` hold ``values`` item by item, so its style and the comments on kept items stay.

    ruamel.yaml keeps the lines that follow a block list (blank lines, comments) in the comment token of
    its last item: they move to the new last item."""
    import copy

    tokens = seq.ca.items
    last = tokens.get(len(seq) - 1, [None])[0] if seq else None
    after = ""
    if last is not None:
        eol, _, after = last.value.partition("\n")  # the item's own comment, then the lines after the list
        if eol:
            last.value = eol + "\n"
        else:
            del tokens[len(seq) - 1]
    for index in range(len(values), len(seq)):
        tokens.pop(index, None)
    del seq[len(values):]
    for index, value in enumerate(values):
        if index == len(seq):
            seq.append(value)
        elif seq[index] != value:
            seq[index] = value
    if after and seq:
        end = tokens.get(len(seq) - 1, [None])[0]
        if end is None:
            end = copy.copy(last)
            end.value = "\n"
            tokens[len(seq) - 1] = [end, None, None, None]
        end.value += after


def _set_value(doc, key: str, value) -> None:
    from ruamel.yaml.comments import CommentedMap, CommentedSeq
    from ruamel.yaml.scalarstring import ScalarString

    *parents, leaf = key.split(".")
    node = doc
    for part in parents:
        if not isinstance(node.get(part), CommentedMap):
            node[part] = CommentedMap()
        node = node[part]
    old = node.get(leaf)
    if isinstance(old, CommentedSeq) and isinstance(value, list):
        _set_list(old, value)
    elif isinstance(old, ScalarString) and isinstance(value, str):
        node[leaf] = type(old)(value)  # "2026-11" stays double-quoted
    else:
        node[leaf] = value


def write_params_file(cfg: ReleaseConfig, path: Path) -> list[str]:
    """Make ``path`` state ``cfg``: set the values that differ (ruamel.yaml round trip), add the keys it lacks.

    Comments, quoting, flow or block style and every other line are kept. Returns the dotted keys that
    changed. The result is read back and must parse to ``cfg``, or nothing is written.
    """
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    if text:
        changed = changed_settings(cfg, parse_config(yaml.safe_load(text) or {}, str(path)))
    else:  # DVC reads every key it tracks from the file: state them all
        changed = dotted(cfg.model_dump(mode="json"))
    if not changed:
        return []
    rt = _round_trip_yaml()
    doc = rt.load(text)
    if doc is None:  # an empty file
        from ruamel.yaml.comments import CommentedMap

        doc = CommentedMap()
    for key, value in changed.items():
        _set_value(doc, key, value)
    out = io.StringIO()
    rt.dump(doc, out)
    new_text = out.getvalue()
    if parse_config(yaml.safe_load(new_text) or {}, str(path)) != cfg:
        raise PipelineError(f"{path}: could not write the run's parameters without changing its meaning")
    atomic_write(path, new_text.encode())
    return list(changed)


@contextlib.contextmanager
def release_lock(root: Path) -> Iterator[None]:
    """One release run per project at a time; a second is refused at once, naming the first.

    An OS lock (flock): it dies with its process, so a killed run never blocks the next one.
    """
    import fcntl

    path = Path(root) / ".dvc" / "tmp" / "release.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            raise PipelineError(f"another release run holds {path} ({fh.read().strip() or 'unknown'}); "
                                "runs of one project take turns: retry when it has finished") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def params_for_run(cfg: ReleaseConfig, path: Path) -> Iterator[list[str]]:
    """``path`` states ``cfg`` for the duration of a run, then is put back as it was.

    A run triggered with other parameters must not leave them behind for the next `make release`;
    ``dvc.lock`` keeps what this run used, so ``dvc status`` then shows the difference. The file
    as it was waits in a hidden sibling while the run lasts: a run that was killed is undone by
    the next one (callers hold ``release_lock``, so no live run owns that copy).
    """
    path = Path(path)
    saved = path.with_name(f".{path.name}.before-run")
    if saved.exists():
        os.replace(saved, path)
    before = path.read_text() if path.exists() else None
    if before is not None:  # whole or absent, even if killed while writing it: it is what the next run restores
        atomic_write(saved, before.encode())
    try:
        changed = write_params_file(cfg, path)
        yield changed
    finally:
        if saved.exists():
            os.replace(saved, path)
