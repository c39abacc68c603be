"""The engine interface: the versioned contract between a compiled engine and its adapters.

Written as ``engine/interface.json`` next to the engine. Every adapter and release manifest
records the ``interface_hash`` it was made for, and the runtime refuses a mismatch before
any inference. Bump ``INTERFACE_VERSION`` whenever the meaning of an input changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kernels.kv_spec import KEY_BASE_WIDTH, PageQuantSpec, key_code_shape, packed_size
from runtime.engine.backbone_config import BackboneConfig
from runtime.engine.errors import RefusedInput

# 1: ids/positions/mask + per-layer past K/V (B, nkv, P, d) + unmerged LoRA A/B/scale inputs per module.
# 2, 4 and 5 (no longer read): the static quantized KV cache, per-channel scales calibrated per release and bound
#    as inputs (``kv_spec``), removed for quantized pages (version 9; docs/kv-cache-real-weights.md). A runtime
#    refuses those engines: recompile.
# 3: version 1 with the LoRA inputs of each fused linear stacked into one A and one block-diagonal B, the scale
#    folded into B (``lora_input_names``).
# 6: a paged cache: per layer a POOL of fixed-size blocks ``pool_*.i`` (blocks, nkv, kv_block_size, d) and one
#    ``block_table`` (B, max_blocks) int64 instead of the per-row past; the graph outputs only the new tokens'
#    slots ``new_*.i`` (B, nkv, T, d), which the runtime writes into each row's blocks (``paged_kv_tensors``).
#    Version 3 still loads (padded path).
# 7: stacked adapters (a cache of version 3 or 6): the LoRA of S resident slots at once and a per-row slot choice,
#    so rows of different releases decode in one forward (``stacked_interface``). Versions 3 and 6 still load and
#    serve one release per batch.
# 8: any of the above (stacked or not) with a last input ``logit_positions`` (batch, positions) int64: the
#    positions of each row whose hidden states go through the final norm and LM head; ``logits`` is (batch,
#    positions, vocab). A server samples from the last position only: a prefill's logits for every prompt token
#    (2,048 x 151,936 floats = 1.2 GB at the 0.5B shape) are never computed. Recorded as ``logit_positions``
#    (hashed); the LoRA contract is unchanged, so adapters of the engine without it bind
#    (``float_interface_hash``). Versions 3, 6 and 7 still load: their forward returns every position's logits.
# 9: quantized pages (``kv_pages``, a kernels.kv_spec.PageQuantSpec dict, hashed): version 8's float paged cache
#    (stacked or not) whose full pages the runtime seals into codes, scales and minima. Each row's float pages (its
#    first page, the sink, and its open page) are read from the float pools ``pool_key.i`` / ``pool_value.i`` through
#    ``float_block_table`` (B, float_blocks <= 2); its sealed pages from the pools ``quantized_pages_tensors`` lists
#    through ``block_table`` (B, max_blocks). The mask covers float slots, sealed slots, new tokens, in that order.
#    The graph outputs the new tokens' float K/V (``new_*.i``), as version 6. No release statics: a release of the
#    float engine binds unchanged (``float_interface_hash``).
INTERFACE_VERSION = 3
PAGED_INTERFACE_VERSION = 6
STACKED_INTERFACE_VERSION = 7
LOGIT_POSITIONS_INTERFACE_VERSION = 8
QUANTIZED_PAGES_INTERFACE_VERSION = 9
SUPPORTED_VERSIONS = (INTERFACE_VERSION, PAGED_INTERFACE_VERSION, STACKED_INTERFACE_VERSION, LOGIT_POSITIONS_INTERFACE_VERSION,
                      QUANTIZED_PAGES_INTERFACE_VERSION)
INTERFACE_FILE = "interface.json"
ENGINE_ONNX = "model.onnx"  # beside it in an engine folder (tasks/stages/compile.py)
CACHE_KEY_FILE = "cache_key.json"  # what the engine was built from; its presence means the build completed
KV_LAYOUT = "B,num_kv_heads,past_len,head_dim"  # one key and one value tensor per layer
PAGED_KV_LAYOUT = "blocks,num_kv_heads,block_size,head_dim"  # one pool per cache tensor and layer
BLOCK_TABLE = "block_table"
FLOAT_BLOCK_TABLE = "float_block_table"  # version 9: each row's float pages, the sink's block first
FLOAT_PAGES = 2  # version 9: float pages a row holds at most, its first and its open one
SEALED_BLOCKS_AXIS = "sealed_blocks"  # version 9: the sealed pools' first axis ("blocks": the float pools')
# version 9: what a sealed page stores per layer, one pool each, in the graph's input order (quantized_pages_tensors)
SEALED_ROLES = ("key_codes", "key_scale", "key_min", "key_base", "value_codes", "value_scale", "value_min")
LOGIT_POSITIONS = "logit_positions"
ADAPTER_MASK = "adapter_mask"  # version 7: (batch, slots) float32, one-hot: the slot each row decodes with
SLOTS_AXIS = "slots"  # version 7: the bound adapters; a LoRA input's rank axis is "slots*<n r>" (slot after slot)


def slots_axis(rank: int) -> str:
    """The name of a stacked LoRA input's rank axis: ``rank`` columns per slot, slot after slot."""
    return f"{SLOTS_AXIS}*{rank}"


def per_slot(axis):
    """An axis as one adapter gives it: ``slots_axis(r)`` -> r; any other axis unchanged."""
    return int(axis.split("*")[1]) if isinstance(axis, str) and axis.startswith(SLOTS_AXIS + "*") else axis


# The backbone's fused linears (runtime.engine.model): the modules of one read the same input through one matmul.
FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def lora_groups(modules: tuple[str, ...]) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(targeted modules, all modules) of every fused linear with a LoRA target, in layer order.

    A fused linear takes one LoRA: A stacks the targets' A matrices (n r_max, in), B is block-diagonal
    (out of the whole fused linear, n r_max) with each target's scale folded in; the rows of an
    untargeted member are zero. Two graph ops per fused linear instead of three per module: at
    0.5B width with int4 weights the per-module inputs cost 7-9% of a decode step (bench.engine.weight_quant_bench).
    """
    return [(tuple(m for m in fused if m in modules), fused) for fused in FUSED_LINEARS if any(m in modules for m in fused)]


def lora_group_name(targeted: tuple[str, ...]) -> str:
    return "+".join(targeted)


def lora_input_names(num_layers: int, modules: tuple[str, ...]) -> list[str]:
    """Flat order of the LoRA inputs: per layer, per fused linear with a target, A then B."""
    return [f"lora_{kind}.{i}.{lora_group_name(targeted)}" for i in range(num_layers)
            for targeted, _ in lora_groups(modules) for kind in ("A", "B")]


class InterfaceError(RefusedInput):
    """An engine, adapter or manifest that does not match the interface it claims."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy spelling: "float32", "int64"
    shape: tuple  # ints for fixed axes, strings for dynamic ones ("batch", "seq", "past", "total")


@dataclass(frozen=True)
class EngineInterface:
    version: int
    backbone_hash: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_rank: int
    target_modules: tuple[str, ...]
    module_shapes: dict  # module -> [in_features, out_features], every member of a fused linear with a target
    kv_layout: str
    kv_dtype: str  # "float32": what a padded or float paged cache holds (quantized pages: ``kv_pages``)
    inputs: tuple[TensorSpec, ...] = field(default_factory=tuple)
    outputs: tuple[TensorSpec, ...] = field(default_factory=tuple)
    # Hash of the same engine with a float, padded cache and every position's logits (version 3): the LoRA
    # contract an adapter was made for is identical, so an adapter bound to the float engine also runs on
    # the paged, stacked, logit-selecting one or the one with quantized pages.
    float_interface_hash: str | None = None
    kv_block_size: int | None = None  # tokens per block of a paged cache (version 6); None = padded
    # How the graph stores the backbone weights, e.g. {"precision": "int4", "format": "matmulnbits",
    # "block_size": 128}; None = fp32. Recorded, not hashed: the LoRA contract is the same, so an
    # adapter made for the float engine binds to its weight-quantized copy.
    weights: dict | None = None
    logit_positions: bool = False  # version 8: a LOGIT_POSITIONS input selects where logits are computed
    kv_pages: dict | None = None  # version 9: PageQuantSpec.to_dict() of the quantized pages; None = none

    @property
    def lora_contract_hash(self) -> str:
        """The hash an adapter and its release record: the float engine's, which every engine of the same backbone
        and LoRA inputs accepts (paged, logit-selecting, with quantized pages or not)."""
        return self.float_interface_hash or self.interface_hash

    @property
    def weight_precision(self) -> str:
        return self.weights["precision"] if self.weights else "fp32"

    @property
    def paged(self) -> bool:
        return self.kv_block_size is not None

    @property
    def quantized_pages(self) -> bool:
        return self.kv_pages is not None

    @property
    def stacked(self) -> bool:
        """Whether rows of different adapters decode in one forward (version 7: ``stacked_interface``)."""
        return ADAPTER_MASK in self.input_names

    def adapter_shape(self, spec: TensorSpec) -> tuple:
        """The shape one adapter gives a LoRA input: ``spec.shape`` without the stacked engine's slot axis, so an
        adapter binds to every version alike."""
        return tuple(per_slot(a) for a in spec.shape)

    @property
    def accepted_hashes(self) -> set[str]:
        """The interface hashes an adapter or release made for this engine may record: its own, the padded float
        engine's (``float_interface_hash``) and, stacked, its single-adapter form's (``single_interface``)."""
        single = single_interface(self).interface_hash if self.stacked else None
        return {self.interface_hash, self.float_interface_hash, single} - {None}

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    @property
    def lora_names(self) -> list[str]:
        return lora_input_names(self.num_layers, self.target_modules)

    def slot_bytes(self, axis: str = "past") -> int:
        """Bytes one row of the cache inputs with the dynamic ``axis`` holds per slot, every layer: their fixed
        dimensions times their item size ("past": a padded cache's K and V; "blocks": a paged cache's block;
        ``SEALED_BLOCKS_AXIS``: a sealed page's codes, scales and minima)."""
        return sum(int(np.prod([a for a in t.shape if isinstance(a, int)])) * np.dtype(t.dtype).itemsize
                   for t in self.inputs if axis in t.shape)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes a row's cache grows by per token, every layer: a padded cache's slot (``slot_bytes``), a paged
        cache's block over the tokens it holds (quantized pages: a sealed page's, what a long row holds per token)."""
        if self.quantized_pages:
            return self.slot_bytes(SEALED_BLOCKS_AXIS) // self.kv_block_size
        return self.slot_bytes("blocks") // self.kv_block_size if self.paged else self.slot_bytes("past")

    def to_dict(self) -> dict:
        d = asdict(self)
        # absent, not null: each engine keeps the hash it had before the field existed
        for key in ("float_interface_hash", "kv_block_size", "kv_pages"):
            if d[key] is None:
                del d[key]
        if self.weights is None:
            del d["weights"]
        if not self.logit_positions:
            del d["logit_positions"]
        d["target_modules"] = list(self.target_modules)
        for key in ("inputs", "outputs"):
            d[key] = [{"name": t["name"], "dtype": t["dtype"], "shape": list(t["shape"])} for t in d[key]]
        return d

    @property
    def interface_hash(self) -> str:
        """sha256 of the canonical JSON of everything above but ``weights`` (backbone hash included)."""
        d = self.to_dict()
        d.pop("weights", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict) -> "EngineInterface":
        d = dict(d)
        claimed = d.pop("interface_hash", None)
        d.pop("exporter", None)
        d["target_modules"] = tuple(d["target_modules"])
        for key in ("inputs", "outputs"):
            d[key] = tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in d[key])
        iface = cls(**d)
        if claimed is not None and claimed != iface.interface_hash:
            raise InterfaceError(
                f"interface hash {claimed[:12]} does not match its content ({iface.interface_hash[:12]}); "
                "the file was edited or corrupted"
            )
        return iface


def paged_kv_tensors(padded: EngineInterface, block_size: int) -> tuple[list, list]:
    """(pool inputs, new-slot outputs) of the paged engine made from the ``padded`` interface (version 3): each
    per-row cache input ``past_X.i`` (batch, nkv, past, d) becomes ``pool_X.i`` (blocks, nkv, block_size, d) of
    the same dtype, read through ``block_table``; its output is ``new_X.i`` (batch, nkv, seq, d), the new tokens'
    slots as ``present_X.i`` would end."""
    pools, outputs = [], []
    for t in padded.inputs:
        if t.name.startswith("past_"):
            rest = t.name[len("past_"):]
            pools.append(TensorSpec(f"pool_{rest}", t.dtype, ("blocks", t.shape[1], block_size, t.shape[3])))
            outputs.append(TensorSpec(f"new_{rest}", t.dtype, ("batch", t.shape[1], "seq", t.shape[3])))
    return pools, outputs


def quantized_pages_tensors(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, spec: dict) -> list:
    """The sealed pools of a version-9 engine, as TensorSpecs (``kernels.kv_spec.PageQuantSpec`` says what a page holds).

    Per layer i, each (sealed_blocks, nkv, ·, ·), in the order of ``SEALED_ROLES``:
      pool_key_codes.i    uint8 (.., kernels.kv_spec.key_code_shape): keys' codes, bit-packed across tokens at 2
                          and 4 bits, else across channels (kernels.bit_packing.pack_bits)
      pool_key_scale.i    uint8 (.., 1, d): per channel over the page, in units of the page's scale unit
      pool_key_min.i      uint8 (.., 1, d): per channel, in minimum units above the page's minimum origin
      pool_key_base.i     float16 (.., 1, 3): the page's scale unit, minimum origin, minimum unit (kernels.page_quant.key_grid)
      pool_value_codes.i  uint8 (.., bs, packed d)
      pool_value_scale.i  float16 (.., bs, d / group): per token and group of channels
      pool_value_min.i    float16 (.., bs, d / group)
    """
    pages = PageQuantSpec.from_dict(spec)
    nkv, d, bs, groups = num_kv_heads, head_dim, block_size, head_dim // pages.v_group_size

    def roles(layer: PageQuantSpec) -> dict:
        return {"key_codes": ("uint8", *key_code_shape(layer.k_bits, bs, d)), "key_scale": ("uint8", 1, d),
                "key_min": ("uint8", 1, d), "key_base": ("float16", 1, KEY_BASE_WIDTH),
                "value_codes": ("uint8", bs, packed_size(d, layer.v_bits)), "value_scale": ("float16", bs, groups),
                "value_min": ("float16", bs, groups)}

    per_layer = [roles(pages.layer(i)) for i in range(num_layers)]
    return [TensorSpec(f"pool_{role}.{i}", per_layer[i][role][0], (SEALED_BLOCKS_AXIS, nkv, *per_layer[i][role][1:]))
            for i in range(num_layers) for role in SEALED_ROLES]


def pages_interface(paged: EngineInterface, kv_pages: dict) -> EngineInterface:
    """The version-9 form of a float paged interface with logit positions (version 8, stacked or not): the float pools
    hold each row's sink and open page (``FLOAT_BLOCK_TABLE``), its sealed pages come from the pools of
    ``quantized_pages_tensors`` (``BLOCK_TABLE``)."""
    if not (paged.paged and paged.logit_positions):
        raise ValueError(f"interface version {paged.version} is not a float paged cache with logit positions")
    pools = [t for t in paged.inputs if t.name.startswith("pool_")]
    head = list(paged.inputs[: paged.input_names.index(pools[0].name)])  # ids, positions, mask, block table
    rest = list(paged.inputs[paged.input_names.index(pools[-1].name) + 1 :])  # LoRA, adapter mask, logit positions
    float_table = TensorSpec(FLOAT_BLOCK_TABLE, "int64", ("batch", "float_blocks"))
    sealed = quantized_pages_tensors(paged.num_layers, paged.num_kv_heads, paged.head_dim, paged.kv_block_size, kv_pages)
    return EngineInterface(**{**paged.__dict__, "version": QUANTIZED_PAGES_INTERFACE_VERSION, "kv_pages": dict(kv_pages),
                              "inputs": tuple(head + [float_table] + pools + sealed + rest)})


def build_interface(
    cfg: BackboneConfig, backbone_hash: str, max_rank: int, target_modules: tuple[str, ...],
    kv_block_size: int | None = None, stacked: bool = False, logit_positions: bool = False, kv_pages: dict | None = None,
) -> EngineInterface:
    """The interface of the float-KV engine (version 3); with ``kv_block_size``, of its paged form (version 6);
    ``stacked``: either's stacked-adapter form (version 7); with ``logit_positions``, any of them with the
    ``LOGIT_POSITIONS`` input last (version 8); with ``kv_pages`` (a ``PageQuantSpec`` dict), the float paged one
    of version 8 with quantized pages (version 9)."""
    if kv_pages is not None:
        if kv_block_size is None or not logit_positions:
            raise ValueError("quantized pages are a float paged cache with logit positions: kv_block_size and "
                             "logit_positions")
        return pages_interface(build_interface(cfg, backbone_hash, max_rank, target_modules, kv_block_size, stacked,
                                               logit_positions=True), kv_pages)
    if logit_positions:
        whole = build_interface(cfg, backbone_hash, max_rank, target_modules, kv_block_size, stacked)
        logits = TensorSpec("logits", "float32", ("batch", "positions", cfg.vocab_size))
        return EngineInterface(
            **{**whole.__dict__, "version": LOGIT_POSITIONS_INTERFACE_VERSION, "logit_positions": True,
               "inputs": whole.inputs + (TensorSpec(LOGIT_POSITIONS, "int64", ("batch", "positions")),),
               "outputs": (logits,) + whole.outputs[1:],
               "float_interface_hash": whole.float_interface_hash or whole.interface_hash})
    if stacked:
        return stacked_interface(build_interface(cfg, backbone_hash, max_rank, target_modules, kv_block_size))
    if kv_block_size is not None:
        if kv_block_size < 1:
            raise ValueError(f"kv_block_size={kv_block_size}: a paged cache needs blocks of at least one token")
        padded = build_interface(cfg, backbone_hash, max_rank, target_modules)
        pools, new_slots = paged_kv_tensors(padded, kv_block_size)
        head = [t for t in padded.inputs if t.name in ("input_ids", "position_ids", "attention_mask")]
        lora = [t for t in padded.inputs[len(head):] if not t.name.startswith("past_")]
        return EngineInterface(
            **{**padded.__dict__, "version": PAGED_INTERFACE_VERSION, "kv_layout": PAGED_KV_LAYOUT,
               "inputs": tuple(head + [TensorSpec(BLOCK_TABLE, "int64", ("batch", "max_blocks"))] + pools + lora),
               "outputs": padded.outputs[:1] + tuple(new_slots), "kv_block_size": kv_block_size,
               "float_interface_hash": padded.interface_hash})
    L, nkv, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    inputs = [
        TensorSpec("input_ids", "int64", ("batch", "seq")),
        TensorSpec("position_ids", "int64", ("batch", "seq")),
        TensorSpec("attention_mask", "int64", ("batch", "total")),
    ]
    for i in range(L):
        inputs += [
            TensorSpec(f"past_key.{i}", "float32", ("batch", nkv, "past", d)),
            TensorSpec(f"past_value.{i}", "float32", ("batch", nkv, "past", d)),
        ]
    groups = lora_groups(tuple(target_modules))
    for i in range(L):
        for targeted, fused in groups:
            name, rank = lora_group_name(targeted), len(targeted) * max_rank
            fan_in, fan_out = cfg.module_shape(fused[0])[0], sum(cfg.module_shape(m)[1] for m in fused)
            inputs += [TensorSpec(f"lora_A.{i}.{name}", "float32", (rank, fan_in)),
                       TensorSpec(f"lora_B.{i}.{name}", "float32", (fan_out, rank))]
    outputs = [TensorSpec("logits", "float32", ("batch", "seq", cfg.vocab_size))]
    for i in range(L):
        outputs += [
            TensorSpec(f"present_key.{i}", "float32", ("batch", nkv, "total", d)),
            TensorSpec(f"present_value.{i}", "float32", ("batch", nkv, "total", d)),
        ]
    return EngineInterface(
        version=INTERFACE_VERSION,
        backbone_hash=backbone_hash,
        num_layers=L,
        num_kv_heads=nkv,
        head_dim=d,
        vocab_size=cfg.vocab_size,
        max_rank=max_rank,
        target_modules=tuple(target_modules),
        module_shapes={m: list(cfg.module_shape(m)) for _, fused in groups for m in fused},
        kv_layout=KV_LAYOUT,
        kv_dtype="float32",
        inputs=tuple(inputs),
        outputs=tuple(outputs),
    )


def stacked_interface(single: EngineInterface) -> EngineInterface:
    """The version-7 form of a version 3 or 6 interface: rows of different adapters in one forward.

    - per fused linear ``lora_A.i.g`` (slots n r, in) and ``lora_B.i.g`` (out, slots n r): the bound slots'
      A matrices one after the other and their B side by side (each exactly as one adapter gives it,
      ``adapter_shape``); the graph multiplies x A^T (N, slots n r) by each row's one-hot mask before B, so a
      row's product with another slot's columns is 0;
    - ``adapter_mask`` (batch, slots) float32, last: one 1 per row, at the slot it decodes with.
    The adapter contract is unchanged: ``float_interface_hash`` is the padded float engine's, as before.
    """
    if single.stacked or single.version not in (INTERFACE_VERSION, PAGED_INTERFACE_VERSION):
        raise ValueError(f"interface version {single.version} has no stacked form")
    inputs = []
    for t in single.inputs:
        if t.name.startswith("lora_A."):
            t = TensorSpec(t.name, t.dtype, (slots_axis(t.shape[0]), t.shape[1]))
        elif t.name.startswith("lora_B."):
            t = TensorSpec(t.name, t.dtype, (t.shape[0], slots_axis(t.shape[1])))
        inputs.append(t)
    inputs.append(TensorSpec(ADAPTER_MASK, "float32", ("batch", SLOTS_AXIS)))
    return EngineInterface(**{**single.__dict__, "version": STACKED_INTERFACE_VERSION, "inputs": tuple(inputs),
                              "float_interface_hash": single.float_interface_hash or single.interface_hash})


def single_interface(stacked: EngineInterface) -> EngineInterface:
    """The interface ``stacked_interface`` made ``stacked`` from (version 3 or 6; 8 with logit positions; 9 with
    quantized pages)."""
    inputs = [TensorSpec(t.name, t.dtype, stacked.adapter_shape(t) if t.name.startswith("lora_") else t.shape)
              for t in stacked.inputs if t.name != ADAPTER_MASK]
    version = QUANTIZED_PAGES_INTERFACE_VERSION if stacked.quantized_pages \
        else LOGIT_POSITIONS_INTERFACE_VERSION if stacked.logit_positions else PAGED_INTERFACE_VERSION if stacked.paged \
        else INTERFACE_VERSION
    return EngineInterface(**{**stacked.__dict__, "version": version, "inputs": tuple(inputs),
                              "float_interface_hash": None if version == INTERFACE_VERSION else stacked.float_interface_hash})


def write_interface(iface: EngineInterface, path: Path, exporter: dict | None = None) -> None:
    payload = iface.to_dict() | {"interface_hash": iface.interface_hash, "exporter": exporter or {}}
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_interface(path: Path) -> EngineInterface:
    path = Path(path)
    if path.is_dir():
        path = path / INTERFACE_FILE
    if not path.exists():
        raise InterfaceError(f"{path}: no engine interface; compile the engine first")
    d = json.loads(path.read_text())
    if d.get("version") not in SUPPORTED_VERSIONS:
        raise InterfaceError(
            f"{path}: interface version {d.get('version')} but this runtime speaks "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}; recompile"
        )
    return EngineInterface.from_dict(d)
