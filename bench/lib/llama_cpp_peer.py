"""llama.cpp, the peer our engines are measured against: the `peer` extra it comes from, its converters (the
llama-cpp-python sdist vendors them), GGUF files, a model loaded for decoding, and the ``llama-server`` binary
that ``make bench-peer-server`` builds.

The converter writes a vocabulary, so a random backbone needs a tokenizer (``gguf_source_dir``); the embedded
default's (byte-level BPE with single digits, trained with ``tokenizers``) is not among the converter's known BPE
pre-tokenizers, so its hash check raises; in the converter's process ``accept_unknown_pre_tokenizer`` maps an
unknown one to ``"qwen2"`` (the closest: GPT-2 byte-level regex with single digits). No measured number depends
on it: the benchmarks feed token ids.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from bench.lib.report import REPO

PEER_VERSION = "0.3.36"  # llama-cpp-python, pinned in pyproject.toml's `peer` extra
SRC_ENV = "LLAMA_CPP_SRC"  # the sdist (.tar.gz) or a directory holding convert_hf_to_gguf.py
DEFAULT_SRC_DIR = Path(sys.prefix) / "llama_cpp_src"  # where `make bench-peer` downloads the sdist
# what the converters (model, LoRA adapter) need of llama.cpp
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/")
CONVERTER_SCRIPTS = tuple(p for p in CONVERTER_PARTS if p.endswith(".py"))
INSTALL_HINT = ("install the peer extra: `make bench-peer`, or `.venv/bin/pip install -e '.[peer]'` "
                "(compiles llama.cpp from source: 10-20 min on 2 cores)")
PRE_TOKENIZER = "qwen2"  # what an unknown BPE pre-tokenizer is written as (see the docstring)
SERVER_ENV = "LLAMA_SERVER"  # path of the llama-server binary
DEFAULT_SERVER = Path(sys.prefix) / "llama_server_build" / "bin" / "llama-server"  # where `make bench-peer-server` builds it
# A checkpoint's GGUF files: F16 and Q8_0 by the converter, the rest by llama_model_quantize from the F16 file
CHECKPOINT_GGUF_TYPES = ("f16", "q8_0", "q4_0", "q4_k_m")
CHECKPOINT_CONVERTER_TYPES = ("f16", "q8_0")


def accept_unknown_pre_tokenizer(model_class, fallback: str = PRE_TOKENIZER) -> None:
    """Make ``model_class.get_vocab_base_pre`` (the converter's hash table of known BPE
    pre-tokenizers) answer ``fallback`` for an unknown tokenizer instead of raising; known ones
    are unchanged. Applied in the converter's process only."""
    original = model_class.get_vocab_base_pre
    if getattr(original, "falls_back_to", None):
        return

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            print(f"llama.cpp converter: BPE pre-tokenizer not in the converter's list; written as {fallback!r} "
                  "(the benchmark feeds token ids: no measured number depends on it)", file=sys.stderr)
            return fallback

    get_vocab_base_pre.falls_back_to = fallback
    model_class.get_vocab_base_pre = get_vocab_base_pre


# ---------------------------------------------------------------- install, source, conversion

def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError as err:
        raise SystemExit(f"error: llama-cpp-python is not installed ({err}); {INSTALL_HINT}") from None
    import logging

    # llama.cpp's per-tensor load/quantize log off, its warnings kept: the binding maps ggml's INFO to
    # logging.WARNING and WARN to ERROR (what Llama(verbose=False) sets too)
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    if llama_cpp.__version__ != PEER_VERSION:
        print(f"warning: llama-cpp-python {llama_cpp.__version__} installed, the peer extra pins {PEER_VERSION}")
    return llama_cpp


def converter_dir(src: str | Path | None = None) -> Path:
    """The llama.cpp directory holding ``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``,
    ``conversion/`` and ``gguf-py/``.

    ``src`` (else ``$LLAMA_CPP_SRC``, else ``.venv/llama_cpp_src/llama_cpp_python-<version>.tar.gz``)
    is the sdist or a directory: a llama.cpp checkout, an extracted sdist, or what this function
    extracted. An sdist is extracted once, only the converter's parts, next to it
    (``<sdist name>/llama.cpp/``)."""
    src = Path(src or os.environ.get(SRC_ENV) or DEFAULT_SRC_DIR / f"llama_cpp_python-{PEER_VERSION}.tar.gz")
    if src.is_dir():
        for cand in (src, src / "llama.cpp", src / "vendor" / "llama.cpp"):
            if all((cand / f).is_file() for f in CONVERTER_SCRIPTS):
                return cand
        raise SystemExit(f"error: {src}: no {' and '.join(CONVERTER_SCRIPTS)} (nor in llama.cpp/ or vendor/llama.cpp/)")
    if not src.is_file():
        raise SystemExit(
            f"error: {src}: the llama-cpp-python sdist is missing (its vendored llama.cpp holds the GGUF converter); "
            f"`.venv/bin/pip download --no-deps --no-binary :all: -d {src.parent} llama-cpp-python=={PEER_VERSION}` "
            f"or `make bench-peer` fetches it, or pass --llama-cpp-src / ${SRC_ENV}")
    out = src.parent / src.name.removesuffix(".tar.gz") / "llama.cpp"
    if all((out / f).is_file() for f in CONVERTER_SCRIPTS):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".extract-"))
    try:
        with tarfile.open(src) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/", 3)  # <sdist>/vendor/llama.cpp/<rest>
                if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"] and parts[3].startswith(CONVERTER_PARTS):
                    m.name = parts[3]
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        missing = [f for f in CONVERTER_SCRIPTS if not (tmp / f).is_file()]
        if missing:
            raise SystemExit(f"error: {src}: no vendor/llama.cpp/{missing[0]} in the archive")
        shutil.rmtree(out, ignore_errors=True)  # an extraction by an older bench, without the LoRA converter
        os.replace(tmp, out)  # complete or absent: never a half-extracted converter
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _converter_imports(llama_dir: str) -> None:
    """The vendored converter's modules and gguf-py first on the path, the pre-tokenizer fallback on."""
    sys.path[:0] = [llama_dir, str(Path(llama_dir) / "gguf-py")]
    import conversion.base

    accept_unknown_pre_tokenizer(conversion.base.TextModel)


def run_converter(llama_dir: str, hf_dir: str, outfile: str, outtype: str) -> None:
    """The vendored ``convert_hf_to_gguf.main()``, with the vendored gguf-py and the pre-tokenizer
    fallback; run in a child process (``convert_to_gguf``) so neither leaks into the benchmark."""
    _converter_imports(llama_dir)
    import convert_hf_to_gguf

    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outfile", outfile, "--outtype", outtype]
    convert_hf_to_gguf.main()


def run_lora_converter(llama_dir: str, adapter_dir: str, hf_dir: str, outfile: str) -> None:
    """The vendored ``convert_lora_to_gguf.py`` (a script: its work is under ``__main__``) on a PEFT
    adapter, F32, the base's config from ``hf_dir``; in a child process, like ``run_converter``."""
    import runpy

    _converter_imports(llama_dir)
    sys.argv = ["convert_lora_to_gguf.py", adapter_dir, "--base", hf_dir, "--outfile", outfile, "--outtype", "f32"]
    runpy.run_path(str(Path(llama_dir) / "convert_lora_to_gguf.py"), run_name="__main__")


def _run_in_child(function: str, args: list, outfile: Path, what: str) -> Path:
    code = f"import sys; from bench.lib.llama_cpp_peer import {function}; {function}(*sys.argv[1:])"
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0 or not outfile.is_file():
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return outfile


def convert_to_gguf(llama_dir: Path, hf_dir: Path, outfile: Path, outtype: str) -> Path:
    return _run_in_child("run_converter", [llama_dir, hf_dir, outfile, outtype], outfile,
                         f"convert_hf_to_gguf.py --outtype {outtype}")


def convert_adapter_to_gguf(llama_dir: Path, adapter_dir: Path, hf_dir: Path, outfile: Path) -> Path:
    return _run_in_child("run_lora_converter", [llama_dir, adapter_dir, hf_dir, outfile], outfile,
                         f"convert_lora_to_gguf.py {adapter_dir}")


def quantize_gguf(llama_cpp, src: Path, dst: Path, ftype: int, threads: int) -> Path:
    """llama.cpp's quantizer (``llama-quantize``) with its default parameters but the type."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise RuntimeError(f"llama_model_quantize {src} -> {dst} failed ({rc})")
    return dst


def gguf_tensors(path: Path, llama_dir: Path) -> list:
    """The tensors of a GGUF file, read by the converter's own gguf-py (the version that wrote it)."""
    if str(llama_dir / "gguf-py") not in sys.path:
        sys.path.insert(0, str(llama_dir / "gguf-py"))
    from gguf import GGUFReader

    return list(GGUFReader(path).tensors)


def gguf_tensor_bytes(path: Path, llama_dir: Path) -> dict[str, int]:
    return {t.name: int(t.n_bytes) for t in gguf_tensors(path, llama_dir)}


def gguf_tensor_types(path: Path, llama_dir: Path) -> dict[str, int]:
    """How many tensors of the file have each GGML type (llama.cpp's quantizer keeps some at others)."""
    return dict(Counter(t.tensor_type.name for t in gguf_tensors(path, llama_dir)))


def gguf_source_dir(model_dir: Path, tokenizer_dir: Path, out: Path) -> Path:
    """A Hugging Face directory for the converter: the backbone's files (links) plus the tokenizer."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"].values()
    if max(ids) >= vocab:
        raise SystemExit(f"error: {tokenizer_dir}: token ids up to {max(ids)} do not fit the backbone's vocabulary {vocab}")
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        (out / f.name).symlink_to(f.resolve())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    return out


def checkpoint_ggufs(llama_cpp, llama_dir: Path, model_dir: Path, out: Path, threads: int) -> dict[str, Path]:
    """``CHECKPOINT_GGUF_TYPES`` of a Hugging Face checkpoint, each written once (a file present is complete:
    written under another name and renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    ftypes = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M}
    paths = {}
    for t in CHECKPOINT_GGUF_TYPES:
        path, part = out / f"model-{t}.gguf", out / f"model-{t}.gguf.part"
        if not path.is_file():
            if t in CHECKPOINT_CONVERTER_TYPES:
                convert_to_gguf(llama_dir, model_dir, part, t)
            else:
                quantize_gguf(llama_cpp, paths["f16"], part, ftypes[t], threads)
            os.replace(part, path)
        paths[t] = path
    return paths


# ---------------------------------------------------------------- decoding, serving

def load_llama(llama_cpp, path: Path, n_ctx: int, threads: int, flash_attn: bool, lora: Path | None = None,
               kv_type: int | None = None, extra_bufts: bool = True, logits_all: bool = True):
    """llama.cpp's defaults (weights mapped, F16 KV cache) but threads and flash attention; logits
    of every position, as our engine returns them (``logits_all`` False: of each batch's last token only,
    as a server's prefill computes them). ``lora``: a GGUF adapter applied at run time
    (scale 1: the file carries alpha, llama.cpp applies alpha / r), the base weights untouched.
    ``kv_type``: a ``GGML_TYPE_*`` for K and V (a quantized V cache needs flash attention).
    ``extra_bufts`` False: quantized weights stay in plain CPU buffers (llama.cpp's
    ``--no-repack``): on a CPU with AMX, llama.cpp puts Q4_0/Q8_0 weights in its AMX buffers, and
    their matmul (``ggml_backend_amx_mul_mat``) dies of a general protection fault in this VM."""
    cache = {} if kv_type is None else {"type_k": kv_type, "type_v": kv_type}
    lib = llama_cpp.llama_cpp
    default_params = lib.llama_model_default_params

    def model_params():  # Llama() takes no use_extra_bufts: it starts from these defaults
        params = default_params()
        params.use_extra_bufts = extra_bufts
        return params

    lib.llama_model_default_params = model_params
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                               n_threads_batch=threads, n_gpu_layers=0, logits_all=logits_all, flash_attn=flash_attn,
                               lora_path=str(lora) if lora else None, verbose=False, **cache)
    finally:
        lib.llama_model_default_params = default_params


def llama_steps(llm, vocab_size: int, P: int | None, prefill: int = 128, saved_past: dict | None = None):
    """``engine_steps`` for llama.cpp, on the same token ids: one token after a past of P (the
    past is evaluated once; every call resets ``n_tokens`` to P, so ``eval`` first drops the KV
    cells >= P), or a prefill (P=None) from an empty cache. ``saved_past``: the past's KV cells
    (``llama_state_seq_get_data``) are written into it after the past is evaluated, and a later
    context of the same file and cache types given it back restores them instead of evaluating again."""
    rng = np.random.default_rng(0)
    if P is None:
        ids = rng.integers(0, vocab_size, (1, prefill))[0].tolist()

        def prefill_step():
            llm.n_tokens = 0
            llm.eval(ids)

        return prefill_step
    ids = rng.integers(0, vocab_size, (1, P + 1))[0].tolist()
    llm.reset()
    if saved_past:
        import llama_cpp

        if not llama_cpp.llama_state_seq_set_data(llm.ctx, saved_past["kv"], len(saved_past["kv"]), 0):
            raise RuntimeError(f"llama.cpp refused the saved past of {P} tokens")
    else:
        llm.eval(ids[:P])
        if saved_past is not None:
            import llama_cpp

            buf = (ctypes.c_uint8 * llama_cpp.llama_state_seq_get_size(llm.ctx, 0))()
            saved_past["kv"] = buf
            llama_cpp.llama_state_seq_get_data(llm.ctx, buf, len(buf), 0)

    def decode_step():
        llm.n_tokens = P
        llm.eval(ids[P:])
        return llm.scores[P]  # the new token's logits, as engine_steps returns the engine's (a view: no copy)

    return decode_step


def llama_server_binary(given: str | None) -> Path:
    path = Path(given or os.environ.get(SERVER_ENV) or DEFAULT_SERVER)
    if not os.access(path, os.X_OK):
        raise SystemExit(f"error: {path}: no llama-server binary; `make bench-peer-server` builds it from the "
                         f"`peer` sdist, or pass --llama-server / ${SERVER_ENV}")
    return path
