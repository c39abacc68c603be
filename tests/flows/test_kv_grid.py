"""The KV-quality grid on a Dask LocalCluster (2 workers) equals the sequential computation.

Given a tiny Llama with a LoRA adapter, calibration rows and held-out text,
when flows.kv_grid runs the calibration and perplexity grid as Prefect tasks on a DaskTaskRunner
(a LocalCluster of 2 single-threaded workers),
then every perplexity and byte count is the one the evaluate stage's functions compute one after another,
and both Dask workers ran tasks.

The workers are threads here (processes=False): worker processes would import torch and transformers
again (about 15 s more on 2 cores); ``python -m flows.kv_grid`` uses processes by default, and
``--address`` a remote scheduler, with the same task code.
"""

import random

import pytest
import torch
from engine_testkit import make_adapter

from kernels.kv_spec import PRE_ROPE_SCHEME

pytest.importorskip("prefect_dask")


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """The tasks set torch's thread count, and threaded workers share this process's: restore it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def release(tiny_llama_dir, tmp_path_factory):
    from tasks.inspection import rulebook, sample_examples
    from tasks.records import write_jsonl

    root = tmp_path_factory.mktemp("kv-grid")
    adapter = make_adapter(tiny_llama_dir, root / "adapter")
    rows = sample_examples(rulebook("2026-11", 1234, 2), 48, random.Random(0))
    write_jsonl(root / "calib.jsonl", rows[:24])
    (root / "heldout.txt").write_text("\n".join(ex.prompt + ex.completion for ex in rows[24:]) + "\n")
    return {"base_dir": str(tiny_llama_dir), "adapter_dir": str(adapter), "calib_jsonl": str(root / "calib.jsonl"),
            "heldout_txt": str(root / "heldout.txt")}


def sequential(release: dict, both_ropes: bool) -> dict:
    """What tasks/kv_quality.release_kv_quality computes for its grid, in this process, one config after another."""
    from pathlib import Path

    from flows.kv_grid import grid_configs
    from kernels.kv_spec import bytes_per_token
    from tasks.checks.kv_quality import heldout_sequences, suffix_perplexity
    from tasks.kv_stats import (
        DEFAULT_CLIP_PERCENTILE,
        collect_kv_stats,
        jsonl_batches,
        load_release_backbone,
        scales_from_stats,
    )
    from tasks.models import load_tokenizer

    torch.set_num_threads(1)
    backbone, _, _ = load_release_backbone(Path(release["base_dir"]), Path(release["adapter_dir"]))
    tokenizer = load_tokenizer(Path(release["base_dir"]))
    batches, _ = jsonl_batches(tokenizer, Path(release["calib_jsonl"]), 16, 96)
    docs = heldout_sequences(tokenizer, Path(release["heldout_txt"]).read_text().splitlines())
    stats = {pre: collect_kv_stats(backbone, batches, pre, DEFAULT_CLIP_PERCENTILE, progress=False) for pre in (True, False)}
    cfg, context_len = backbone.cfg, max(len(d) for d in docs)
    out = {}
    for name, spec in grid_configs(PRE_ROPE_SCHEME, both_ropes).items():
        scales = None if spec is None else scales_from_stats(stats[spec.pre_rope_keys], spec)
        out[name] = (suffix_perplexity(backbone, docs, spec, scales),
                     bytes_per_token(spec, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, context_len))
    return out


def test_the_kv_grid_on_a_dask_local_cluster_equals_the_sequential_computation(release):
    from prefect.testing.utilities import prefect_test_harness

    from flows.kv_grid import dask_runner, run_grid

    with prefect_test_harness(server_startup_timeout=None):  # None: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        result = run_grid(dask_runner(workers=2, processes=False), spec=PRE_ROPE_SCHEME.to_dict(), both_ropes=True,
                          **release)

    expected = sequential(release, both_ropes=True)
    got = {row["name"]: (row["perplexity"], row["bytes_per_token"]) for row in result["grid"]}
    assert set(got) == set(expected) and len(got) == 9  # float + 4 specs x 2 RoPE placements
    for name, (ppl, bpt) in expected.items():
        assert got[name][0] == pytest.approx(ppl, rel=1e-6), name
        assert got[name][1] == bpt, name
    rows = {row["name"]: row for row in result["grid"]}
    assert rows["float"]["ppl_increase_pct"] == 0.0 and rows["float"]["compression_vs_fp16"] == 1.0
    assert rows["K2/V2"]["compression_vs_fp16"] > rows["K8/V8"]["compression_vs_fp16"] > 1.0
    assert len(result["workers"]) == 2 and all(w.startswith("inproc://") for w in result["workers"])  # both workers ran tasks
