"""ONNX Runtime backend: CPU provider, every graph optimization, threads configurable.

The first session on an engine directory saves its optimized graph (``model.ort-<version>.outputs-early.onnx``,
its initializers in a ``.data`` file beside it; its nodes in the order ``_graph_outputs_when_ready`` writes) so
later processes skip the optimization passes; every session runs that saved graph, whose weights ORT
memory-maps rather than copies. Inputs go through one IOBinding: the LoRA inputs are bound once per adapter
(swapping adapters rebinds them; it never creates a new session), and a step rebinds only ids, positions,
mask and the K/V cache, which stays in ORT values from one step to the next. Measured on 2 cores this cuts
~0.2 ms per decode step against ``run`` with a feed dict, most of it the ~50 LoRA feeds. One handle is not
thread-safe; ``fork()`` gives another handle on the same session (one per serving thread or request).

A paged engine (interface version 6) keeps every row's cache in one ``runtime.engine.kv_blocks.BlockPool``
that all handles of the session share (``kv_budget_bytes`` bounds it); its cache is a ``PagedCache``
(each row's blocks and length). A step binds the pools (ORT values over the pools' own memory), the
block table and a mask of each row's filled slots, and writes the new tokens' slots the graph returns
into the rows' blocks. The caller's ``attention_mask`` keeps its meaning: only its last T columns are
read (which new tokens are real), since a paged row stores its real tokens only.

A stacked engine (interface version 7) binds several releases at once, each in a slot:
``set_adapters([lora, ...])`` copies their LoRA into one contiguous buffer (slot after slot);
``forward(..., slots=)`` says each row's slot, from which a step binds the one-hot ``adapter_mask``.
``set_adapter`` is one slot.

An engine with quantized pages (interface version 9) keeps its float pages and its sealed pages in a
``runtime.engine.kv_pages.PagePool`` and its cache is a ``PagesCache``: a step binds both block tables and writes
the new tokens' float K/V, sealing each page they fill (in numpy, here, after the forward). It refuses, when it
opens, a scheme this runtime does not seal and a graph whose pools are not the ones its interface records.
"""

from __future__ import annotations

import copy
import ctypes
import mmap
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as _C

from runtime.engine.adapter import check_lora_inputs, zero_lora_inputs
from runtime.engine.interface import (
    ADAPTER_MASK,
    BLOCK_TABLE,
    ENGINE_ONNX,
    FLOAT_BLOCK_TABLE,
    LOGIT_POSITIONS,
    SEALED_BLOCKS_AXIS,
    InterfaceError,
    read_interface,
)
from runtime.engine.kv_blocks import BlockPool, PagedCache, PoolTensor
from runtime.engine.kv_pages import PagePool, PagesCache, page_scheme

# Per ORT version: an optimized graph from another version may hold kernels this one lacks.
# ORT_ENABLE_ALL also bakes in CPU-specific layouts (NCHWc), so it belongs to this machine's engine dir.
# "outputs-early": its nodes are in the order ``_graph_outputs_when_ready`` writes; a graph saved by an earlier
# runtime (ORT's own order) has another name, so it is optimized again instead of run in that order.
OPTIMIZED_ONNX = f"model.ort-{ort.__version__}.outputs-early.onnx"
OPTIMIZED_ONNX_DATA = OPTIMIZED_ONNX + ".data"  # its initializers
# An exported graph whose weights exceed this keeps them in a file beside it (``tasks.stages.compile``,
# ``tasks.weights.graph``): protobuf refuses to serialize a message of 2 GiB or more, and the session that
# optimizes an engine on its first open copies a graph's inline weights onto its heap, where a data file's are
# mapped. 0.5B int4 engine (474 MB of weights), first open in one process: peak 1.06 GB inline, 0.60 GB from a data
# file (once optimized, an open peaks at 0.46 GB either way). Small graphs (the embedded default's) stay one file.
EXTERNAL_DATA_MIN_BYTES = 64 << 20
EXTERNAL_TENSOR_MIN_BYTES = 1024  # smaller initializers (scalars, shapes) stay in the graph, as ORT's default
ORT_LOG_FATAL = 4  # ORT's log severities: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal
# How a session holds the memory of its intermediate tensors (``bench.serving.device_memory_bench --ort-memory`` measures
# each in ``serve``): "arena" (ORT's default): a CPU arena that keeps every chunk it once allocated, so one long
# prefill's activations stay resident for the life of the process; "shrink": the same arena, handed back to the
# system after each run (the ``memory.enable_memory_arena_shrinkage`` run option); "no_arena": plain
# malloc/free per tensor, nothing kept past its last use. Both of the latter fix glibc's mmap threshold
# (``_unmap_large_blocks_when_freed``), without which what they free stays on the heap.
ORT_MEMORY_MODES = ("arena", "shrink", "no_arena")
DEFAULT_ORT_MEMORY = "arena"


# Linux's madvise advice that reclaims a range's pages now (mmap.MADV_PAGEOUT where Python has it, 3.8+ on Linux).
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)
# glibc's mallopt parameters, and the threshold it starts from: blocks at least this big are mapped on their own.
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MAPPED_BLOCK_MIN_BYTES = 128 << 10


def _glibc():
    """The C library when it is glibc (its ``malloc_trim`` and ``mallopt``), else None: nothing to tune."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:
        return None


def _return_freed_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere nothing): glibc
    keeps what a process freed, so the weights of a session just closed would stay resident (0.5B int4
    engine: 0.09 GB)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def _unmap_large_blocks_when_freed() -> None:
    """Process-wide (glibc; elsewhere nothing): every block of ``MAPPED_BLOCK_MIN_BYTES`` or more is mapped on its
    own, so freeing it gives it back to the system. glibc starts there but raises the threshold to the size of each
    mapped block freed (up to 32 MiB): after the first activations a session frees, its tensors come from the heap,
    which keeps them. Without ORT's arena that kept 0.10 GB more at the 0.5B shape (one process, 8 rows of 1,984
    tokens prefilled one at a time, then 48 decode steps: 0.57 against 0.46 GB anonymous at the end; higher
    thresholds kept more: 1 MiB 0.50, 4 MiB 0.54, 16 MiB 0.56 GB). Setting it also stops the raising."""
    if (libc := _glibc()) is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MAPPED_BLOCK_MIN_BYTES)


def _one_heap_for_every_thread() -> None:
    """Process-wide (glibc; elsewhere nothing): every thread allocates from the one heap. glibc gives a thread
    that finds the heap busy an arena of its own (up to 8 per core), and what a thread frees stays in its arena
    for that thread: in ``serve`` the batcher thread runs every step, the tokenizer's worker threads encode
    prompts, and each kept its own high-water mark beside the main heap's. Set before the session starts its
    threads; arenas that already exist stay. Measured in ``serve`` at the 0.5B shape, 8 x 2,048 (one run each,
    ``bench.serving.device_memory_bench``): peak 0.593 GB with an arena per thread, 0.580 GB with one, 4.6 tokens/s both."""
    if (libc := _glibc()) is not None:
        libc.mallopt(M_ARENA_MAX, 1)


def _read_mapped_weights_by_the_page(data_file: Path) -> None:
    """Linux (elsewhere nothing): ``data_file``'s pages join the process one at a time as they are read, not 64 KiB
    around each. ORT maps each initializer of the file; the ones its kernels repack (every MatMulNBits weight) are
    copied and not read again, the rest are read in place, and the embedding table is read a row per token (896
    bytes at the 0.5B shape). On a fault the kernel reads ahead and maps the neighbouring pages it has cached, so
    each token a prompt used made up to 64 KiB of the table resident: 0.03 GB in ``serve`` at 8 x 2,048 with the
    bench's 371-token vocabulary, the whole table (137 MB) with a real one. Random-access advice on the mappings
    stops the read-ahead; dropping the file's cached pages that nothing maps (the repacked weights) stops the
    mapping of neighbours the optimization or an earlier process left cached. Measured (one process, 256 tokens
    drawn from the whole vocabulary, one prefill): the file's resident pages +24.0 MB without, +6.1 MB with.
    Opening the session read each repacked weight's scales (copied into the packed weight, never read again) and
    the head's and the embedding's whole scale tables, and left those pages mapped; paging them out
    (``MADV_PAGEOUT``: it only drops pages the file holds, so nothing written is lost) lets a step fault back only
    what it reads. 0.5B int4 engine, once open: 18.7 MB of the file resident against 0.8 MB; after three 64-token
    prefills of tokens from the whole vocabulary 20.9 against 3.0 MB, their logits the same."""
    if not hasattr(mmap, "MADV_RANDOM") or not hasattr(os, "posix_fadvise"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    target = str(data_file.resolve())
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                libc.madvise(lo, hi - lo, mmap.MADV_RANDOM)  # advice only: a failure changes nothing
                libc.madvise(lo, hi - lo, MADV_PAGEOUT)  # a kernel without it (before 5.4) refuses: nothing changes
    fd = os.open(data_file, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _graph_outputs_when_ready(graph_file: Path) -> None:
    """Rewrite a saved graph's node list so that each node computing only graph outputs comes right after the
    nodes it reads from; every other node keeps its place. A session that runs the file's order
    (``ExecutionOrder.PRIORITY_BASED``: every node has the same priority, ties go by position) then frees what such
    a node reads as soon as it has run. ORT saves a graph in its own topological order, which puts every graph
    output last: the paged engine's new K/V slots are slices of each layer's whole ``present`` (the past gathered
    from the pool plus the new tokens), so all 48 presents stayed alive until the end of a step (0.5B shape,
    8 rows at 2,048 tokens: +56 MB at the decode step's peak, +9 MB with this order; measured with
    ``--ort-memory no_arena``, where nothing else holds freed memory). The initializers stay where they are
    (the graph names its data file; ``onnx`` is imported here only, when an optimized graph is written)."""
    import onnx

    model = onnx.load(str(graph_file), load_external_data=False)
    graph = model.graph
    outputs = {o.name for o in graph.output}
    computed = {t.name for t in graph.input} | {t.name for t in graph.initializer} | {""}
    last = [all(o in outputs for o in n.output) for n in graph.node]
    waiting = [n for n, is_last in zip(graph.node, last) if is_last]
    order = []

    def place(node) -> None:
        order.append(node)
        computed.update(node.output)

    def place_what_is_ready() -> None:
        while ready := [n for n in waiting if all(i in computed for i in n.input)]:
            for node in ready:
                waiting.remove(node)
                place(node)

    place_what_is_ready()
    for node, is_last in zip(graph.node, last):
        if not is_last:
            place(node)
            place_what_is_ready()
    if waiting:
        raise ValueError(f"{graph_file}: nodes {[n.name for n in waiting]} read tensors no node computes")
    nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in order]  # detached from the list cleared next
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(graph_file))


def _ort(array: np.ndarray) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(array)  # shares the array's memory and keeps it alive


def _left_pad_concat(arrays: list[np.ndarray], axis: int) -> np.ndarray:
    """``arrays`` concatenated along the batch axis, each left-padded with zeros along ``axis`` to the longest."""
    width = max(a.shape[axis] for a in arrays)
    shape = list(arrays[0].shape)
    shape[0], shape[axis] = sum(a.shape[0] for a in arrays), width
    out = np.zeros(shape, dtype=arrays[0].dtype)  # written in place: np.pad per array cost more than the copy
    row = 0
    for a in arrays:
        index = [slice(row, row + a.shape[0])] + [slice(None)] * (a.ndim - 1)
        index[axis] = slice(width - a.shape[axis], None)
        out[tuple(index)] = a
        row += a.shape[0]
    return out


class OrtEngine:
    def __init__(self, engine_dir: str | Path, threads: int = 2, onnx_file: str = ENGINE_ONNX, use_optimized: bool = True,
                 session_config: Mapping[str, str] | None = None, kv_budget_bytes: int | None = None,
                 memory: str = DEFAULT_ORT_MEMORY, paired_rows: bool = False):
        """``session_config``: ORT session config entries (e.g. how Q/DQ weights are fused); the
        saved optimized graph bakes in one set of them, so with any given it is neither read nor written.
        ``kv_budget_bytes``: a paged engine's pool of KV blocks holds at most this (None: it grows).
        ``memory``: one of ``ORT_MEMORY_MODES``, how intermediate tensors are allocated.
        ``paired_rows`` (a paged engine): every forward runs an even number of rows, an odd batch's last row twice
        (the copy's logits and K/V dropped), so a decode step gives a row the same floats in any company of up to 16
        rows: ONNX Runtime's MatMulNBits sums a row left over from its pairs (a lone row included) in another order,
        and the graph's other products give a row the same floats at 2 to 16 rows (the LoRA's computed for that,
        ``runtime.engine.model.Block._lora``). A prefill's rows are its tokens: the batcher prefills each request apart
        on such an engine (``tests/runtime/test_paired_rows.py``). A lone row costs a pair's step."""
        if memory not in ORT_MEMORY_MODES:
            raise ValueError(f"memory={memory!r}: one of {', '.join(ORT_MEMORY_MODES)}")
        self.engine_dir = engine_dir = Path(engine_dir)
        self.interface = read_interface(engine_dir)
        self._run_options = None
        if memory == "shrink":
            self._run_options = ort.RunOptions()
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        if memory != "arena":  # what these modes free must leave the process, not stay on the heap
            _unmap_large_blocks_when_freed()
        _one_heap_for_every_thread()
        # ORT's C++ logger writes plain text to stderr, where the device's log is JSON lines; every error it
        # would log is also raised (with the same message) to the caller, which logs it. Fatal only, then,
        # for this session's runs and for the process-wide default logger (thread pools, environment).
        ort.set_default_logger_severity(ORT_LOG_FATAL)

        def session(graph: Path, save_optimized_to: Path | None = None) -> ort.InferenceSession:
            opts = ort.SessionOptions()
            if graph.name == OPTIMIZED_ONNX:  # run in the file's order (``_graph_outputs_when_ready``)
                opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
            opts.enable_cpu_mem_arena = memory != "no_arena"
            # No memory pattern (one block per run, planned for each new set of input shapes): the shapes change
            # as rows join and blocks fill, and every new block size extended the arena. Measured at the 0.5B shape
            # (one process, 8 rows of 1,984 tokens, then 48 decode steps): 0.07 GB less anonymous memory at the
            # end (0.60 against 0.67 GB), the same decode speed (64.4 against 64.2 tokens/s).
            opts.enable_mem_pattern = False
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
            opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            opts.log_severity_level = ORT_LOG_FATAL
            for key, value in (session_config or {}).items():
                opts.add_session_config_entry(key, value)
            if save_optimized_to is not None:
                # The initializers go to a file beside the graph (which names it relative to its own folder,
                # so it gets its final name here): protobuf caps one file at 2 GiB, and a session opened on
                # the saved graph memory-maps that file instead of copying every weight onto its heap.
                opts.optimized_model_filepath = str(save_optimized_to)
                opts.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                              OPTIMIZED_ONNX_DATA)
                opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                              str(EXTERNAL_TENSOR_MIN_BYTES))
            return ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])

        optimized = engine_dir / OPTIMIZED_ONNX
        source = engine_dir / onnx_file
        if not (use_optimized and onnx_file == ENGINE_ONNX and not session_config):
            self.session = session(source)
        elif optimized.exists() and (engine_dir / OPTIMIZED_ONNX_DATA).exists():
            source = optimized
            self.session = session(optimized)
        else:
            # Written into a private folder and moved: never a half-written optimized graph. A graph saved
            # without its data file (by a runtime before this one: weights inline, copied onto the heap) is
            # replaced the same way.
            staging = Path(tempfile.mkdtemp(prefix=f".{OPTIMIZED_ONNX}.{os.getpid()}.", dir=engine_dir))
            try:
                session(source, staging / OPTIMIZED_ONNX)
                _graph_outputs_when_ready(staging / OPTIMIZED_ONNX)
                # The data first: the graph's presence means "complete", and it reads the data by name. Two
                # processes optimizing at once write the same bytes (checked: one graph, ORT version and machine).
                if (staging / OPTIMIZED_ONNX_DATA).exists():
                    os.replace(staging / OPTIMIZED_ONNX_DATA, engine_dir / OPTIMIZED_ONNX_DATA)
                os.replace(staging / OPTIMIZED_ONNX, optimized)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            # The session that optimized holds every weight on its heap (and the heap keeps what it freed);
            # one opened on the saved graph maps them (0.5B int4 engine, resident once open: 0.46 GB against
            # 0.90 GB; docs/measuring.md, "Device memory at the real size").
            source = optimized
            self.session = session(optimized)
        # Opening a session frees the buffers it repacked weights through; the heap keeps them (0.5B int4 engine:
        # 12 MB, 0.09 GB more after optimizing, when the optimizing session held every weight).
        _return_freed_heap()
        if source == optimized:
            _read_mapped_weights_by_the_page(engine_dir / OPTIMIZED_ONNX_DATA)
        graph_inputs = [i.name for i in self.session.get_inputs()]
        if graph_inputs != self.interface.input_names:
            raise ValueError(f"{source}: graph inputs differ from interface.json; the engine directory is inconsistent")
        self._outputs = self.interface.output_names
        self._kv_names = [n for n in self.interface.input_names if n.startswith("past_")]
        self.kv_bytes_per_token = self.interface.kv_bytes_per_token
        self._lora: dict[str, ort.OrtValue] = {}
        self.slots = 1  # adapters bound (a stacked engine's slots)
        self._binding = self.session.io_binding()
        self._cpu = ort.OrtDevice.make("cpu", 0)._get_c_device()
        self._array_inputs = ("input_ids", "position_ids", "attention_mask")  # bound from numpy each step
        self.pool = None
        if self.interface.quantized_pages:
            self.page_spec = page_scheme(self.interface)
            graph_shapes = {i.name: list(i.shape[1:]) for i in self.session.get_inputs()}
            differing = [t.name for t in self.interface.inputs
                         if t.name.startswith("pool_") and graph_shapes[t.name] != list(t.shape[1:])]
            if differing:
                raise InterfaceError(f"{source}: the graph's pools {differing} are not those of the quantized pages "
                                     f"{self.page_spec.name} interface.json records; the engine directory is inconsistent")
            self._array_inputs = ("input_ids", "position_ids", "attention_mask", BLOCK_TABLE, FLOAT_BLOCK_TABLE)
            pools = {axis: [PoolTensor(t.name, tuple(t.shape[1:]), t.dtype) for t in self.interface.inputs
                            if t.name.startswith("pool_") and t.shape[0] == axis] for axis in ("blocks", SEALED_BLOCKS_AXIS)}
            self.pool = PagePool(pools["blocks"], pools[SEALED_BLOCKS_AXIS], self.interface.kv_block_size,
                                 kv_budget_bytes, _ort)
        elif self.interface.paged:
            self._array_inputs = ("input_ids", "position_ids", "attention_mask", BLOCK_TABLE)
            pools = [PoolTensor(t.name, tuple(t.shape[1:]), t.dtype) for t in self.interface.inputs if t.name.startswith("pool_")]
            self.pool = BlockPool.for_budget(pools, self.interface.kv_block_size, kv_budget_bytes, _ort)
        elif kv_budget_bytes is not None:
            raise ValueError(f"{engine_dir}: a KV budget needs a paged engine (interface version 6), this one is "
                             f"version {self.interface.version}")
        if paired_rows and self.pool is None:
            raise ValueError(f"{engine_dir}: paired rows need a paged engine (interface version 6), this one is "
                             f"version {self.interface.version}")
        self.paired_rows = paired_rows
        self._bind_lora([None])

    def set_adapter(self, lora: Mapping[str, np.ndarray] | None) -> None:
        """Bind an adapter's LoRA inputs (None = base model), checked first. On a stacked engine: one slot, slot 0."""
        self.set_adapters([lora])

    def set_adapters(self, loras: list[Mapping[str, np.ndarray] | None]) -> None:
        """Bind one adapter per slot, each as ``set_adapter`` takes it, all checked before anything is bound; more
        than one needs a stacked engine (interface version 7). Only this handle rebinds: a fork made before keeps
        the slots it had, so rows running on it never change weights."""
        if not loras or (len(loras) > 1 and not self.interface.stacked):
            raise ValueError(f"{len(loras)} adapters: this engine (interface version {self.interface.version}) "
                             f"binds {'one or more' if self.interface.stacked else 'exactly one'}")
        self._bind_lora(loras)
        self.slots = len(loras)

    def bind_slots(self, handles: list["OrtEngine"]) -> None:
        """Slot i takes what ``handles[i]`` (each a handle of this stacked engine with one release bound, e.g. a
        resident release's) has in its slot 0: its LoRA, copied, so rebinding this handle never touches theirs. A
        running batch rebinds with its releases' slots in a new order (the caller remaps its rows): each row keeps
        its release's weights."""
        if not self.interface.stacked:
            raise ValueError(f"interface version {self.interface.version} binds one adapter; slots need version 7")
        self._bind_lora([{n: h._lora[n].numpy() for n in self.interface.lora_names} for h in handles])  # one slot each
        self.slots = len(handles)

    def fork(self) -> "OrtEngine":
        """Another handle on the same session, with its own IOBinding and the same adapter bound.

        ORT runs one session from many threads at once; what must not be shared is the binding
        (and its step buffers). The twin shares the session and the adapter's ORT values, which
        are never written once bound (``set_adapter`` replaces them, on its own handle only).
        A server keeps one bound handle per release and forks it for every request, so a swap
        never changes what an in-flight request runs with.
        """
        twin = copy.copy(self)
        twin._binding = self.session.io_binding()
        twin._step_inputs = ()
        for name, value in self._lora.items():
            twin._binding.bind_ortvalue_input(name, value)
        return twin

    def _bind_lora(self, loras: list[Mapping[str, np.ndarray] | None]) -> None:
        """Bind one adapter's LoRA inputs (None: zeros), or on a stacked engine every slot's: A (slots n r, in),
        B (out, slots n r)."""
        loras = [zero_lora_inputs(self.interface) if lora is None else lora for lora in loras]
        for lora in loras:
            check_lora_inputs(self.interface, lora)
        # Copied (the engine keeps a snapshot, not the caller's arrays) into one contiguous buffer
        # in graph order, and held on self (each ORT value keeps its view, and so the buffer,
        # alive): the binding refers to it. One buffer instead of an allocation per input because
        # the LoRA matrices are read cold every token (the weights streamed in between evict them):
        # measured at 0.5B width, int4, 2 threads, eight interleaved runs, it takes 0 to 3.6 points
        # off the LoRA-as-input overhead (e.g. past 2048: +6.4% vs +10.0%; one run: no difference).
        # Aligning the buffer to a page measured 3-5 points worse than where numpy puts it (page + 16 B).
        names = self.interface.lora_names
        if self.interface.stacked:  # A slot after slot; B's slots side by side in each output row
            arrays = [np.concatenate([np.asarray(lora[n], dtype=np.float32) for lora in loras],
                                     axis=0 if n.startswith("lora_A.") else 1) for n in names]
        else:
            arrays = [np.asarray(loras[0][n], dtype=np.float32) for n in names]
        buffer = np.empty(sum(a.size for a in arrays), dtype=np.float32)
        self._lora, offset = {}, 0
        for name, array in zip(names, arrays):
            view = buffer[offset : offset + array.size].reshape(array.shape)
            view[...] = array
            self._lora[name] = ort.OrtValue.ortvalue_from_numpy(view)
            offset += array.size
        for name, value in self._lora.items():
            self._binding.bind_ortvalue_input(name, value)

    def empty_cache(self, batch: int):
        i = self.interface
        if isinstance(self.pool, PagePool):
            return PagesCache.empty(self.pool, self.page_spec, batch)
        if self.pool is not None:
            return PagedCache(self.pool, [[] for _ in range(batch)], np.zeros(batch, dtype=np.int64))
        empty = np.zeros((batch, i.num_kv_heads, 0, i.head_dim), dtype=np.float32)
        return [ort.OrtValue.ortvalue_from_numpy(empty) for _ in self._kv_names]

    def cache_with_pages(self, rows: list):
        """A paged cache whose row b starts with the full pages ``rows[b]`` (``runtime.engine.kv_prefix.Page``s the
        prefix index found, counted as held by these rows): what a prefill after a shared prefix starts from."""
        if isinstance(self.pool, PagePool):
            return PagesCache.with_pages(self.pool, self.page_spec, rows)
        return PagedCache.with_pages(self.pool, rows)

    def cache_of_blocks(self, rows: list[list[list[int]]], lengths: np.ndarray):
        """A paged cache of rows that hold ``rows[b]`` (blocks per pool of ``pool.block_pools``, as ``row_blocks``
        gives them) and ``lengths[b]`` tokens: a row read back from the spill file."""
        if isinstance(self.pool, PagePool):
            return PagesCache(self.pool, self.page_spec, [r[0] for r in rows], [r[1] for r in rows], lengths)
        return PagedCache(self.pool, [r[0] for r in rows], lengths)

    def forward(self, input_ids, position_ids, attention_mask, past=None, logit_positions=None, slots=None):
        """``slots`` (B,) int: the slot each row decodes with (stacked engine; None: every row slot 0).
        ``logit_positions`` (B, K) int64: the new tokens whose logits come back, (B, K, V); None = all of
        them, (B, T, V). An engine without the input (interface version < 8) returns all of them anyway."""
        if past is None:
            past = self.empty_cache(input_ids.shape[0])
        batch = input_ids.shape[0]
        if self.paired_rows and batch % 2:  # the last row again, so that it is paired like every other
            input_ids, position_ids, attention_mask, logit_positions, slots = (
                None if a is None else np.concatenate([np.asarray(a)[:batch], np.asarray(a)[-1:]])
                for a in (input_ids, position_ids, attention_mask, logit_positions, slots))
        rows = self._bind_rows(input_ids.shape[0], slots)
        # The binding's and session's pybind objects directly: the Python wrappers' per-call checks,
        # OrtDevice objects and bookkeeping cost ~0.06 ms a step (6% of a batch-8 decode step on the
        # tiny engine, measured against the wrapper calls, with identical logits).
        binding, cpu = self._binding._iobinding, self._cpu
        if self.interface.logit_positions:
            if logit_positions is None:
                B, T = input_ids.shape
                logit_positions = np.broadcast_to(np.arange(T, dtype=np.int64), (B, T))
            logit_positions = np.ascontiguousarray(logit_positions, dtype=np.int64)
            binding.bind_ortvalue_input(LOGIT_POSITIONS, _C.OrtValue.ortvalue_from_numpy(logit_positions, cpu))
        if self.pool is not None:
            return self._forward_paged(input_ids, position_ids, attention_mask, past, rows, logit_positions, batch)
        arrays = [np.ascontiguousarray(input_ids, dtype=np.int64), np.ascontiguousarray(position_ids, dtype=np.int64),
                  np.ascontiguousarray(attention_mask, dtype=np.int64)]
        for name, array in zip(self._array_inputs, arrays):
            binding.bind_ortvalue_input(name, _C.OrtValue.ortvalue_from_numpy(array, cpu))
        for name, value in zip(self._kv_names, past):
            binding.bind_ortvalue_input(name, value._ortvalue)
        binding.clear_binding_outputs()
        for name in self._outputs:  # unallocated: ORT sizes them for this step (the cache grows)
            binding.bind_output(name, cpu)
        self.session._sess.run_with_iobinding(binding, self._run_options)
        outputs = binding.get_outputs()  # pybind values: wrapped (ort.OrtValue) only where they become the cache
        self._step_inputs = arrays, past, rows, logit_positions  # what the bound inputs' memory belongs to, until the next step rebinds
        # indexed, not iterated: iterating the vector gives views of its slots, which the next step reuses
        return outputs[0].numpy(), [ort.OrtValue(outputs[i]) for i in range(1, len(outputs))]

    def _bind_rows(self, batch: int, slots) -> list[np.ndarray]:
        """A stacked engine's per-row input for ``slots`` (B,): the one-hot ``adapter_mask``, bound; the arrays (kept
        by the caller until the step has run). Nothing on other engines."""
        if not self.interface.stacked:
            if slots is not None and np.any(np.asarray(slots) != 0):
                raise ValueError(f"slots {np.asarray(slots).tolist()}: this engine (interface version "
                                 f"{self.interface.version}) binds one adapter")
            return []
        slots = np.zeros(batch, dtype=np.int64) if slots is None else np.asarray(slots, dtype=np.int64)
        if slots.shape != (batch,) or slots.min(initial=0) < 0 or slots.max(initial=0) >= self.slots:
            raise ValueError(f"slots {slots.tolist()}: one per row ({batch}), each below the {self.slots} bound")
        mask = np.zeros((batch, self.slots), dtype=np.float32)
        mask[np.arange(batch), slots] = 1.0
        self._binding._iobinding.bind_ortvalue_input(ADAPTER_MASK, _C.OrtValue.ortvalue_from_numpy(mask, self._cpu))
        return [mask]

    def _forward_paged(self, input_ids, position_ids, attention_mask, past: PagedCache | PagesCache, rows: list,
                       logit_positions, batch: int):
        """``batch``: the cache's rows; the inputs may hold one more (``paired_rows``: the last row's copy), which
        reads that row's blocks and whose outputs are dropped."""
        binding, cpu = self._binding._iobinding, self._cpu
        T = input_ids.shape[1]
        real = np.asarray(attention_mask)[:, -T:] > 0  # (B, T): the new tokens a row stores
        tables = past.tables()  # (batch, M) each
        past_mask = past.past_mask(tables)
        if input_ids.shape[0] > batch:
            tables, past_mask = [np.concatenate([t, t[-1:]]) for t in tables], np.concatenate([past_mask, past_mask[-1:]])
        arrays = [np.ascontiguousarray(input_ids, dtype=np.int64), np.ascontiguousarray(position_ids, dtype=np.int64),
                  np.concatenate([past_mask, real], axis=1).astype(np.int64), *tables]
        for name, array in zip(self._array_inputs, arrays):
            binding.bind_ortvalue_input(name, _C.OrtValue.ortvalue_from_numpy(array, cpu))
        for name, value in self.pool.values.items():  # read by the next step after the writes below: never copied
            binding.bind_ortvalue_input(name, value._ortvalue)
        binding.clear_binding_outputs()
        for name in self._outputs:
            binding.bind_output(name, cpu)
        self.session._sess.run_with_iobinding(binding, self._run_options)
        outputs = binding.get_outputs()
        self._step_inputs = arrays, rows, logit_positions  # not the cache: a finished generation's blocks go back when it is dropped
        past.append({"pool_" + n[len("new_"):]: outputs[i].numpy()[:batch] for i, n in enumerate(self._outputs) if i},
                    real[:batch])
        return outputs[0].numpy()[:batch], past

    @property
    def merges_caches(self) -> bool:
        """Whether caches of separate prefills can be merged into one batch (``concat_caches``): every cache of this
        backend can (the batcher's condition; TensorRT and eager engines have no ``concat_caches``)."""
        return True

    def concat_caches(self, caches: list):
        """One cache of every row of ``caches``, in order, each left-padded with zero slots along the
        past axis to the longest: the caller masks those slots (attention mask 0), as ``runtime.engine.generate``
        left-pads prompts, so every row decodes as it would alone (up to float rounding). Paged caches are
        not padded: their rows move into the result (the caches given are consumed)."""
        if self.pool is not None:
            return type(caches[0]).concat(caches)
        # [K.0, V.0, ...], each (B, nkv, P, d)
        return [_ort(_left_pad_concat([c[j].numpy() for c in caches], axis=2)) for j in range(len(caches[0]))]

    def take_cache_rows(self, cache, rows: np.ndarray, drop: int = 0):
        """The cache of ``rows`` (indices, in order) without its first ``drop`` past slots, which must
        be masked in every one of them (what is left when the longest rows have gone). A paged cache has no
        such slots: it is consumed, the other rows' blocks going back to the pool."""
        if self.pool is not None:
            return cache.take_rows(rows)

        return [_ort(np.ascontiguousarray(v.numpy()[rows, :, drop:])) for v in cache]

    def cache_bytes(self, cache) -> int:
        """Bytes ``cache`` holds: rows x past slots x ``kv_bytes_per_token`` (every slot, the padding of rows
        shorter than the longest included); a paged cache: the blocks its rows hold (a row's last block only partly
        filled). From the shapes: nothing is read."""
        if isinstance(cache, (PagedCache, PagesCache)):
            return cache.allocated_bytes()
        rows, _, past, _ = cache[0].shape()
        return rows * past * self.kv_bytes_per_token

    def cache_to_numpy(self, cache):
        """[K.0, V.0, ...], each (B, nkv, P, d); quantized pages: {pool name: the rows' pages}. Copies:
        ``OrtValue.numpy()`` is a view that does not keep the value alive, so once a cache made by
        ``ortvalue_from_numpy`` (``concat_caches``, ``take_cache_rows``) is dropped its view reads freed memory."""
        if isinstance(cache, PagesCache):  # {pool name: the rows' float pages, or their sealed ones}
            return cache.to_numpy()
        if isinstance(cache, PagedCache):  # as the padded engine's cache of rows this long, right-padded with zeros
            return [self._rows_of(cache, n) for n in self.pool.values]
        return [v.numpy().copy() for v in cache]

    def _rows_of(self, cache: PagedCache, name: str) -> np.ndarray:
        """Pool ``name`` read through the cache's blocks: (B, nkv, longest row, w), zeros past a row's length."""
        pool = self.pool.arrays[name]
        table = cache.block_table()  # (B, M)
        B, (_, nkv, bs, w) = cache.batch, pool.shape
        rows = pool[table].transpose(0, 2, 1, 3, 4).reshape(B, nkv, table.shape[1] * bs, w)
        rows = rows[:, :, : int(cache.lengths.max(initial=0))].copy()
        for b, n in enumerate(cache.lengths):
            rows[b, :, n:] = 0
        return rows
