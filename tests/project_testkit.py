"""A fresh, clone-like copy of the project for tests that run the real monthly flow, and the check that
a command's output says each thing once.

The copy procedure is the flow benchmark's (``bench/flow_bench.py``), so the tests and the
benchmark measure the same thing.
"""

import re
from collections import Counter

from bench.flow_bench import ENV, REPO, copy_project, git  # noqa: F401

MODEL = "inspection-adapter"  # publish.model_name

# What differs between two printings of one message: Prefect's console time ("12:03:04.567 | ") and the
# glog-style prefix torch's own logging writes ("W1202 02:46:02.278000 22791 ").
TIMESTAMPS = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3} \| |[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ )")


def repeated_lines(output: str) -> dict[str, int]:
    """Each non-blank line of ``output`` printed more than once, timestamps aside, with its count."""
    lines = (TIMESTAMPS.sub("", line).rstrip() for line in output.splitlines())
    return {line: n for line, n in Counter(line for line in lines if line.strip()).items() if n > 1}
