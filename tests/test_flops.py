"""FLOPs estimators against hand counts, parameter counts and torch's FLOP counter.

The configs in tests/data are the text parts of the official Qwen3-30B-A3B and
Qwen3.5-35B-A3B ``config.json`` (vision config left out). The reference counts below
are written out from the published hyperparameters, not from the implementation.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from areal_stream import flops
from areal_stream.flops import get_flops_estimator, register_flops_estimator

DATA = Path(__file__).parent / "data"
QWEN3 = DATA / "qwen3_30b_a3b_config.json"
QWEN35 = DATA / "qwen3_5_35b_a3b_config.json"


def _load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data: dict[str, Any] = json.load(f)
    return data


# ---------------------------------------------------------------- hand counts (per token)
# Qwen3-30B-A3B: hidden 2048, 48 layers, 32 query heads, 4 KV heads, head_dim 128,
# 128 experts (top-8) of intermediate 768, vocab 151936. Multiply-adds per token:
Q3_ATTN_PROJ = 2048 * (32 * 128) + 2048 * (4 * 128) * 2 + (32 * 128) * 2048
Q3_ROUTER = 2048 * 128
Q3_EXPERTS = 8 * 3 * 2048 * 768
Q3_LM_HEAD = 2048 * 151936
Q3_MACS = 48 * (Q3_ATTN_PROJ + Q3_ROUTER + Q3_EXPERTS) + Q3_LM_HEAD
assert Q3_MACS == 3_041_656_832  # ~3.0B non-embedding active + LM head


def q3_reference(length: int) -> int:
    forward = 2 * Q3_MACS * length + 48 * 2 * 32 * 128 * length * (length + 1)
    return 3 * forward


# Qwen3.5-35B-A3B: hidden 2048, 40 layers (every 4th full attention: 10 full, 30 linear),
# full attention 16 query heads / 2 KV heads of 256 with an output gate in q_proj;
# GatedDeltaNet 16 key heads x 128, 32 value heads x 128, conv kernel 4;
# 256 experts (top-8) of 512 + one shared expert of 512 with a 1-wide gate; vocab 248320.
Q35_FULL = 2048 * (16 * 256 * 2) + 2048 * (2 * 256) * 2 + (16 * 256) * 2048
Q35_KEY_DIM, Q35_VALUE_DIM = 16 * 128, 32 * 128
Q35_LINEAR = (
    2048 * (2 * Q35_KEY_DIM + Q35_VALUE_DIM)  # in_proj_qkv
    + 2048 * Q35_VALUE_DIM  # in_proj_z
    + 2048 * 32 * 2  # in_proj_b, in_proj_a
    + Q35_VALUE_DIM * 2048  # out_proj
    + 4 * (2 * Q35_KEY_DIM + Q35_VALUE_DIM)  # depthwise conv
    + 3 * 128 * 128 * 32  # recurrent state
)
Q35_MOE = 2048 * 256 + 8 * 3 * 2048 * 512 + 3 * 2048 * 512 + 2048
Q35_LM_HEAD = 2048 * 248320


def q35_reference(length: int, n_full: int = 10) -> int:
    macs = Q35_LM_HEAD + 40 * Q35_MOE + n_full * Q35_FULL + (40 - n_full) * Q35_LINEAR
    forward = 2 * macs * length + n_full * 2 * 16 * 256 * length * (length + 1)
    return 3 * forward


LENGTHS = [0, 1, 2, 17, 1000, 4096, 32768]


@pytest.mark.parametrize("length", LENGTHS)
def test_qwen3_30b_a3b_matches_hand_count(length: int) -> None:
    f = get_flops_estimator(_load(QWEN3))
    assert f is not None
    assert f(length) == float(q3_reference(length))


@pytest.mark.parametrize("length", LENGTHS)
def test_qwen3_5_35b_a3b_matches_hand_count(length: int) -> None:
    f = get_flops_estimator(_load(QWEN35))
    assert f is not None
    assert f(length) == float(q35_reference(length))


def test_qwen3_5_active_size_is_about_3b() -> None:
    # Sanity of the hand count itself: ~3B active parameters per token incl. the LM head.
    per_token_macs = (q35_reference(1) - q35_reference(0)) / 6
    assert 2.9e9 < per_token_macs < 3.1e9


def test_config_forms_agree(tmp_path: Path) -> None:
    from transformers import Qwen3_5MoeConfig, Qwen3MoeConfig

    for path, ctor, ref in (
        (QWEN3, Qwen3MoeConfig, q3_reference),
        (QWEN35, Qwen3_5MoeConfig, q35_reference),
    ):
        raw = _load(path)
        model_dir = tmp_path / f"any-name-{path.stem}"
        model_dir.mkdir()
        shutil.copy(path, model_dir / "config.json")
        forms: list[Any] = [raw, str(model_dir), model_dir, str(path), ctor(**raw)]
        for form in forms:
            f = get_flops_estimator(form)
            assert f is not None, form
            assert f(777) == float(ref(777)), form


def test_text_config_alone_and_by_text_model_type() -> None:
    raw = _load(QWEN35)
    f_text = get_flops_estimator(raw["text_config"])  # model_type qwen3_5_moe_text
    assert f_text is not None and f_text(300) == float(q35_reference(300))
    renamed = dict(raw, model_type="some_wrapper_type")  # found through text_config
    f_wrapped = get_flops_estimator(renamed)
    assert f_wrapped is not None and f_wrapped(300) == float(q35_reference(300))


def test_layer_types_and_interval() -> None:
    text = _load(QWEN35)["text_config"]
    no_types = {k: v for k, v in text.items() if k != "layer_types"}
    f = get_flops_estimator(no_types)  # full_attention_interval 4 -> the same 10 full layers
    assert f is not None and f(1234) == float(q35_reference(1234))
    every_other = dict(no_types, full_attention_interval=2)
    f2 = get_flops_estimator(every_other)
    assert f2 is not None and f2(1234) == float(q35_reference(1234, n_full=20))
    with pytest.raises(ValueError, match="39 entries"):
        get_flops_estimator(dict(text, layer_types=text["layer_types"][:-1]))
    bad = list(text["layer_types"])
    bad[5] = "sliding_attention"
    with pytest.raises(ValueError, match=r"layer_types\[5\]"):
        get_flops_estimator(dict(text, layer_types=bad))
    neither = {k: v for k, v in no_types.items() if k != "full_attention_interval"}
    with pytest.raises(ValueError, match="full_attention_interval"):
        get_flops_estimator(neither)


def test_dense_layers_of_qwen3_moe() -> None:
    raw = _load(QWEN3)
    f = get_flops_estimator(dict(raw, mlp_only_layers=[0, 5]))
    dense = 3 * 2048 * 6144
    per_token_change = 2 * (dense - Q3_ROUTER - Q3_EXPERTS)
    assert f is not None
    assert f(10) == float(q3_reference(10) + 3 * 2 * per_token_change * 10)
    g = get_flops_estimator(dict(raw, decoder_sparse_step=2))  # odd layers stay MoE
    assert g is not None
    assert g(10) == float(q3_reference(10) + 3 * 24 * per_token_change * 10)


def test_sequence_length_validation() -> None:
    f = get_flops_estimator(_load(QWEN3))
    assert f is not None
    with pytest.raises(TypeError, match="sequence_length"):
        f(True)
    with pytest.raises(TypeError, match="sequence_length"):
        f(2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence_length"):
        f(torch.tensor(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        f(-1)
    assert f(np.int64(5)) == float(q3_reference(5))  # numpy integers are integers


def test_unregistered_and_bad_configs(tmp_path: Path) -> None:
    assert get_flops_estimator({"model_type": "llama"}) is None
    assert get_flops_estimator({"hidden_size": 3}) is None
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        get_flops_estimator(tmp_path)
    with pytest.raises(TypeError):
        get_flops_estimator(None)
    missing = {k: v for k, v in _load(QWEN3).items() if k != "moe_intermediate_size"}
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        get_flops_estimator(missing)
    with pytest.raises(ValueError, match="hidden_size"):
        get_flops_estimator(dict(_load(QWEN3), hidden_size="2048"))


def test_register_replaces_and_results_are_checked() -> None:
    def factory(cfg: Any) -> Any:
        per_token = cfg["active"]
        return lambda n: 6.0 * per_token * n

    def bad_factory(value: float) -> Any:
        return lambda cfg: lambda n: value

    saved = dict(flops._FACTORIES)
    try:
        register_flops_estimator("toy", factory)
        f = get_flops_estimator({"model_type": "toy", "active": 10})
        assert f is not None and f(3) == 180.0
        register_flops_estimator("toy", lambda cfg: lambda n: 1.0 * n)  # replaces
        g = get_flops_estimator({"model_type": "toy", "active": 10})
        assert g is not None and g(3) == 3.0
        register_flops_estimator("qwen3_moe", factory)  # a built-in can be replaced too
        h = get_flops_estimator(dict(_load(QWEN3), active=1))
        assert h is not None and h(1) == 6.0
        for value, exc in ((-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError)):
            register_flops_estimator("toy", bad_factory(value))
            k = get_flops_estimator({"model_type": "toy"})
            assert k is not None
            with pytest.raises(exc, match="finite"):
                k(4)
        register_flops_estimator("toy", bad_factory("12"))  # type: ignore[arg-type]
        k = get_flops_estimator({"model_type": "toy"})
        assert k is not None
        with pytest.raises(TypeError, match="real number"):
            k(4)
        with pytest.raises(TypeError):
            register_flops_estimator("", factory)
        with pytest.raises(TypeError):
            register_flops_estimator("x", 3)  # type: ignore[arg-type]
    finally:
        flops._FACTORIES.clear()
        flops._FACTORIES.update(saved)


# ------------------------------------------------ tiny random transformers models


def _fit(f: Any) -> tuple[float, float]:
    """``f(L) = a * L + b * L * (L + 1)``: recover a and b from L = 1, 2 (and check L = 9)."""
    b = (f(2) - 2 * f(1)) / 2
    a = f(1) - 2 * b
    assert f(9) == a * 9 + b * 90
    return a, b


def _tiny_qwen3(decoder_sparse_step: int = 1) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=decoder_sparse_step,
        max_position_embeddings=64,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    cfg = Qwen3MoeConfig(**kwargs)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg)


def _active_macs_from_parameters(model: Any, top_k: int, num_experts: int) -> float:
    """Per-token multiply-adds read off the parameter shapes (norms, embeddings excluded)."""
    macs = 0.0
    for name, p in model.named_parameters():
        if "norm" in name or "embed_tokens" in name or name.endswith(("dt_bias", "A_log")):
            continue
        if ".experts." in name:
            macs += p.numel() * top_k / num_experts  # only the routed experts run
        else:
            macs += p.numel()  # Linear weights, router, conv1d (one MAC per weight per token)
    return macs


@pytest.mark.parametrize("sparse_step", [1, 2])
def test_tiny_qwen3_moe_parameter_count(sparse_step: int) -> None:
    model = _tiny_qwen3(sparse_step)
    f = get_flops_estimator(model.config)
    assert f is not None
    a, b = _fit(f)
    assert a == 6 * _active_macs_from_parameters(model, top_k=2, num_experts=4)
    assert b == 3 * 2 * 4 * 6 * 3  # 3 x (2 * heads * head_dim) x layers


def test_tiny_qwen3_moe_against_torch_flop_counter() -> None:
    """Measured: eager attention computes the full L x L square; the rest must match exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    model = _tiny_qwen3()
    f = get_flops_estimator(model.config)
    assert f is not None
    a, _ = _fit(f)
    length = 11
    ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(1))
    with FlopCounterMode(display=False) as counter:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    square_attention = 3 * 3 * (2 * 2 * 4 * 6 * length * length)  # 3 layers, fwd + bwd
    assert counter.get_total_flops() == a * length + square_attention


def test_tiny_qwen3_5_moe_parameter_count() -> None:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=4,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=3,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=10,
        num_experts=6,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(cfg)
    f = get_flops_estimator(model.config)
    assert f is not None
    a, b = _fit(f)
    n_linear = 3  # layer types: linear, linear, linear, full
    recurrent = n_linear * 3 * 4 * 6 * 4  # 3 x dk x dv per value head per token
    assert a == 6 * (_active_macs_from_parameters(model, top_k=2, num_experts=6) + recurrent)
    assert b == 3 * 2 * 2 * 8 * 1  # one full-attention layer


def test_shipped_configs_are_the_text_parts() -> None:
    q3 = _load(QWEN3)
    assert q3["model_type"] == "qwen3_moe" and q3["num_experts"] == 128
    q35 = _load(QWEN35)
    assert q35["model_type"] == "qwen3_5_moe" and "vision_config" not in q35
    text = copy.deepcopy(q35["text_config"])
    assert text["model_type"] == "qwen3_5_moe_text"
    assert text["layer_types"].count("full_attention") == 10
