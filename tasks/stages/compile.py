"""Compile the backbone once: one ONNX graph whose LoRA weights and KV cache are inputs.

``compile_engine`` writes ``engine/`` (``model.onnx``, ``interface.json``, ``cache_key.json``
and the ONNX Runtime-optimized ``model.ort-<version>.outputs-early.onnx``) and is keyed by backbone hash + interface
version + exporter version (+ the requested max rank, target modules and opset, which change
the interface). A monthly run whose backbone did not change finds the key, exports nothing,
builds nothing and records ``engine_builds: 0``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import sys
import time
import warnings
from pathlib import Path

from runtime.engine.interface import CACHE_KEY_FILE, ENGINE_ONNX, INTERFACE_FILE
from tasks.artifacts import atomic_output_dir, write_json
from tasks.cli import stage_main
from tasks.config import EngineConfig, KVConfig, ReleaseConfig, StageError

log = logging.getLogger(__name__)

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class CompileError(StageError, RuntimeError):
    """An export whose graph does not match the interface it was meant to implement."""


def exporter_version() -> dict:
    import onnx
    import onnxscript
    import torch

    return {"torch": torch.__version__, "onnxscript": onnxscript.__version__, "onnx": onnx.__version__}


# The code that defines the exported graph: editing any of it must rebuild the engine.
GRAPH_SOURCES = ("runtime/engine/model.py", "runtime/engine/backbone_config.py", "runtime/engine/paged_model.py",
                 "runtime/engine/interface.py", "kernels/kv_spec.py", "kernels/rope.py", "kernels/bit_packing.py",
                 "kernels/page_quant.py")


def graph_source_hash() -> str:
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for name in GRAPH_SOURCES:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    return digest.hexdigest()


def export_opset(opset: int, kv_pages: dict | None) -> int:
    """The opset an engine is exported at: the requested one, raised to ``kernels.page_quant.READ_OPSET`` for
    quantized pages (the sealed keys' blocked DequantizeLinear). The cache key records this one: what was built."""
    from kernels.page_quant import READ_OPSET

    return opset if kv_pages is None else max(opset, READ_OPSET)


def cache_key(backbone_hash: str, max_rank: int, target_modules: tuple[str, ...], opset: int,
              kv_block_size: int | None = None, stacked: bool = False, kv_pages: dict | None = None) -> dict:
    from runtime.engine.interface import LOGIT_POSITIONS_INTERFACE_VERSION

    key = {
        "backbone_hash": backbone_hash,
        "interface_version": LOGIT_POSITIONS_INTERFACE_VERSION,  # every export takes logit positions
        "exporter": exporter_version(),
        "graph_source": graph_source_hash(),
        "max_rank": max_rank,
        "target_modules": list(target_modules),
        "opset": export_opset(opset, kv_pages),
    }
    if kv_block_size is not None:  # absent for padded engines: their key stays as it was
        key["kv_block_size"] = kv_block_size
    if stacked:  # absent for one-adapter engines: their key stays as it was
        key["stacked"] = True
    if kv_pages is not None:  # absent for every other cache: their keys stay as they were
        key["kv_pages"] = dict(kv_pages)
    key["key"] = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return key


def _name_dynamic_axes(onnx_path: Path, iface) -> None:
    """Give the exporter's symbolic axes (s23, s70...) the interface's names and check the
    graph's inputs/outputs against the interface: the contract is verified, not assumed."""
    import onnx

    # The graph alone: its external data (a large backbone's weights) stays where it is, unread.
    model = onnx.load(str(onnx_path), load_external_data=False)
    problems = []
    for graph_values, specs in ((model.graph.input, iface.inputs), (model.graph.output, iface.outputs)):
        got = [v.name for v in graph_values]
        if got != [t.name for t in specs]:
            raise CompileError(f"exported graph I/O {got} differs from the interface {[t.name for t in specs]}")
        for value, spec in zip(graph_values, specs):
            dims = value.type.tensor_type.shape.dim
            dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name
            if dtype != spec.dtype or len(dims) != len(spec.shape):
                problems.append(f"{spec.name}: graph has {dtype} rank {len(dims)}, interface {spec.dtype} {spec.shape}")
                continue
            for dim, want in zip(dims, spec.shape):
                if isinstance(want, str):
                    dim.dim_param = want
                elif dim.HasField("dim_value") and dim.dim_value != want:
                    problems.append(f"{spec.name}: axis is {dim.dim_value}, interface says {want}")
    if problems:
        raise CompileError("exported graph breaks the interface: " + "; ".join(problems))
    onnx.save(model, str(onnx_path))


def export_backbone(
    model_dir: Path,
    onnx_path: Path,
    max_rank: int = 8,
    target_modules: tuple[str, ...] = DEFAULT_TARGETS,
    opset: int = 18,
    merged_lora: dict | None = None,
    kv_block_size: int | None = None,
    stacked: bool = False,
    kv_pages: dict | None = None,
):
    """Export the hand-written forward with dynamic batch/seq/past; return its EngineInterface.

    ``target_modules=()`` exports a graph without LoRA inputs; with ``merged_lora`` (engine
    LoRA inputs as numpy) the adapter is merged into the weights first (the merged baseline).
    ``kv_block_size`` exports it with a paged cache of blocks of that many tokens
    (``runtime.engine.paged_model``, interface version 6). ``stacked`` exports either with stacked
    adapters (``runtime.engine.interface.stacked_interface``, version 7). Every export takes the
    ``logit_positions`` input (interface version 8): a server computes the LM head at the positions it samples only.
    ``kv_pages`` (a ``kernels.kv_spec.PageQuantSpec`` dict, with ``kv_block_size``) exports the paged cache with
    quantized pages (``runtime.engine.paged_model.QuantizedPagesBackbone``, version 9), at opset
    ``kernels.page_quant.READ_OPSET`` at least (its keys' blocked DequantizeLinear).
    """
    import torch

    from kernels.page_quant import onnx_translations
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.interface import build_interface
    from runtime.engine.model import load_backbone
    from runtime.engine.tracing import TRACE_BATCH, TRACE_PAST, TRACE_SEQ, example_inputs, export_dynamic_shapes

    merged = None if merged_lora is None else {k: torch.from_numpy(v) for k, v in merged_lora.items()}
    model = load_backbone(model_dir, tuple(target_modules), merged_lora=merged)
    iface = build_interface(model.cfg, backbone_hash(model_dir), max_rank, tuple(target_modules), kv_block_size,
                            stacked, logit_positions=True, kv_pages=kv_pages)
    if kv_pages is not None:
        from kernels.kv_spec import PageQuantSpec
        from runtime.engine.paged_model import QuantizedPagesBackbone

        model = QuantizedPagesBackbone(model, PageQuantSpec.from_dict(kv_pages), kv_block_size).eval()
    elif kv_block_size is not None:
        from runtime.engine.paged_model import PagedKVBackbone

        model = PagedKVBackbone(model).eval()
    opset = export_opset(opset, kv_pages)
    args = example_inputs(model.backbone if kv_block_size else model, iface, TRACE_BATCH, TRACE_SEQ, TRACE_PAST)
    # LoRA inputs have fixed shapes: (r_max, in), (out, r_max).
    dynamic_shapes = export_dynamic_shapes(iface, args, torch.export.Dim)
    t0 = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        # The exporter cannot rename axes of nested inputs; _name_dynamic_axes does it below.
        warnings.filterwarnings("ignore", message=".*dynamic axes will not be renamed")
        # Said once per axis that several inputs share (batch, seq, the stacked engine's slots): the same
        # renaming, also done by _name_dynamic_axes.
        warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used, since it shares the same shape")
        # torch.export calling torch's own deprecated pytree API: nothing to act on here, and shown again at
        # each export (this block resets the warnings' once-per-place registry).
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        program = torch.onnx.export(
            model,
            args,
            dynamo=True,
            verbose=False,  # four progress lines per export otherwise; a failed step still raises
            dynamic_shapes=dynamic_shapes,
            input_names=iface.input_names,
            output_names=iface.output_names,
            opset_version=opset,
            optimize=True,
            custom_translation_table=onnx_translations(),
        )
    from runtime.engine.backends import onnxruntime as ort_backend

    # Protobuf caps one file at 2 GiB: a large backbone's weights go to model.onnx.data beside the graph.
    big = sum(p.numel() * p.element_size() for p in model.parameters()) > ort_backend.EXTERNAL_DATA_MIN_BYTES
    program.save(str(onnx_path), external_data=big)
    _name_dynamic_axes(onnx_path, iface)
    log.info("exported %s in %.1fs", onnx_path, time.perf_counter() - t0)
    return iface


def compile_engine(
    model_dir: Path,
    engine_dir: Path,
    max_rank: int = 8,
    target_modules: tuple[str, ...] = DEFAULT_TARGETS,
    opset: int = 18,
    ort_threads: int = 2,
    metrics_path: Path | None = None,
    kv_block_size: int | None = None,
    stacked: bool = False,
    kv_pages: dict | None = None,
) -> dict:
    """Build ``engine_dir`` unless a build for the same key is already there; return metrics.

    The float-KV engine by default; ``kv_block_size`` builds it with a paged cache (interface version 6),
    ``stacked`` with stacked adapters (version 7): rows of several releases in one forward. ``kv_pages`` (a
    ``kernels.kv_spec.PageQuantSpec`` dict) builds the paged cache with quantized pages (version 9): needs
    ``kv_block_size``; a scheme the backbone's heads cannot hold is refused. Each is part of the cache key: give
    each its own directory.

    The new engine is written into a temporary sibling and renamed into place only when the
    export, the interface check and the ORT optimization all succeeded.
    """
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.interface import read_interface, write_interface

    model_dir, engine_dir = Path(model_dir), Path(engine_dir)
    bhash = backbone_hash(model_dir)
    if kv_block_size is not None and kv_block_size < 1:
        raise CompileError(f"{engine_dir}: kv_block_size {kv_block_size}: a paged cache needs blocks of at least one token")
    if kv_pages is not None:
        kv_pages = _checked_pages(model_dir, engine_dir, kv_pages, kv_block_size)
    key = cache_key(bhash, max_rank, tuple(target_modules), opset, kv_block_size, stacked, kv_pages)
    key_file = engine_dir / CACHE_KEY_FILE
    metrics = {"backbone_hash": bhash, "cache_key": key["key"]}
    if key_file.exists() and json.loads(key_file.read_text()).get("key") == key["key"]:
        iface = read_interface(engine_dir)
        log.info("engine cache hit (%s): no export, no build", key["key"][:12])
        metrics |= {"engine_builds": 0, "cache_hit": True, "export_seconds": 0.0, "interface_hash": iface.interface_hash}
    else:
        t0 = time.perf_counter()
        with atomic_output_dir(engine_dir) as tmp:
            iface = export_backbone(model_dir, tmp / ENGINE_ONNX, max_rank, tuple(target_modules), opset,
                                    kv_block_size=kv_block_size, stacked=stacked, kv_pages=kv_pages)
            # The exported program and the module hold each other in reference cycles, so their copies of
            # the weights outlive the export until a collection; collected here, before ORT loads the graph
            # (measured on the 0.5B shape: the compile stage's peak RSS 10.5 -> 8.4 GB).
            gc.collect()
            write_interface(iface, tmp / INTERFACE_FILE, exporter=key["exporter"])
            from runtime.engine.backends.onnxruntime import OrtEngine

            OrtEngine(tmp, threads=ort_threads)  # writes the optimized model next to the graph
            write_json(tmp / CACHE_KEY_FILE, key)  # last: its presence means "complete"
        metrics |= {
            "engine_builds": 1,
            "cache_hit": False,
            "export_seconds": round(time.perf_counter() - t0, 2),
            "interface_hash": iface.interface_hash,
        }
        log.info("engine built in %.1fs at %s", metrics["export_seconds"], engine_dir)
    if metrics_path is not None:
        Path(metrics_path).parent.mkdir(parents=True, exist_ok=True)
        write_json(Path(metrics_path), metrics)
    return metrics


def _checked_pages(model_dir: Path, engine_dir: Path, kv_pages: dict, kv_block_size: int | None) -> dict:
    """``kv_pages`` validated, every field spelled out; ``CompileError`` naming every problem."""
    from kernels.kv_spec import PageQuantSpec
    from runtime.engine.model import read_config

    try:
        spec = PageQuantSpec.from_dict(dict(kv_pages))
    except (TypeError, ValueError) as err:
        raise CompileError(f"{engine_dir}: {err}") from None
    cfg = read_config(model_dir)
    problems = spec.problems(cfg.head_dim) + spec.layer_problems(cfg.num_layers)
    problems += ["no kv_block_size (a page is a block of the paged cache)"] if not kv_block_size else []
    if problems:
        raise CompileError(f"{engine_dir}: quantized pages {spec.name}: " + "; ".join(problems))
    return spec.to_dict()


def run_stage(cfg: ReleaseConfig) -> dict:
    """The compile stage: build (or reuse) the profile's engines (``compile_profile_engines``); record
    ``engine_builds`` in ``layout.engine_build_file``."""
    metrics = compile_profile_engines(cfg)
    cfg.layout.engine_build_file.parent.mkdir(parents=True, exist_ok=True)
    write_json(cfg.layout.engine_build_file, metrics)
    return metrics


def serving_form(engine: EngineConfig, kv: KVConfig, head_dim: int) -> dict:
    """``compile_engine``'s keyword arguments for the engine ``serve`` runs under these sections, for a backbone
    whose heads have ``head_dim`` channels: the ``kv`` section's quantized pages or a float cache, paged and/or
    with stacked adapters as ``engine`` says."""
    pages = kv.page_spec(head_dim).to_dict() if engine.kv_cache == "quantized_pages" else None
    return {"kv_block_size": engine.kv_block_size or None, "stacked": engine.mixed_adapters, "kv_pages": pages}


# GPTQ's calibration text (``engine.weight_method: gptq``): windows of real prose and code
# (``tasks.real_model.text.calibration_windows``), never the month's task rows, so the one quantized backbone serves
# every monthly adapter.
GPTQ_WINDOW = 512


def weight_calibration_ids(cfg: ReleaseConfig) -> list[list[int]] | None:
    """GPTQ's calibration token ids for ``engine.weight_method: gptq`` (``calibration_windows``); None for round to
    nearest."""
    if cfg.engine.weight_method != "gptq":
        return None
    from tasks.real_model.text import calibration_windows

    return calibration_windows(Path(cfg.base_model.path), cfg.engine.weight_calibration_tokens, GPTQ_WINDOW)


def compile_profile_engines(cfg: ReleaseConfig) -> dict:
    """Build (or reuse) ``engine.dir`` for the backbone; return what was built. Writes nothing else, so a
    benchmark can take the stage's engines without touching the stage's record.

    With ``engine.kv_block_size`` N > 0 and/or ``engine.mixed_adapters`` the serving form is built besides
    (``tasks.config.EngineConfig.cache_engine_dir``): with ``engine.kv_cache: quantized_pages`` it carries the ``kv``
    section's quantized pages (``kvpages-paged16-stacked`` by default, interface version 9: no release scales, the
    device seals each page as it fills); with a float cache it is ``paged16-stacked`` (versions 6 and 7). The padded
    float engine stays, as adapters bind to it and the decode-latency gate and the benchmarks read it. With
    ``engine.weights`` int8/int4
    the serving engine is also copied with quantized weights into ``layout.serving_engine_dir`` (reused
    likewise; by GPTQ with ``engine.weight_method: gptq``, its calibration text part of the copy's key). Adapters take the same LoRA inputs on all of them.
    """
    layout = cfg.layout
    model_dir = Path(cfg.base_model.path)
    common = (cfg.engine.max_rank, cfg.engine.target_modules, cfg.engine.opset, cfg.engine.threads, None)
    metrics = compile_engine(model_dir, layout.engine_dir, *common)
    source = layout.engine_dir
    from runtime.engine.model import read_config

    form = serving_form(cfg.engine, cfg.kv, read_config(model_dir).head_dim)
    if form["kv_pages"] is not None and cfg.kv.layer_kl_budget is not None:
        from kernels.kv_spec import PageQuantSpec
        from tasks.checks.page_widths import CALIBRATION_WINDOW, ensure_layer_widths
        from tasks.real_model.text import calibration_windows

        windows = calibration_windows(model_dir, cfg.kv.layer_calibration_tokens, CALIBRATION_WINDOW)
        pages, record = ensure_layer_widths(model_dir, layout.engine_dir, PageQuantSpec.from_dict(form["kv_pages"]),
                                            cfg.engine.kv_block_size, cfg.kv.layer_kl_budget, windows)
        form["kv_pages"] = pages.to_dict()
        metrics["kv_layer_widths"] = {k: record[k] for k in ("layer_bits", "budget", "share", "kl_sum", "tokens")}
    if cfg.engine.kv_block_size or cfg.engine.mixed_adapters:  # the serving form of that cache
        source = cfg.engine.cache_engine_dir
        serving = compile_engine(model_dir, source, *common, **form)
        metrics |= {"serving_engine": {"dir": str(source), "kv_block_size": cfg.engine.kv_block_size,
                                       "mixed_adapters": cfg.engine.mixed_adapters,
                                       "engine_builds": serving["engine_builds"],
                                       "interface_hash": serving["interface_hash"]}}
        if form["kv_pages"] is not None:
            metrics["serving_engine"]["kv_pages"] = form["kv_pages"]
        metrics["engine_builds"] += serving["engine_builds"]
    if cfg.engine.weights != "fp32":
        from tasks.weights.engines import ensure_quantized_engine

        metrics |= ensure_quantized_engine(source, layout.serving_engine_dir, cfg.engine.weights,
                                            cfg.engine.weight_block(), cfg.engine.weights_format(),
                                            weight_calibration_ids(cfg), threads=cfg.engine.threads,
                                            mixed_bits=cfg.engine.weight_mixed_bits, model_dir=model_dir)
    return metrics


def _not_about_torchvision(record: logging.LogRecord) -> bool:
    # The exporter's op registry warns at each export that torchvision, whose ops no backbone uses, is absent.
    return not record.getMessage().startswith("torchvision is not installed")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Their INFO is per node and per rewrite (dozens of lines per export, many the same); their warnings stay.
    logging.getLogger("onnx_ir").setLevel(logging.WARNING)
    logging.getLogger("onnxscript").setLevel(logging.WARNING)
    logging.getLogger("torch.onnx._internal.exporter._registration").addFilter(_not_about_torchvision)
    return stage_main(
        "Compile the backbone once into an engine with LoRA and KV cache as inputs.",
        lambda cfg: json.dumps(run_stage(cfg), indent=2, sort_keys=True),
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
