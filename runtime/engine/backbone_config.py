"""The backbone's shape as a Hugging Face ``config.json`` gives it: ``BackboneConfig`` and its parser.

Torch-free, so the engine interface (``runtime.engine.interface.build_interface``) and the pipeline's
checks of a base model read a backbone's shape without loading the forward (``runtime.engine.model``).
``BackboneConfig.from_hf`` refuses, naming the key, whatever the forward would compute differently from
transformers (a sliding window in use, other RoPE types, mixture of experts, MLP bias, quantized
weights, another model_type or activation).
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.engine.errors import RefusedInput

# Every linear a LoRA may target, in the order its inputs appear in the engine interface.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


class ModelFormatError(RefusedInput):
    """A model directory this forward cannot reproduce exactly; the message names the file and key."""


CONFIG_FILE = "config.json"
SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Keys by which a mixture-of-experts config announces itself; this forward has one dense MLP.
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling of ``runtime.engine.model.rope_inv_freq``; plain RoPE has none."""

    rope_type: str  # "linear" or "llama3"
    factor: float  # linear: every frequency / factor (positions / factor); llama3: the low frequencies'
    low_freq_factor: float = 0.0  # llama3: wavelengths above original / low_freq_factor are divided by factor
    high_freq_factor: float = 0.0  # llama3: wavelengths below original / high_freq_factor are kept
    original_max_position_embeddings: int = 0  # llama3: the pre-training context the bands are measured in


def _rope_scaling(hf: dict, problems: list[str]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) as transformers 5 reads them (``RotaryEmbeddingConfigMixin``): a 4.x
    ``rope_scaling`` dict, when present, replaces ``rope_parameters``; a ``rope_theta`` inside the
    dict wins over the top-level one; the legacy ``type`` spells ``rope_type``."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(key) or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        problems.append(f"{key}.{nested[0]}: RoPE parameters per layer type are not supported")
        return theta, None
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1.0):
        problems.append(f"partial_rotary_factor {partial!r} is not supported (RoPE on the whole head, 1.0)")
    type_key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_key, "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(f"{key}.{type_key} {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})")
        return theta, None
    if rope_type == "default":
        return theta, None
    needed = ("factor",) if rope_type == "linear" else _LLAMA3_KEYS
    missing = [k for k in needed if k not in params]
    if missing:
        problems.append(f"{key}.{missing[0]} is missing (rope_type {rope_type!r} needs {', '.join(needed)})")
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    # transformers' own precedence: a top-level original_max_position_embeddings (Phi-3 style) first,
    # then the dict's, then max_position_embeddings.
    default_max = 32768 if hf.get("model_type") == "qwen2" else 2048  # the config classes' defaults
    original = hf.get("original_max_position_embeddings",
                      params.get("original_max_position_embeddings", hf.get("max_position_embeddings", default_max)))
    return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]), int(original))


def _sliding_window_problem(hf: dict) -> str | None:
    """Qwen2's sliding window, where transformers would apply it (Qwen2Config.__post_init__): with
    use_sliding_window, on the layers ``layer_types`` marks (default: index >= max_window_layers).
    A window no shorter than max_position_embeddings never drops a key, so it computes full attention."""
    window = hf.get("sliding_window")
    if hf.get("model_type") != "qwen2" or not hf.get("use_sliding_window") or window is None:
        return None
    layers = hf.get("num_hidden_layers", 0)
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention" for i in range(layers)
    ]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    max_pos = hf.get("max_position_embeddings", 32768)
    if not sliding or window >= max_pos:
        return None
    return (f"use_sliding_window true with sliding_window {window} < max_position_embeddings {max_pos} "
            f"on layers {sliding[0]}-{sliding[-1]}: sliding-window attention is not supported")


@dataclass(frozen=True)
class BackboneConfig:
    model_type: str  # "qwen2" or "llama": same block, Qwen2 adds a bias to q/k/v
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads means grouped-query attention
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool  # lm_head reuses embed_tokens (no lm_head.weight in the file)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    attention_bias: bool = False  # Llama's attention_bias: q/k/v and o_proj all carry a bias

    @classmethod
    def from_hf(cls, hf: dict, source: str = CONFIG_FILE) -> "BackboneConfig":
        """Map a Hugging Face config.json; refuse, naming ``source`` and every offending key at once,
        each feature this forward does not compute exactly as transformers does."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:  # the other keys mean nothing for another architecture
            raise ModelFormatError(f"{source}: model_type {model_type!r} is not supported; "
                                   f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}")
        problems = [f"{k} is missing" for k in _REQUIRED_KEYS if k not in hf]
        if hf.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
        rope_theta, rope_scaling = _rope_scaling(hf, problems)
        sliding = _sliding_window_problem(hf)
        if sliding:
            problems.append(sliding)
        problems += [f"{k} {hf[k]!r}: mixture-of-experts is not supported" for k in MOE_KEYS if hf.get(k)]
        if hf.get("mlp_bias"):
            problems.append("mlp_bias true is not supported (the MLP has no bias)")
        if hf.get("quantization_config"):
            method = (hf["quantization_config"] or {}).get("quant_method")
            problems.append(f"quantization_config (quant_method {method!r}) is not supported: "
                            "give the unquantized weights")
        heads = hf.get("num_attention_heads", 0)
        kv_heads = hf.get("num_key_value_heads") or heads
        if heads and heads % kv_heads:
            problems.append(f"num_attention_heads {heads} do not split evenly over num_key_value_heads {kv_heads}")
        if problems:
            raise ModelFormatError(f"{source}: " + "; ".join(problems))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            attention_bias=model_type == "llama" and bool(hf.get("attention_bias")),
        )

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a LoRA-targetable linear."""
        H, d, I = self.hidden_size, self.head_dim, self.intermediate_size
        return {
            "q_proj": (H, self.num_heads * d),
            "k_proj": (H, self.num_kv_heads * d),
            "v_proj": (H, self.num_kv_heads * d),
            "o_proj": (self.num_heads * d, H),
            "gate_proj": (H, I),
            "up_proj": (H, I),
            "down_proj": (I, H),
        }[module]

    def weight_names(self) -> list[str]:
        """Every tensor the forward reads, by Hugging Face name; anything else in the files is not loaded."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        names += [] if self.tie_word_embeddings else ["lm_head.weight"]
        qwen2_biased = ("q_proj", "k_proj", "v_proj")
        biased = qwen2_biased if self.model_type == "qwen2" else ATTENTION_MODULES if self.attention_bias else ()
        for i in range(self.num_layers):
            layer = f"model.layers.{i}."
            names += [layer + "input_layernorm.weight", layer + "post_attention_layernorm.weight"]
            names += [f"{layer}{'self_attn' if m in ATTENTION_MODULES else 'mlp'}.{m}.weight" for m in LORA_MODULES]
            names += [f"{layer}self_attn.{m}.bias" for m in biased]
        return names
