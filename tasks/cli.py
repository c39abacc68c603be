"""The one command-line shape every stage shares: ``python -m tasks.<stage> --params FILE``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from runtime.engine.errors import RefusedInput
from tasks.config import ReleaseConfig, StageError, load_config

# Exit code of a refused input or config: distinct from 1, which is a crash (a bug).
EXIT_BAD_INPUT = 2
EXIT_IO_ERROR = 3


def stage_main(description: str, run: Callable[[ReleaseConfig], str], argv: list[str] | None = None) -> int:
    """Load the config, run the stage, print its one-line result or a clear error."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        message = run(load_config(args.params))
    except (StageError, RefusedInput) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as err:  # a full disk, a read-only or missing folder: say which file, not a traceback
        print(f"error: {err.filename or 'output'}: {err.strerror or err}", file=sys.stderr)
        return EXIT_IO_ERROR
    print(message)
    return 0
