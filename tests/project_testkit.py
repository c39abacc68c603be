"""A fresh, clone-like copy of the project for tests that run the real monthly flow.

The copy procedure is the flow benchmark's (``bench/flow_bench.py``), so the tests and the
benchmark measure the same thing.
"""

from bench.flow_bench import ENV, REPO, copy_project, git  # noqa: F401

MODEL = "inspection-adapter"  # publish.model_name
