"""bench/lib/llama_cpp_peer.py: its rules without llama.cpp (milliseconds), and, where the `peer` extra is
installed, that the GGUF conversion is the same model as our engine (about 20 s)."""

import io
import tarfile

import numpy as np
import pytest

from bench.lib import llama_cpp_peer as peer
from bench.lib.backbones import RANK, SHAPES, TARGETS, embedded_tokenizer_dir, make_backbone_and_adapter


def test_an_unknown_pre_tokenizer_is_written_as_qwen2_and_known_ones_are_unchanged():
    class Converter:  # stands in for the converter's TextModel
        def get_vocab_base_pre(self, tokenizer):
            if tokenizer == "known":
                return "gpt-2"
            raise NotImplementedError("BPE pre-tokenizer was not recognized - update get_vocab_base_pre()")

    peer.accept_unknown_pre_tokenizer(Converter)
    peer.accept_unknown_pre_tokenizer(Converter)  # idempotent: one wrapper
    assert Converter().get_vocab_base_pre("known") == "gpt-2"
    assert Converter().get_vocab_base_pre("ours") == "qwen2"


def test_the_converter_is_extracted_once_from_the_sdist_and_nothing_else(tmp_path):
    sdist = tmp_path / "llama_cpp_python-9.9.tar.gz"
    files = {"convert_hf_to_gguf.py": b"# converter", "conversion/base.py": b"# base", "gguf-py/gguf/__init__.py": b"#",
             "src/llama.cpp": b"// not needed", "convert_lora_to_gguf.py": b"# lora", "tools/x.py": b"# not needed"}
    with tarfile.open(sdist, "w:gz") as tar:
        for rel, data in files.items():
            info = tarfile.TarInfo(f"llama_cpp_python-9.9/vendor/llama.cpp/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = peer.converter_dir(sdist)
    assert out == tmp_path / "llama_cpp_python-9.9" / "llama.cpp"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [
        "conversion/base.py", "convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "gguf-py/gguf/__init__.py"]
    (out / "convert_lora_to_gguf.py").unlink()  # as an older bench extracted it: no LoRA converter
    assert peer.converter_dir(sdist) == out and (out / "convert_lora_to_gguf.py").read_bytes() == b"# lora"
    sdist.unlink()
    assert peer.converter_dir(out.parent) == out  # an extracted directory is taken as it is
    with pytest.raises(SystemExit, match="sdist is missing"):
        peer.converter_dir(sdist)


def test_gguf_f32_is_the_same_model_as_our_fp32_engine_with_and_without_the_adapter(tmp_path, llama_peer):
    # given the tiny backbone and its random rank-8 adapter, our fp32 engine, and the same directories
    # converted by llama.cpp's converters (F32 model, F32 LoRA); when both run the same 24 token ids,
    # without and then with the adapter; then their logits agree both times
    llama_cpp, llama_dir = llama_peer
    from runtime.engine.backends.onnxruntime import OrtEngine
    from tasks.stages.compile import compile_engine

    peer.require_llama_cpp()
    from runtime.engine.adapter import load_adapter

    model_dir, adapter_dir = make_backbone_and_adapter(tmp_path, SHAPES["tiny"])
    compile_engine(model_dir, tmp_path / "engine", RANK, TARGETS, ort_threads=2)
    engine = OrtEngine(tmp_path / "engine", threads=2)  # no adapter bound: the backbone alone
    src = peer.gguf_source_dir(model_dir, embedded_tokenizer_dir(tmp_path), tmp_path / "gguf_src")
    gguf = peer.convert_to_gguf(llama_dir, src, tmp_path / "model-f32.gguf", "f32")
    lora_gguf = peer.convert_adapter_to_gguf(llama_dir, adapter_dir, src, tmp_path / "adapter-f32.gguf")

    ids = np.random.default_rng(1).integers(0, 512, (1, 24))
    logits = {}
    for name, lora in (("base", None), ("adapter", lora_gguf)):
        if lora is not None:
            engine.set_adapter(load_adapter(adapter_dir, engine.interface))
        ours, _ = engine.forward(ids, np.arange(24)[None], np.ones((1, 24), dtype=np.int64), None)
        llm = peer.load_llama(llama_cpp, gguf, 64, 2, flash_attn=True, lora=lora)
        llm.eval(ids[0].tolist())
        theirs = np.array(llm.scores[:24])
        llm.close()
        assert np.abs(ours[0] - theirs).max() < 1e-2, (name, np.abs(ours[0] - theirs).max())
        assert (ours[0].argmax(-1) == theirs.argmax(-1)).all(), name
        assert np.abs(ours).max() > 0.1  # the logits are not all near zero: the comparison means something
        logits[name] = ours[0]
    assert np.abs(logits["adapter"] - logits["base"]).max() > 0.1  # the adapter changed the model on both sides


def test_a_q8_0_gguf_without_extra_buffer_types_decodes_like_f32_and_the_defaults_are_left_as_they_were(tmp_path, llama_peer):
    # given the tiny backbone converted at F32 and at Q8_0 (on a CPU with AMX, llama.cpp's AMX buffers
    # for Q8_0 weights die of a general protection fault in this VM: the bench turns extra buffer types off)
    llama_cpp, llama_dir = llama_peer
    model_dir, _ = make_backbone_and_adapter(tmp_path, SHAPES["tiny"])
    src = peer.gguf_source_dir(model_dir, embedded_tokenizer_dir(tmp_path), tmp_path / "gguf_src")
    ids = np.random.default_rng(2).integers(0, 512, 24).tolist()
    logits = {}
    for outtype in ("f32", "q8_0"):
        gguf = peer.convert_to_gguf(llama_dir, src, tmp_path / f"model-{outtype}.gguf", outtype)
        llm = peer.load_llama(llama_cpp, gguf, 64, 2, flash_attn=True, extra_bufts=False)
        llm.eval(ids)
        logits[outtype] = np.array(llm.scores[:24])
        llm.close()
    # then Q8_0 decodes close to F32, and llama.cpp's defaults keep their extra buffer types for others
    assert 0 < np.abs(logits["q8_0"] - logits["f32"]).max() < 0.05 * np.abs(logits["f32"]).max()
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts
