"""bench/ by kind over one harness: no benchmark imports another (what they share is bench/lib), and every
benchmark `make bench` runs states its own figures."""

import importlib

from import_graph_testkit import ROOT, imports, module_name

from bench import run_all

KINDS = ("engine", "quality", "serving", "flow")


def test_a_benchmark_imports_of_bench_only_its_lib_and_the_lib_no_benchmark():
    found = {}
    for kind in (*KINDS, "lib"):
        for path in sorted((ROOT / "bench" / kind).glob("*.py")):
            targets = {module for _, module, _ in imports(path) if module == "bench" or module.startswith("bench.")}
            wrong = {t for t in targets if t != "bench.lib" and not t.startswith("bench.lib.")}
            if wrong:
                found[module_name(path)] = sorted(wrong)
    assert found == {}


def test_every_benchmark_make_bench_runs_states_its_figures():
    for bench in run_all.plan(flow_ready=True):
        assert bench.module.split(".")[1] in KINDS, bench.module
        assert callable(importlib.import_module(bench.module).figures), bench.module
