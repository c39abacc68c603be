"""Loading a base model and its tokenizer, the embedded default's or a user's Qwen2/Llama checkpoint.

A base-model directory is checked before anything heavy is loaded (``check_base_model_dir``), and its
tokenizer is checked to encode as the device's does (``load_tokenizer``).
"""

from __future__ import annotations

from pathlib import Path

from tasks.config import StageError

CARD = "base_model_card.json"


class BaseModelError(StageError, ValueError):
    """A base-model directory that cannot be used; the message names the path."""


def check_base_model_dir(path: Path) -> dict:
    """Refuse, before anything heavy is loaded, a directory the engine cannot reproduce or the device
    cannot serve: a config key it does not compute (``runtime.engine.backbone_config.BackboneConfig.from_hf``), weights
    that are pickled only, a missing shard or tensor, a tokenizer without tokenizer.json or eos. Reads
    JSON and safetensors headers only; returns config.json."""
    from runtime.engine.backbone_config import CONFIG_FILE, BackboneConfig, ModelFormatError
    from runtime.engine.model import read_hf_config, weight_files
    from runtime.engine.tokenizer import TOKENIZER_FILE, DeviceTokenizer, TokenizerError

    path = Path(path)
    try:
        config = read_hf_config(path)
        cfg = BackboneConfig.from_hf(config, str(path / CONFIG_FILE))
        pickled = sorted(path.glob("*.bin"))
        if pickled and not any(path.glob("*.safetensors")):
            raise BaseModelError(f"{pickled[0]}: pickled weights are not loaded (unpickling can run code); "
                                 "save the model with save_pretrained, which writes safetensors")
        weight_files(path, cfg)
        if not (path / TOKENIZER_FILE).is_file():
            raise BaseModelError(f"{path / TOKENIZER_FILE}: missing; the device tokenizes with it "
                                 "(save the fast tokenizer with save_pretrained)")
        DeviceTokenizer(path)
    except (ModelFormatError, TokenizerError) as err:
        raise BaseModelError(str(err)) from None
    return config


_PROBE = "inspect board=PCB-0042 offset_um=37 verdict: PASS"  # letters, digits, spaces, punctuation


def load_tokenizer(path: Path):
    """The transformers tokenizer of a model directory, with ``stop_ids`` set as the device's
    (``runtime.engine.tokenizer.DeviceTokenizer``). Refused when it encodes a prompt or names eos otherwise
    than the device's tokenizer would: training and evaluation must see the device's token ids."""
    from transformers import AutoTokenizer

    from runtime.engine.tokenizer import DeviceTokenizer, TokenizerError, encode_prompt

    try:
        device = DeviceTokenizer(path)
    except TokenizerError as err:
        raise BaseModelError(str(err)) from None
    tokenizer = AutoTokenizer.from_pretrained(path)
    ours, theirs = encode_prompt(tokenizer, _PROBE), device.encode(_PROBE)
    if ours != theirs:
        raise BaseModelError(f"{path}: transformers encodes {_PROBE!r} as {ours[:4]}..., tokenizer.json as "
                             f"{theirs[:4]}...; align add_bos_token/add_eos_token in tokenizer_config.json "
                             "with the post_processor of tokenizer.json")
    if tokenizer.eos_token_id != device.eos_id:
        raise BaseModelError(f"{path}: transformers' eos token id {tokenizer.eos_token_id} is not "
                             f"{device.eos_id}, eos_token of tokenizer_config.json")
    tokenizer.stop_ids = device.stop_ids
    tokenizer.device_tokenizer = device  # chats are rendered by the device's encode_chat, nowhere else
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base_model(path: Path):
    """Load (model, tokenizer) in fp32 from a local Qwen2 or Llama directory; never from a hub."""
    import torch
    from transformers import AutoModelForCausalLM

    check_base_model_dir(path)
    quiet_model_loading()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    model.eval()
    return model, load_tokenizer(path)


def quiet_model_loading() -> None:
    """What loading the base and wrapping it in PEFT prints once per stage and no one can act on: the
    weight-loading bar of a local checkpoint that loads in about a second (its first frame stays in a
    log file, alike in every stage), and the FutureWarning PEFT's wrapper raises by reading
    transformers' deprecated ``is_gradient_checkpointing``. Other warnings still show."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)


def load_release_backbone(base_dir: Path, adapter_dir: Path, engine_dir: Path | None = None):
    """The runtime's backbone (``runtime.engine.model``) with the adapter merged (exact to fp32): what the KV checks
    and engine parity run in PyTorch.

    The adapter is validated by ``runtime.engine.adapter.load_adapter`` (provenance included) against
    the compiled engine's interface when ``engine_dir`` is given, else against an interface
    shaped after the adapter itself; an adapter made for another backbone is refused either way.
    Returns (backbone, base hash, interface hash of the engine or "").
    """
    import torch

    from runtime.engine.adapter import load_adapter
    from runtime.engine.adapter_config import read_adapter_config
    from runtime.engine.hashing import backbone_hash
    from runtime.engine.interface import build_interface, read_interface
    from runtime.engine.model import load_backbone, read_config

    if engine_dir is not None:
        iface = read_interface(engine_dir)
        interface_hash = iface.lora_contract_hash
    else:
        acfg = read_adapter_config(adapter_dir)
        iface = build_interface(read_config(base_dir), backbone_hash(base_dir), max_rank=acfg.r,
                                target_modules=acfg.target_modules)
        interface_hash = ""
    lora = {k: torch.from_numpy(v) for k, v in load_adapter(adapter_dir, iface).items()}
    return load_backbone(base_dir, merged_lora=lora), iface.backbone_hash, interface_hash
