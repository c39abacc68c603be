"""The KV-quality grid on a Dask LocalCluster (2 workers) equals the sequential computation.

Given a tiny Llama with a LoRA adapter and held-out text,
when flows.kv_grid scores the release's quantized pages at every width as Prefect tasks on a DaskTaskRunner
(a LocalCluster of 2 single-threaded workers),
then every KL, perplexity and stored size is the one the evaluate stage's functions compute one after another,
and both Dask workers ran tasks.

The workers are threads here (processes=False): worker processes would import torch and transformers
again (about 15 s more on 2 cores); ``python -m flows.kv_grid`` uses processes by default, and
``--address`` a remote scheduler, with the same task code.
"""

import random

import pytest
import torch
from engine_testkit import make_adapter

from kernels.kv_spec import PageQuantSpec

pytest.importorskip("prefect_dask")

PAGES = PageQuantSpec(k_bits=4, v_bits=3, v_group_size=8)  # the tiny Llama's heads are 8 channels
BLOCK = 8  # the rows are ~40 tokens: their second halves read sealed pages


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """The tasks set torch's thread count, and threaded workers share this process's: restore it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def release(tiny_llama_dir, tmp_path_factory):
    from tasks.inspection import rulebook, sample_examples

    root = tmp_path_factory.mktemp("kv-grid")
    adapter = make_adapter(tiny_llama_dir, root / "adapter")
    rows = sample_examples(rulebook("2026-11", 1234, 2), 24, random.Random(0))
    (root / "heldout.txt").write_text("\n".join(ex.prompt + ex.completion for ex in rows) + "\n")
    return {"base_dir": str(tiny_llama_dir), "adapter_dir": str(adapter), "heldout_txt": str(root / "heldout.txt")}


def sequential(release: dict) -> dict:
    """What tasks.checks.page_quality.release_page_quality computes for its grid, in this process, one width after
    another: {name: summary}."""
    from pathlib import Path

    from tasks.checks.page_quality import grid_widths, heldout_sequences, score_document, summarize
    from tasks.models import load_release_backbone, load_tokenizer

    torch.set_num_threads(1)
    backbone, _, _ = load_release_backbone(Path(release["base_dir"]), Path(release["adapter_dir"]))
    docs = heldout_sequences(load_tokenizer(Path(release["base_dir"])), Path(release["heldout_txt"]).read_text().splitlines())
    return {name: summarize([score_document(backbone, ids, spec, BLOCK, len(ids) // 2)[0] for ids in docs])
            for name, spec in grid_widths(PAGES).items()}


def test_the_kv_grid_on_a_dask_local_cluster_equals_the_sequential_computation(release):
    from prefect.testing.utilities import prefect_test_harness

    from flows.kv_grid import dask_runner, run_grid

    with prefect_test_harness(server_startup_timeout=None):  # None: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
        result = run_grid(dask_runner(workers=2, processes=False), pages=PAGES.to_dict(), block_size=BLOCK, **release)

    expected = sequential(release)
    rows = {row["name"]: row for row in result["grid"]}
    assert list(rows) == ["K8/V8", "K4/V4", "release", "K3/V3", "K2/V2"]  # by mean bits: the release is K4/V3
    for name, summary in expected.items():
        for key in ("kl_mean", "perplexity_float_cache", "perplexity_quantized_cache", "tokens"):
            assert rows[name][key] == pytest.approx(summary[key], rel=1e-6), (name, key)
    assert 0 < rows["K8/V8"]["kl_mean"] < rows["K4/V4"]["kl_mean"] < rows["K2/V2"]["kl_mean"]
    assert rows["K2/V2"]["stored_bits_per_value"] < rows["K8/V8"]["stored_bits_per_value"]
    assert len(result["workers"]) == 2 and all(w.startswith("inproc://") for w in result["workers"])  # both workers ran tasks
