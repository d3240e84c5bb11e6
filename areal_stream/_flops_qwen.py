"""Built-in training-FLOPs factories for Qwen3-MoE and Qwen3.5-MoE text backbones.

Counting rules (the spec's): one multiply-add is 2 FLOPs and training is 3 x forward.
Per token, a layer counts its attention projections and its MLP (routed experts as
SwiGLU, three matrices each, for the ``top_k`` activated experts; the router; Qwen3.5's
shared expert and its sigmoid gate); the LM head counts once. Causal full attention adds
``2 * query_heads * head_dim * L * (L + 1)`` per layer per sequence (QK^T and AV over the
``L(L+1)/2`` visible pairs). Qwen3.5 GatedDeltaNet layers count their five projections,
the depthwise causal convolution over the q/k/v channels and ``3 * dk * dv`` multiply-adds
per value head per token for the recurrent state. Not counted: recomputation, optimizer,
elementwise ops, norms, embeddings, vision encoder, MTP layers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

FULL = "full_attention"
LINEAR = "linear_attention"
_MISSING = object()


def cfg_get(cfg: Any, key: str, default: Any = _MISSING) -> Any:
    """``cfg[key]`` for a mapping, ``cfg.key`` otherwise; ``default`` when absent."""
    value = cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)
    if value is _MISSING:
        raise ValueError(f"model config has no {key!r}, which the FLOPs estimate needs")
    return value


def _int(cfg: Any, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
    value = cfg_get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"model config {key!r} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"model config {key!r} must be >= {minimum}, got {value}")
    return value


def layer_types(cfg: Any, num_layers: int) -> list[str]:
    """Each layer's token mixer: ``layer_types`` if present, else ``full_attention_interval``."""
    types = cfg_get(cfg, "layer_types", None)
    if types is not None:
        types = list(types)
        if len(types) != num_layers:
            raise ValueError(
                f"model config 'layer_types' has {len(types)} entries but "
                f"num_hidden_layers is {num_layers}"
            )
        for i, t in enumerate(types):
            if t not in (FULL, LINEAR):
                raise ValueError(
                    f"model config layer_types[{i}] is {t!r}; expected {FULL!r} or {LINEAR!r}"
                )
        return types
    interval = cfg_get(cfg, "full_attention_interval", None)
    if interval is None:
        raise ValueError(
            "model config has neither 'layer_types' nor 'full_attention_interval': "
            "cannot tell which layers use full attention"
        )
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(
            f"model config 'full_attention_interval' must be an int >= 1, got {interval!r}"
        )
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]


def _estimator(linear_macs: int, attn_coef: int) -> Callable[[int], float]:
    """``f(L) = 3 * (2 * linear_macs * L + attn_coef * L * (L + 1))``, exact in ints."""

    def total_training_flops(sequence_length: int) -> float:
        length = sequence_length
        return float(3 * (2 * linear_macs * length + attn_coef * length * (length + 1)))

    return total_training_flops


def qwen3_moe_factory(cfg: Any) -> Callable[[int], float]:
    """Qwen3-MoE (e.g. Qwen3-30B-A3B): GQA attention, top-k routed experts, dense MLP layers."""
    hidden = _int(cfg, "hidden_size")
    layers = _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads")
    head_dim = cfg_get(cfg, "head_dim", None)
    head_dim = hidden // heads if head_dim is None else _int(cfg, "head_dim")
    vocab = _int(cfg, "vocab_size")
    experts = _int(cfg, "num_experts", minimum=0)
    top_k = _int(cfg, "num_experts_per_tok")
    sparse_step = _int(cfg, "decoder_sparse_step", 1)
    mlp_only = set(cfg_get(cfg, "mlp_only_layers", None) or ())

    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    macs = hidden * vocab
    for i in range(layers):
        macs += attn
        if i not in mlp_only and experts > 0 and (i + 1) % sparse_step == 0:
            moe_inter = _int(cfg, "moe_intermediate_size")
            macs += hidden * experts + top_k * 3 * hidden * moe_inter
        else:
            macs += 3 * hidden * _int(cfg, "intermediate_size")
    return _estimator(macs, 2 * heads * head_dim * layers)


def qwen3_5_moe_factory(cfg: Any) -> Callable[[int], float]:
    """Qwen3.5-MoE text backbone (e.g. Qwen3.5-35B-A3B): gated full attention + GatedDeltaNet."""
    hidden = _int(cfg, "hidden_size")
    layers = _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads")
    head_dim = _int(cfg, "head_dim")
    vocab = _int(cfg, "vocab_size")
    experts = _int(cfg, "num_experts")
    top_k = _int(cfg, "num_experts_per_tok")
    moe_inter = _int(cfg, "moe_intermediate_size")
    shared_inter = _int(cfg, "shared_expert_intermediate_size", minimum=0)
    output_gate = cfg_get(cfg, "attn_output_gate", True)
    types = layer_types(cfg, layers)

    q_out = heads * head_dim * (2 if output_gate else 1)
    full = hidden * q_out + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden

    n_linear = types.count(LINEAR)
    linear = 0
    if n_linear:
        kh, vh = _int(cfg, "linear_num_key_heads"), _int(cfg, "linear_num_value_heads")
        dk, dv = _int(cfg, "linear_key_head_dim"), _int(cfg, "linear_value_head_dim")
        kernel = _int(cfg, "linear_conv_kernel_dim")
        key_dim, value_dim = kh * dk, vh * dv
        conv_dim = 2 * key_dim + value_dim
        linear = (
            hidden * conv_dim  # in_proj_qkv
            + hidden * value_dim  # in_proj_z (output gate)
            + 2 * hidden * vh  # in_proj_b, in_proj_a
            + value_dim * hidden  # out_proj
            + kernel * conv_dim  # depthwise causal conv1d
            + 3 * dk * dv * vh  # recurrent state: predict, update, read out
        )
    mlp = hidden * experts + top_k * 3 * hidden * moe_inter
    if shared_inter:
        mlp += 3 * hidden * shared_inter + hidden  # shared expert + its gate
    macs = hidden * vocab + layers * mlp + (layers - n_linear) * full + n_linear * linear
    return _estimator(macs, 2 * heads * head_dim * (layers - n_linear))
