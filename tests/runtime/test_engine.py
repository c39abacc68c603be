"""The compiled ONNX Runtime engine: parity with PyTorch + PEFT, dynamic shapes, adapter swaps."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from engine_testkit import engine_run, make_adapter

from runtime.engine.adapter import load_adapter
from runtime.engine.backends.onnxruntime import OrtEngine
from runtime.engine.backends.torch_eager import TorchEngine
from runtime.engine.engine import Engine, open_engine
from runtime.engine.generate import greedy_generate
from runtime.engine.interface import InterfaceError, read_interface


def hf_logits(model_dir, adapter_dir, ids: np.ndarray) -> np.ndarray:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    with torch.no_grad():
        return model.eval()(torch.from_numpy(ids)).logits.numpy()


@pytest.fixture(scope="module")
def engine(tiny_engine) -> OrtEngine:
    return OrtEngine(tiny_engine, threads=2)


@pytest.fixture(scope="module")
def second_adapter(tiny_qwen, tmp_path_factory):
    return make_adapter(tiny_qwen, tmp_path_factory.mktemp("second"), r=8, alpha=16.0, targets=("v_proj", "o_proj"), seed=5)


def prefill_then_decode(engine, ids: np.ndarray, split: int) -> np.ndarray:
    return engine_run(engine, ids, split)[0]  # the logits of every position


def test_ort_engine_with_adapter_matches_peft_merged_within_1e4(engine, tiny_qwen, qwen_adapter):
    ids = np.random.default_rng(0).integers(0, 96, (2, 12))
    engine.set_adapter(load_adapter(qwen_adapter, engine.interface))

    got = prefill_then_decode(engine, ids, split=7)

    assert isinstance(engine, Engine)
    assert np.abs(got - hf_logits(tiny_qwen, qwen_adapter, ids)).max() <= 1e-4


@pytest.mark.parametrize("batch,prefill", [(1, 1), (2, 4), (2, 9), (3, 17)])
def test_dynamic_batch_and_prefill_lengths_match_the_eager_reference(engine, tiny_qwen, qwen_adapter, batch, prefill):
    lora = load_adapter(qwen_adapter, engine.interface)
    reference = TorchEngine(tiny_qwen, engine.interface, threads=None)
    engine.set_adapter(lora)
    reference.set_adapter(lora)
    ids = np.random.default_rng(prefill).integers(0, 96, (batch, prefill + 3))

    got = prefill_then_decode(engine, ids, split=prefill)
    want = prefill_then_decode(reference, ids, split=prefill)

    assert got.shape == (batch, prefill + 3, 96)
    assert np.abs(got - want).max() <= 1e-4


def test_swapping_adapters_reuses_the_same_session(engine, tiny_qwen, qwen_adapter, second_adapter):
    ids = np.random.default_rng(3).integers(0, 96, (1, 8))
    session = engine.session
    first, second = load_adapter(qwen_adapter, engine.interface), load_adapter(second_adapter, engine.interface)

    engine.set_adapter(first)
    out_first = prefill_then_decode(engine, ids, 5)
    gen_first = greedy_generate(engine, [ids[0].tolist()], 6)
    engine.set_adapter(second)
    out_second = prefill_then_decode(engine, ids, 5)
    gen_second = greedy_generate(engine, [ids[0].tolist()], 6)
    engine.set_adapter(first)
    out_again = prefill_then_decode(engine, ids, 5)

    assert engine.session is session  # no new session, no rebuild
    assert np.abs(out_first - hf_logits(tiny_qwen, qwen_adapter, ids)).max() <= 1e-4
    assert np.abs(out_second - hf_logits(tiny_qwen, second_adapter, ids)).max() <= 1e-4
    assert np.abs(out_first - out_second).max() > 1e-2 and gen_first != gen_second
    assert np.array_equal(out_first, out_again)


def test_no_adapter_runs_the_base_model(engine, tiny_qwen):
    ids = np.random.default_rng(4).integers(0, 96, (1, 6))
    engine.set_adapter(None)
    assert np.abs(prefill_then_decode(engine, ids, 6) - hf_logits(tiny_qwen, None, ids)).max() <= 1e-4


def test_greedy_generation_is_identical_on_engine_eager_batched_and_per_row(engine, tiny_qwen, qwen_adapter):
    lora = load_adapter(qwen_adapter, engine.interface)
    reference = TorchEngine(tiny_qwen, engine.interface, threads=None)
    engine.set_adapter(lora)
    reference.set_adapter(lora)
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32]]

    batched = greedy_generate(engine, prompts, max_new_tokens=12)
    per_row = greedy_generate(engine, prompts, max_new_tokens=12, batch_size=1)
    eager = greedy_generate(reference, prompts, max_new_tokens=12)

    assert batched == per_row == eager
    assert [len(t) for t in batched] == [12, 12, 12]


def test_generation_stops_at_a_stop_token_and_excludes_it(engine, qwen_adapter):
    engine.set_adapter(load_adapter(qwen_adapter, engine.interface))
    prompt = [[3, 14, 15, 92, 65]]
    full = greedy_generate(engine, prompt, max_new_tokens=8)[0]
    stop = full[3]

    stopped = greedy_generate(engine, prompt, max_new_tokens=8, stop_tokens=[stop])[0]

    assert stopped == full[: full.index(stop)]
    assert len(greedy_generate(engine, prompt, max_new_tokens=2)[0]) == 2


def test_lora_inputs_of_the_wrong_shape_are_refused_before_running(engine, qwen_adapter):
    lora = load_adapter(qwen_adapter, engine.interface)
    lora["lora_A.0.q_proj+k_proj+v_proj"] = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match=r"lora_A.0.q_proj\+k_proj\+v_proj has shape \(4, 64\), interface says \(24, 64\)"):
        engine.set_adapter(lora)


def test_edited_interface_is_refused(tiny_engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine, copy)
    spec = json.loads((copy / "interface.json").read_text())
    spec["max_rank"] = 16
    (copy / "interface.json").write_text(json.dumps(spec))
    with pytest.raises(InterfaceError, match="does not match its content"):
        read_interface(copy)


def test_interface_of_another_version_is_refused(tiny_engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine, copy)
    spec = json.loads((copy / "interface.json").read_text()) | {"version": 99}
    (copy / "interface.json").write_text(json.dumps(spec))
    with pytest.raises(InterfaceError, match="interface version 99 but this runtime speaks 3, 6, 7, 8, 9; recompile"):
        open_engine(copy)


def test_graph_that_disagrees_with_its_interface_is_refused(tiny_engine, tmp_path):
    copy = tmp_path / "engine"
    shutil.copytree(tiny_engine, copy)
    from runtime.engine.backends.onnxruntime import OPTIMIZED_ONNX

    (copy / OPTIMIZED_ONNX).unlink()
    shutil.copy(tiny_engine / "model.onnx", copy / "model.onnx")
    spec = json.loads((copy / "interface.json").read_text())
    spec["inputs"] = [t for t in spec["inputs"] if not t["name"].startswith("lora_")]
    spec["target_modules"], spec["module_shapes"] = [], {}
    spec.pop("interface_hash")
    (copy / "interface.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="graph inputs differ from interface.json"):
        OrtEngine(copy)


def test_bound_adapter_is_a_snapshot_not_the_callers_arrays(engine, qwen_adapter):
    lora = load_adapter(qwen_adapter, engine.interface)
    ids = np.random.default_rng(6).integers(0, 96, (1, 5))
    engine.set_adapter(lora)
    before = prefill_then_decode(engine, ids, 5)

    for value in lora.values():
        value[...] = 0.0  # the caller reuses its buffers
    after = prefill_then_decode(engine, ids, 5)

    assert np.array_equal(before, after)


def test_lora_inputs_are_bound_from_one_buffer_in_graph_order(engine, qwen_adapter):
    # One buffer read front to back as the layers run, instead of an allocation per input (measured
    # in runtime/engine/backends/onnxruntime.py: fewer cold-read stalls per token)
    engine.set_adapter(load_adapter(qwen_adapter, engine.interface))
    values = [engine._lora[n] for n in engine.interface.lora_names]
    ends = [v.data_ptr() + v.numpy().nbytes for v in values[:-1]]
    assert [v.data_ptr() for v in values[1:]] == ends


def test_llama_engine_with_tied_embeddings_matches_peft_merged(tiny_llama, tmp_path):
    from tasks.stages.compile import compile_engine

    adapter = make_adapter(tiny_llama, tmp_path / "adapter", r=8, alpha=16.0)
    compile_engine(tiny_llama, tmp_path / "engine", max_rank=8)
    engine = OrtEngine(tmp_path / "engine")
    engine.set_adapter(load_adapter(adapter, engine.interface))
    ids = np.random.default_rng(7).integers(0, 96, (2, 10))

    got = prefill_then_decode(engine, ids, split=6)

    assert np.abs(got - hf_logits(tiny_llama, adapter, ids)).max() <= 1e-4


def test_optimized_graph_keeps_its_initializers_in_a_data_file_that_later_sessions_map(engine, tiny_engine, qwen_adapter,
                                                                                       tmp_path):
    # Given: an engine directory not yet opened
    import onnx

    from runtime.engine.backends import onnxruntime as ort_backend

    copy = tmp_path / "engine"
    copy.mkdir()
    for name in ("model.onnx", "interface.json", "cache_key.json"):
        shutil.copy(tiny_engine / name, copy / name)

    # When: the first session writes the optimized graph, and a second one reads it back
    first = OrtEngine(copy)
    reopened = OrtEngine(copy)

    # Then: the graph and its data file are in place under their final names, nothing else is left
    # behind, the graph reads its large initializers from that file, and every engine computes the same
    assert sorted(p.name for p in copy.iterdir()) == sorted(
        ["model.onnx", "interface.json", "cache_key.json", ort_backend.OPTIMIZED_ONNX, ort_backend.OPTIMIZED_ONNX_DATA])
    graph = onnx.load(str(copy / ort_backend.OPTIMIZED_ONNX), load_external_data=False).graph
    external = {e.value for i in graph.initializer for e in i.external_data if e.key == "location"}
    assert external == {ort_backend.OPTIMIZED_ONNX_DATA}
    assert (copy / ort_backend.OPTIMIZED_ONNX_DATA).stat().st_size > 0
    ids = np.random.default_rng(7).integers(0, 96, (2, 6))
    for e in (engine, first, reopened):
        e.set_adapter(load_adapter(qwen_adapter, e.interface))
    want = prefill_then_decode(engine, ids, 4)  # the shared engine, opened on its own saved graph
    np.testing.assert_array_equal(prefill_then_decode(first, ids, 4), want)
    np.testing.assert_array_equal(prefill_then_decode(reopened, ids, 4), want)


def test_an_optimized_graph_saved_inline_by_an_earlier_runtime_is_saved_again_with_its_data_file(
        engine, tiny_engine, qwen_adapter, tmp_path):
    # Given: an engine directory whose optimized graph holds its weights inline, as runtimes before the data
    # file saved it (a session opened on it copies every weight onto its heap)
    import onnx
    import onnxruntime as ort

    from runtime.engine.backends import onnxruntime as ort_backend

    copy = tmp_path / "engine"
    copy.mkdir()
    for name in ("model.onnx", "interface.json", "cache_key.json"):
        shutil.copy(tiny_engine / name, copy / name)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.optimized_model_filepath = str(copy / ort_backend.OPTIMIZED_ONNX)
    ort.InferenceSession(str(copy / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    assert not (copy / ort_backend.OPTIMIZED_ONNX_DATA).exists()

    # When: the engine is opened
    reopened = OrtEngine(copy)

    # Then: the graph was saved again, reading its weights from the data file, and computes as before
    graph = onnx.load(str(copy / ort_backend.OPTIMIZED_ONNX), load_external_data=False).graph
    assert {e.value for i in graph.initializer for e in i.external_data if e.key == "location"} == \
        {ort_backend.OPTIMIZED_ONNX_DATA}
    ids = np.random.default_rng(8).integers(0, 96, (2, 6))
    for e in (engine, reopened):
        e.set_adapter(load_adapter(qwen_adapter, e.interface))
    np.testing.assert_array_equal(prefill_then_decode(reopened, ids, 4), prefill_then_decode(engine, ids, 4))


def test_logits_at_selected_positions_equal_the_full_logits_there_on_engine_and_reference(engine, tiny_qwen, qwen_adapter):
    """Interface version 8: the LM head runs on the selected positions only, with the same logits."""
    lora = load_adapter(qwen_adapter, engine.interface)
    engine.set_adapter(lora)
    reference = TorchEngine(tiny_qwen, engine.interface, threads=None)
    reference.set_adapter(lora)
    ids = np.random.default_rng(3).integers(0, 96, (2, 9))
    pos, mask = np.broadcast_to(np.arange(9), (2, 9)), np.ones((2, 9), np.int64)
    picked = np.array([[8, 0, 4], [3, 3, 7]])

    full, _ = engine.forward(ids, pos, mask, None)
    got, _ = engine.forward(ids, pos, mask, None, picked)
    eager, _ = reference.forward(ids, pos, mask, None, picked)

    assert engine.interface.version == 8 and engine.interface.logit_positions
    assert full.shape == (2, 9, engine.interface.vocab_size) and got.shape == (2, 3, engine.interface.vocab_size)
    want = np.take_along_axis(full, picked[:, :, None], axis=1)
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(eager - want).max() <= 1e-4


def test_an_engine_without_logit_positions_keeps_its_hash_and_its_adapters_bind_to_the_new_one(engine, tiny_qwen):
    from runtime.engine.interface import build_interface
    from runtime.engine.model import read_config

    iface = engine.interface
    older = build_interface(read_config(tiny_qwen), iface.backbone_hash, iface.max_rank, iface.target_modules)
    assert "logit_positions" not in older.to_dict() and older.version == 3
    assert iface.float_interface_hash == older.interface_hash != iface.interface_hash
    assert [t.name for t in iface.inputs] == [t.name for t in older.inputs] + ["logit_positions"]


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_a_prefill_in_chunks_through_the_cache_gives_the_whole_prefills_logits_and_cache(engine, qwen_adapter, chunk):
    from runtime.engine.generate import left_padded, prefill

    engine.set_adapter(load_adapter(qwen_adapter, engine.interface))
    prompts = [[5, 9, 17, 33, 2, 41, 8], [60, 3, 12]]  # left-padded: the short row's first chunks are padding only
    ids, pos, mask = left_padded(prompts)

    whole, whole_cache = prefill(engine, ids, pos, mask)
    got, cache = prefill(engine, ids, pos, mask, chunk)

    assert got.shape == whole.shape == (2, 1, engine.interface.vocab_size)
    assert np.abs(got - whole).max() <= 1e-4
    for a, b in zip(engine.cache_to_numpy(cache), engine.cache_to_numpy(whole_cache)):
        assert np.abs(a - b)[mask.astype(bool)[:, None, :, None].repeat(a.shape[1], 1).repeat(a.shape[3], 3)].max() <= 1e-4
    with pytest.raises(ValueError, match="prefill chunk must be >= 1 token"):
        prefill(engine, ids, pos, mask, 0)


def test_every_memory_mode_computes_the_same_and_the_freeing_ones_fix_glibcs_mmap_threshold(
        engine, tiny_engine, qwen_adapter, monkeypatch):
    # Given: the engine opened in each way ONNX Runtime can hold its intermediate tensors
    from runtime.engine.backends import onnxruntime as ort_backend

    fixed = []
    monkeypatch.setattr(ort_backend, "_unmap_large_blocks_when_freed", lambda: fixed.append(True))
    ids = np.random.default_rng(3).integers(0, 96, (2, 9))
    engine.set_adapter(load_adapter(qwen_adapter, engine.interface))
    want = prefill_then_decode(engine, ids, 5)

    for mode in ort_backend.ORT_MEMORY_MODES:
        fixed.clear()
        # When: it runs a prefill and decode steps
        other = OrtEngine(tiny_engine, threads=2, memory=mode)
        other.set_adapter(load_adapter(qwen_adapter, other.interface))
        got = prefill_then_decode(other, ids, 5)

        # Then: the same logits, and only the modes that free memory ask glibc to unmap it when freed
        np.testing.assert_array_equal(got, want, err_msg=mode)
        assert fixed == ([] if mode == "arena" else [True]), mode


# Run in a fresh interpreter: the threshold is process-wide. A freed 8 MiB mapped block raises glibc's threshold to
# 8 MiB; a 4 MiB block then comes from the heap, which keeps it once freed, unless the threshold was fixed first.
_KEPT_AFTER_FREE = """
import sys
import numpy as np
from runtime.engine.backends import onnxruntime as ort_backend

def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) * 1024

if sys.argv[1] == "fixed":
    ort_backend._unmap_large_blocks_when_freed()
big = np.ones(8 << 20, dtype=np.uint8)
del big
before = rss()
block = np.ones(4 << 20, dtype=np.uint8)
spacer = np.ones(64 << 10, dtype=np.uint8)  # above the block on the heap: keeps glibc from trimming the heap's top
del block
print(rss() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc on Linux only")
def test_a_fixed_mmap_threshold_hands_a_freed_4_mib_block_back_to_the_system():
    def kept(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _KEPT_AFTER_FREE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout)

    assert kept("glibc default") >= 3 << 20  # what the heap kept of the 4 MiB block
    assert kept("fixed") < 1 << 20



# Run in a fresh interpreter: a session's maps stay while it lives, and the advice covers every map of the file.
# ORT's own session on the saved graph maps the weights; a byte of each of their pages is read (as opening a
# session reads the scales it repacks); then the engine opens. Prints every map of the weights file, flags and
# resident kB, after the read and after the engine opened.
_MAPPED_WEIGHTS = """
import ctypes, json, sys
from pathlib import Path
import onnxruntime as ort
from runtime.engine.backends.onnxruntime import OPTIMIZED_ONNX, OPTIMIZED_ONNX_DATA, OrtEngine

engine_dir = Path(sys.argv[1])
target = str((engine_dir / OPTIMIZED_ONNX_DATA).resolve())

def maps():
    found, inside = [], False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and ":" not in head[0]:  # a mapping's first line
            inside = len(head) >= 6 and head[5] == target
            if inside:
                found.append({"range": [int(a, 16) for a in head[0].split("-")]})
        elif inside and head[0] == "Rss:":
            found[-1]["rss_kb"] = int(head[1])
        elif inside and head[0] == "VmFlags:":
            found[-1]["flags"] = head[1:]
    return found

plain = ort.InferenceSession(str(engine_dir / OPTIMIZED_ONNX), providers=["CPUExecutionProvider"])
for m in maps():
    for page in range(m["range"][0], m["range"][1], 4096):
        ctypes.string_at(page, 1)
print(json.dumps(maps()))
engine = OrtEngine(engine_dir, threads=2)
print(json.dumps(maps()))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_an_opened_engine_reads_its_mapped_weights_file_by_the_page_and_keeps_none_read_before(engine, tiny_engine):
    # engine: the optimized graph and its data file are saved
    out = subprocess.run([sys.executable, "-c", _MAPPED_WEIGHTS, str(tiny_engine)], capture_output=True, text=True,
                         check=True)
    plain, after = (json.loads(line) for line in out.stdout.splitlines())
    assert plain and all("rr" not in m["flags"] for m in plain)  # ORT's own maps of the weights
    assert sum(m["rss_kb"] for m in plain) >= 4 * len(plain)  # every page read is resident
    assert len(after) > len(plain) and all("rr" in m["flags"] for m in after)  # MADV_RANDOM: no read-ahead
    assert sum(m["rss_kb"] for m in after) == 0  # MADV_PAGEOUT: what was read before is no longer resident


# Run in a fresh interpreter: glibc's arenas are process-wide. Opens the engine (or not), then lets a new thread
# allocate 64 KiB (under the mmap threshold: from an arena) and prints how many arenas that added (malloc_info).
_ARENAS_A_THREAD_ADDS = """
import ctypes, re, sys, tempfile, threading
from runtime.engine.backends.onnxruntime import OrtEngine, _glibc

libc = _glibc()
libc.fopen.restype = ctypes.c_void_p
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]

def arenas():
    with tempfile.NamedTemporaryFile("r") as f:
        stream = libc.fopen(f.name.encode(), b"w")
        libc.malloc_info(0, stream)
        libc.fclose(stream)
        return len(re.findall(r'<heap nr="', f.read()))

if sys.argv[1] != "no engine":
    engine = OrtEngine(sys.argv[1], threads=2)
before = arenas()
thread = threading.Thread(target=lambda: bytearray(64 << 10))
thread.start()
thread.join()
print(arenas() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status") or platform.libc_ver()[0] != "glibc",
                    reason="glibc's malloc on Linux only")
def test_threads_of_a_process_with_an_open_engine_allocate_from_the_one_heap(tiny_engine):
    def arenas_added(engine: str) -> int:
        out = subprocess.run([sys.executable, "-c", _ARENAS_A_THREAD_ADDS, engine], capture_output=True, text=True,
                             check=True)
        return int(out.stdout)

    assert arenas_added("no engine") == 1  # glibc's default: a new thread gets an arena of its own
    assert arenas_added(str(tiny_engine)) == 0


# Run in a fresh interpreter: its peak resident set is this graph's alone.
_PEAK_OF_A_LAYER_CHAIN = """
import sys, tempfile
from pathlib import Path
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto, helper
from runtime.engine.backends.onnxruntime import _graph_outputs_when_ready, _unmap_large_blocks_when_freed

def status(key):
    return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith(key))

# 24 layers, each making a 2 MiB tensor that only a graph output's node reads (a layer's present and the slice
# of its new slots), in ORT's saved order: every graph output's node last
layers, nodes, h = 24, [], "x"
for i in range(layers):
    nodes += [helper.make_node("Expand", [h, "shape"], [f"present{i}"]), helper.make_node("Relu", [h], [f"h{i}"])]
    h = f"h{i}"
nodes += [helper.make_node("ReduceMax", [f"present{i}"], [f"new{i}"], keepdims=0) for i in range(layers)]
outputs = [helper.make_tensor_value_info(f"new{i}", TensorProto.FLOAT, None) for i in range(layers)]
graph = helper.make_graph(nodes, "layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024]),
                          helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                          outputs + [helper.make_tensor_value_info(h, TensorProto.FLOAT, None)])
path = Path(tempfile.mkdtemp()) / "graph.onnx"
onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
if sys.argv[1] == "outputs when ready":
    _graph_outputs_when_ready(path)
_unmap_large_blocks_when_freed()  # a freed tensor leaves the process
opts = ort.SessionOptions()
opts.enable_cpu_mem_arena = False
opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED  # the engine's: the file's order
opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
feed = {"x": np.ones((1, 1024), np.float32), "shape": np.array([512, 1024])}
session.run(None, feed)
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak starts again from here
session.run(None, feed)
print(status("VmHWM") - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets Linux's peak resident set")
def test_a_graph_with_its_outputs_computed_when_ready_frees_each_layers_tensor_after_that_layer():
    def peak(order: str) -> int:
        out = subprocess.run([sys.executable, "-c", _PEAK_OF_A_LAYER_CHAIN, order], capture_output=True, text=True,
                             check=True)
        return int(out.stdout)

    assert peak("ORT's saved order") > 40 << 20  # all 24 tensors of 2 MiB alive at the end
    assert peak("outputs when ready") < 8 << 20  # one or two at a time


@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_an_int4_matmul_row_rounds_the_same_in_any_company_unless_it_is_left_unpaired(accuracy_level):
    """ONNX Runtime's MatMulNBits (every projection of the int4 and int8 engines) gives a row the same floats in any
    company and at any position, with one exception: at accuracy level 4 (int8 compute, the serving default) rows go
    through the kernel in pairs, and the row left over by an odd row count (a lone row included) takes a single-row
    kernel whose sums round otherwise. At level 0 only a lone row does. So a batched decode on an int4 engine can
    differ from the same row decoded alone in a near tie, by which rows happen to share its steps (kv_tiers_bench's
    batched answers, docs/device.md). Padding every odd batch to even would remove that, at about twice a lone row's
    matmul time (measured 29 against 72 us at 896 x 4,864, 2 threads)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    K, N, block = 256, 192, 128
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, size=(N, K // block, block // 2), dtype=np.uint8)
    scales = (rng.random(N * K // block, dtype=np.float32) * 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", N])],
                              [helper.make_tensor("w", TensorProto.UINT8, codes.shape, codes.tobytes(), raw=True),
                               helper.make_tensor("s", TensorProto.FLOAT, scales.shape, scales)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((8, K), dtype=np.float32)
    company = session.run(None, {"x": x})[0]  # (8, N): every row paired
    for start, stop in ((0, 2), (3, 5), (1, 7), (5, 8), (1, 8)):
        out = session.run(None, {"x": x[start:stop]})[0]
        unpaired = (stop - start) % 2 if accuracy_level == 4 else 0
        assert np.array_equal(out[: stop - start - unpaired], company[start : stop - unpaired])  # bit for bit
    alone = np.stack([session.run(None, {"x": x[i : i + 1]})[0][0] for i in range(8)])
    assert not np.array_equal(alone, company)  # summed in another order...
    np.testing.assert_allclose(alone, company, rtol=0, atol=1e-4)  # ...the same products
