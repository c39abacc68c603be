"""The Prefect side: the monthly flow, its deployments, the local server.

Prefect reads its settings from the environment once, when it is imported. Every entry point here
(``python -m flows.<name>``, `make release`, `make prefect`) and every test or benchmark that drives a
flow imports this package first, so the defaults below are set in this one place; a value already
in the environment wins.

``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``: a run without a server starts an ephemeral one
and waits this long for its ``/health``. Prefect's 20 s failed `make release` on 2 cores at load
average 3-4 (other jobs running); the wait polls, so a quiet machine still starts in a few seconds.
``flows.local_server`` gives a real ``prefect server`` the same deadline.

``OMP_WAIT_POLICY=PASSIVE``: the stages DVC starts from the flow inherit it. Torch's OpenMP threads
otherwise spin at each of the thousands of barriers of a training step, and when the cores are
shared the spinning thread takes the time its partner needs: at load average 12 on 2 cores the base
model's step took 22 s with 2 threads (3.7-5.5 s with 1), 3.6 s with 2 threads waiting passively.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
ENV_DEFAULTS = {
    STARTUP_TIMEOUT_SETTING: "180",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_WAIT_POLICY": "PASSIVE",
}
for _key, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

# The start of Prefect's RuntimeError when its ephemeral server does not answer in time.
_PREFECT_STARTUP_TIMEOUT = "Timed out while attempting to connect to ephemeral Prefect API server"


class ServerStartupTimeout(RuntimeError):
    """A Prefect server did not answer within the start-up deadline; the message names the setting."""


def startup_timeout() -> float:
    """Seconds a Prefect server (ephemeral or ``prefect server start``) may take to answer."""
    return float(os.environ[STARTUP_TIMEOUT_SETTING])


def startup_timeout_advice(what: str) -> str:
    return (f"{what} did not answer within {startup_timeout():.0f} s ({STARTUP_TIMEOUT_SETTING}); "
            "on a busy machine set it higher, e.g. "
            f"{STARTUP_TIMEOUT_SETTING}={2 * startup_timeout():.0f}")


@contextlib.contextmanager
def naming_the_startup_timeout() -> Iterator[None]:
    """Turn Prefect's ephemeral start-up time-out into a ``ServerStartupTimeout`` that names the setting."""
    try:
        yield
    except RuntimeError as err:
        if _PREFECT_STARTUP_TIMEOUT not in str(err):
            raise
        raise ServerStartupTimeout(startup_timeout_advice("Prefect's ephemeral API server")) from err
