"""The Prefect side: the monthly flow, its deployments, the local server.

Prefect reads its settings from the environment once, when it is imported. Every entry point here
(``python -m flows.<name>``, `make release`, `make prefect`) and every test or benchmark that drives a
flow imports this package first, so the defaults below are set in this one place; a value already
in the environment wins.

``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``: a run without a server starts an ephemeral one
and waits this long for its ``/health``. Prefect's 20 s failed `make release` on 2 cores at load
average 3-4 (other jobs running); the wait polls, so a quiet machine still starts in a few seconds.
``flows.local_server`` gives a real ``prefect server`` the same deadline.

``GOMP_SPINCOUNT=10000``: the stages DVC starts from the flow inherit it, unless the user set it or
``OMP_WAIT_POLICY``. Torch's OpenMP threads otherwise spin 300,000 rounds at each of the thousands of
barriers of a training step, and when the cores are shared the spinning thread takes the time its
partner needs: at load average 12 on 2 cores a base-model step took 22 s with 2 threads (3.7-5.5 s with
1). Spinning briefly keeps both machines' speed: 15 pre-training steps beside two CPU burners took
15.9 s at 10,000 rounds, 14.5 s never spinning (PASSIVE), 26.5 s by default; 60 steps on the quiet
machine 17.6 s, 20.8 s and 17.0 s (interleaved, 2 runs each, 2 Dec 2026).
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
}
for _key, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
OPENMP_SPIN_ROUNDS = "10000"
if "OMP_WAIT_POLICY" not in os.environ:  # a spin count would override the user's policy
    os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_ROUNDS)

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
