"""What the backbone is traced with: example inputs in interface order and the dynamic axes' bounds.

Both exporters use them: ``tasks.stages.compile`` (torch.onnx, the ONNX graph every backend runs) and the
torch-tensorrt builder in ``runtime.engine.backends.tensorrt``. The bounds are also the TensorRT
optimization-profile maxima. torch is imported inside the functions: the ONNX Runtime serving path
imports nothing from here.
"""

from __future__ import annotations

from runtime.engine.interface import ADAPTER_MASK, FLOAT_PAGES, SEALED_BLOCKS_AXIS, SLOTS_AXIS, per_slot

# Sizes used to trace: deliberately not 0 or 1, which torch.export would specialize to constants.
TRACE_BATCH, TRACE_SEQ, TRACE_PAST = 2, 3, 5
TRACE_BLOCKS, TRACE_POOL = 4, 7  # a paged cache: blocks per row in the table, blocks in the pool
TRACE_SEALED_POOL = 9  # quantized pages: blocks in the sealed pools, other than the float pools' (two dynamic axes)
TRACE_SLOTS = 3  # a stacked engine's adapter slots (interface version 7)
TRACE_LOGITS = 2  # logit positions per row (interface version 8), fewer than TRACE_SEQ
# Upper bounds of the dynamic axes.
MAX_BATCH, MAX_SEQ, MAX_PAST = 64, 4096, 4096
MAX_SLOTS = 16  # adapters one stacked forward holds; a device keeps a few resident (runtime.serve.residents)


def example_inputs(model, iface, batch: int, seq: int, past: int):
    """Random inputs in interface order: ids, positions, mask, the cache (float; or the block table and pools of a
    paged one, ``TRACE_BLOCKS`` blocks per row; of quantized pages, both tables and the float and sealed pools),
    LoRA(, logit positions)."""
    import torch

    args = _adapter_example_inputs(torch, model, iface, batch, seq, past)
    if iface.logit_positions:  # TRACE_LOGITS of the seq positions, not all: the export must not tie the two axes
        args += (torch.randint(0, seq, (batch, TRACE_LOGITS)),)  # (B, K)
    return args


def _adapter_example_inputs(torch, model, iface, batch: int, seq: int, past: int):
    """``example_inputs`` but the logit positions: a stacked engine's slots beside the LoRA inputs."""
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))  # (B, T)
    pos = (torch.arange(seq) + past).expand(batch, seq).contiguous()  # (B, T)
    shapes = {t.name: [per_slot(a) * TRACE_SLOTS if per_slot(a) != a else a for a in t.shape] for t in iface.inputs}
    lora = [torch.randn(*shapes[n]) * 0.05 for n in iface.lora_names]
    if iface.stacked:  # one-hot rows, last: see runtime.engine.model.Backbone.layer_loras
        lora.append(torch.nn.functional.one_hot(torch.randint(0, TRACE_SLOTS, (batch,)), TRACE_SLOTS).float())
    return _example_inputs(torch, cfg, iface, batch, seq, past, ids, pos, lora)


def _example_inputs(torch, cfg, iface, batch, seq, past, ids, pos, lora):
    """``example_inputs`` around the given ids, positions and LoRA inputs."""
    if iface.quantized_pages:  # the sealed table, each row's two float pages, the float then the sealed pools
        table = torch.randint(0, TRACE_SEALED_POOL, (batch, TRACE_BLOCKS))  # (B, M)
        float_table = torch.randint(0, TRACE_POOL, (batch, FLOAT_PAGES))  # (B, F)
        mask = torch.ones(batch, (FLOAT_PAGES + TRACE_BLOCKS) * iface.kv_block_size + seq, dtype=torch.long)
        sizes = {"blocks": TRACE_POOL, SEALED_BLOCKS_AXIS: TRACE_SEALED_POOL}
        pools = {axis: [random_cache_tensor(torch, [sizes[axis], *t.shape[1:]], t.dtype)
                        for t in iface.inputs if t.shape[0] == axis and t.name.startswith("pool_")] for axis in sizes}
        return ids, pos, mask, table, float_table, pools["blocks"], pools[SEALED_BLOCKS_AXIS], lora
    if iface.paged:
        table = torch.randint(0, TRACE_POOL, (batch, TRACE_BLOCKS))  # (B, M)
        mask = torch.ones(batch, TRACE_BLOCKS * iface.kv_block_size + seq, dtype=torch.long)  # (B, M bs + T)
        pools = [random_cache_tensor(torch, [TRACE_POOL if a == "blocks" else a for a in t.shape], t.dtype)
                 for t in iface.inputs if t.name.startswith("pool_")]
        return ids, pos, mask, table, pools, lora
    mask = torch.ones(batch, past + seq, dtype=torch.long)  # (B, S)
    kv = [torch.randn(batch, cfg.num_kv_heads, past, cfg.head_dim) for _ in range(2 * cfg.num_layers)]
    return ids, pos, mask, kv, lora


def random_cache_tensor(torch, shape: list, dtype: str):
    """Random codes (uint8), fp16 scales and minima, or a float32 cache of ``shape``."""
    if dtype == "uint8":
        return torch.randint(0, 256, shape, dtype=torch.uint8)
    if dtype == "float16":
        return (torch.rand(shape) * 0.1 + 0.01).to(torch.float16)
    return torch.randn(shape)


def export_dynamic_shapes(iface, args, Dim):
    """torch.export ``dynamic_shapes`` for ``args`` (as ``example_inputs`` returns them), with ``Dim`` given."""
    batch = Dim("batch", min=1, max=MAX_BATCH)
    if iface.logit_positions:
        return (_dynamic_shapes(iface, args[:-1], Dim, batch) +
                ({0: batch, 1: Dim("positions", min=1, max=MAX_SEQ)},))
    return _dynamic_shapes(iface, args, Dim, batch)


def _dynamic_shapes(iface, args, Dim, batch):
    seq = Dim("seq", min=1, max=MAX_SEQ)
    past = Dim("past", min=0, max=MAX_PAST)  # 0 = prefill with an empty cache
    head = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: Dim.DYNAMIC})  # total = past + seq: derived
    # LoRA: fixed shapes, but a stacked engine's have a slot axis.
    slots = Dim(SLOTS_AXIS, min=1, max=MAX_SLOTS)

    def dim(axis):  # a LoRA input's rank axis: slots times one adapter's rank (interface.slots_axis)
        return {"batch": batch, SLOTS_AXIS: slots}.get(axis) or (slots * per_slot(axis) if per_slot(axis) != axis else None)

    specs = {t.name: {i: dim(a) for i, a in enumerate(t.shape) if dim(a) is not None} or None for t in iface.inputs}
    lora = [specs[n] for n in iface.lora_names] + ([specs[ADAPTER_MASK]] if iface.stacked else [])
    if iface.quantized_pages:
        blocks = Dim("max_blocks", min=0, max=MAX_PAST // iface.kv_block_size)  # 0: no page sealed yet
        float_blocks = Dim("float_blocks", min=0, max=FLOAT_PAGES)  # 0 = prefill with an empty cache
        pool, sealed_pool = Dim("blocks", min=1, max=None), Dim(SEALED_BLOCKS_AXIS, min=1, max=None)
        return head + ({0: batch, 1: blocks}, {0: batch, 1: float_blocks}, [{0: pool} for _ in args[5]],
                       [{0: sealed_pool} for _ in args[6]], lora)
    if iface.paged:
        blocks = Dim("max_blocks", min=0, max=MAX_PAST // iface.kv_block_size)  # 0 = prefill with an empty cache
        pool = Dim("blocks", min=1, max=None)
        return head + ({0: batch, 1: blocks}, [{0: pool} for _ in args[4]], lora)
    return head + ([{0: batch, 2: past} for _ in args[3]], lora)
