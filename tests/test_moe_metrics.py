"""MoEBalanceTracker and router hooks against references computed here with numpy."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _dist import run_ranks
from torch import nn

from areal_stream._table import Table
from areal_stream.moe_metrics import (
    MoEBalanceTracker,
    in_backward,
    install_moe_hooks,
)

TABLE = "moe_balance/expert_loads"
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def reference(per_layer: dict[int, np.ndarray]) -> dict[str, Any]:
    """The spec's numbers from raw per-layer counts, written without the tracker."""
    out: dict[str, Any] = {}
    rows = []
    for layer in sorted(per_layer):
        c = per_layer[layer].astype(np.float64)
        e = len(c)
        total = c.sum()
        out[f"moe_balance/layer_{layer}/max_over_ideal"] = (
            float(c.max() / (total / e)) if total > 0 else 0.0
        )
        for expert in range(e):
            pct = float(100.0 * c[expert] / total) if total > 0 else 0.0
            rows.append((layer, expert, int(c[expert]), pct))
    out[TABLE] = rows
    return out


def check(out: dict[str, Any], per_layer: dict[int, np.ndarray]) -> None:
    ref = reference(per_layer)
    table = out[TABLE]
    assert isinstance(table, Table)
    assert table.columns == ("layer", "expert", "tokens", "load_percent")
    assert table.index == ("layer", "expert") and table.heatmap == "load_percent"
    assert len(table.rows) == len(ref[TABLE])
    for got, want in zip(table.rows, ref[TABLE], strict=True):
        assert got[:3] == want[:3]
        assert got[3] == pytest.approx(want[3], rel=1e-12, abs=1e-12)
    scalars = {k: v for k, v in out.items() if k != TABLE}
    assert set(scalars) == {k for k in ref if k != TABLE}
    for key, value in scalars.items():
        assert value == pytest.approx(ref[key], rel=1e-12), key
    for layer, c in per_layer.items():  # a layer with assignments sums to 100 %
        pct = sum(r[3] for r in table.rows if r[0] == layer)
        assert pct == pytest.approx(100.0 if c.sum() > 0 else 0.0)


def test_plain_api_against_reference() -> None:
    rng = np.random.default_rng(0)
    tracker = MoEBalanceTracker()
    ids_a = rng.integers(0, 4, size=(7, 2))
    ids_b = rng.integers(0, 4, size=(3, 2, 2))  # any shape
    counts_c = np.array([5, 0, 9])
    tracker.record(0, expert_ids=torch.from_numpy(ids_a), num_experts=4)
    tracker.record(0, expert_ids=torch.from_numpy(ids_b).to(torch.int32))  # layer now known
    tracker.record(3, counts=torch.from_numpy(counts_c))
    tracker.record(3, counts=[1, 1, 1])  # plain sequences work too
    tracker.declare_layer(7, 5)  # no assignments: exports 0
    tracker.record(9, expert_ids=torch.empty(0, 2, dtype=torch.int64), num_experts=2)
    out = tracker.export()
    expected = {
        0: np.bincount(np.concatenate([ids_a.ravel(), ids_b.ravel()]), minlength=4),
        3: counts_c + 1,
        7: np.zeros(5, dtype=np.int64),
        9: np.zeros(2, dtype=np.int64),
    }
    check(out, expected)
    assert out["moe_balance/layer_7/max_over_ideal"] == 0.0

    # Export resets the window; known layers stay and report 0.
    again = tracker.export()
    check(again, {k: np.zeros_like(v) for k, v in expected.items()})


def test_perfect_balance_is_one_and_top_k_repeats_count() -> None:
    tracker = MoEBalanceTracker()
    tracker.record(0, expert_ids=torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]]), num_experts=4)
    tracker.record(1, expert_ids=torch.tensor([[2, 2], [2, 2]]), num_experts=4)
    out = tracker.export()
    assert out["moe_balance/layer_0/max_over_ideal"] == 1.0
    assert out["moe_balance/layer_1/max_over_ideal"] == 4.0  # all 4 assignments on one expert
    assert [r for r in out[TABLE].rows if r[0] == 1][2] == (1, 2, 4, 100.0)


def test_out_of_range_ids_are_counted_not_dropped() -> None:
    tracker = MoEBalanceTracker()
    tracker.record(0, expert_ids=torch.tensor([0, 1, 4, -1, 4, 3]), num_experts=4)
    out = tracker.export()
    check({k: v for k, v in out.items() if "out_of_range" not in k}, {0: np.array([1, 1, 0, 1])})
    assert out["moe_balance/out_of_range_assignments"] == 3
    assert "moe_balance/out_of_range_assignments" not in tracker.export()


def test_bad_inputs() -> None:
    t = MoEBalanceTracker()
    with pytest.raises(TypeError, match="integer"):
        t.record(0, expert_ids=torch.tensor([0.0, 1.0]), num_experts=2)
    with pytest.raises(TypeError, match="integer"):
        t.record(0, expert_ids=torch.tensor([True]), num_experts=2)
    with pytest.raises(ValueError, match="num_experts"):
        t.record(0, expert_ids=torch.tensor([0]))
    with pytest.raises(TypeError, match="exactly one"):
        t.record(0)
    with pytest.raises(TypeError, match="exactly one"):
        t.record(0, expert_ids=torch.tensor([0]), counts=torch.tensor([1]))
    with pytest.raises(TypeError, match="layer_id"):
        t.record(True, counts=torch.tensor([1]))
    with pytest.raises(ValueError, match="layer_id"):
        t.record(-1, counts=torch.tensor([1]))
    with pytest.raises(ValueError, match="1-D"):
        t.record(0, counts=torch.ones(2, 2))
    with pytest.raises(ValueError, match="num_experts is 3"):
        t.record(0, counts=torch.ones(2), num_experts=3)
    t.record(0, counts=torch.ones(2))
    with pytest.raises(ValueError, match="has 2 experts"):
        t.record(0, expert_ids=torch.tensor([0]), num_experts=3)
    with pytest.raises(ValueError, match="has 2 experts"):
        t.record(0, counts=torch.ones(3))
    with pytest.raises(ValueError, match="cannot declare"):
        t.declare_layer(0, 5)
    t.record(1, counts=torch.tensor([-3, 1]))
    with pytest.raises(ValueError, match=r"layer 1 .* -3"):
        t.export()


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1.5])
def test_non_finite_or_fractional_counts_are_an_error_not_an_idle_layer(bad: float) -> None:
    # A NaN count used to read as a layer with no assignments (max_over_ideal 0).
    t = MoEBalanceTracker()
    t.record(0, counts=torch.tensor([1.0, 2.0]))
    t.record(3, counts=torch.tensor([bad, 1.0]))
    with pytest.raises(ValueError, match="layer 3"):
        t.export()
    t.record(0, counts=torch.tensor([1.0, 3.0]))  # the next window is clean
    assert t.export()["moe_balance/layer_0/max_over_ideal"] == 1.5


# ----------------------------------------------------------- hooks on tiny models


def _tiny_qwen3(num_layers: int = 3) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kwargs: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=5,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    cfg = Qwen3MoeConfig(**kwargs)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg)


def _tiny_qwen3_5() -> Any:
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
        linear_value_head_dim=4,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        num_experts=6,
        num_experts_per_tok=3,
    )
    torch.manual_seed(0)
    return Qwen3_5MoeForCausalLM(cfg)


class Spy:
    """An independent reference: a plain forward hook that keeps every router output."""

    def __init__(self, model: nn.Module) -> None:
        self.calls: dict[int, list[np.ndarray]] = {}
        self.handles = []
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                layer = int(name.split("layers.")[1].split(".")[0])
                self.handles.append(module.register_forward_hook(self._hook(layer)))

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.calls.setdefault(layer, []).append(output[2].detach().numpy().copy())

        return hook

    def counts(self, num_experts: int, calls: slice = slice(None)) -> dict[int, np.ndarray]:
        return {
            layer: np.bincount(
                np.concatenate([c.ravel() for c in cs[calls]]), minlength=num_experts
            )
            for layer, cs in self.calls.items()
        }


def _train_step(model: nn.Module, ids: torch.Tensor) -> None:
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()


@pytest.mark.parametrize("builder, experts, top_k", [(_tiny_qwen3, 5, 2), (_tiny_qwen3_5, 6, 3)])
def test_hooks_count_training_forwards_only(builder: Any, experts: int, top_k: int) -> None:
    model = builder()
    tracker = MoEBalanceTracker()
    hooks = install_moe_hooks(model, tracker)
    n_layers = model.config.num_hidden_layers
    assert sorted(hooks.layer_ids.values()) == list(range(n_layers))
    assert tracker.layers == dict.fromkeys(range(n_layers), experts)
    spy = Spy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 6), generator=gen) for _ in range(2)]
    for ids in batches:  # two micro-batches
        _train_step(model, ids)
    expected = spy.counts(experts)
    # Not counted: eval, no_grad, inference mode.
    model.eval()
    model(input_ids=batches[0])
    model.train()
    with torch.no_grad():
        model(input_ids=batches[0])
    with torch.inference_mode():
        model(input_ids=batches[0])
    out = tracker.export()
    check(out, expected)
    for layer in range(n_layers):  # every token, top_k assignments; shared expert excluded
        assert sum(r[2] for r in out[TABLE].rows if r[0] == layer) == 2 * 2 * 6 * top_k
    hooks.remove()
    _train_step(model, batches[0])
    assert all(r[2] == 0 for r in tracker.export()[TABLE].rows)


def test_checkpoint_recomputation_is_not_counted_twice() -> None:
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    plain = _tiny_qwen3()
    t_plain = MoEBalanceTracker()
    install_moe_hooks(plain, t_plain)
    _train_step(plain, ids)
    want = t_plain.export()

    ck = _tiny_qwen3()  # same seed: same weights, same routing
    ck.activation_checkpointing_enable()  # transformers default: non-reentrant
    t_ck = MoEBalanceTracker()
    install_moe_hooks(ck, t_ck)
    spy = Spy(ck)
    _train_step(ck, ids)
    assert all(len(calls) == 2 for calls in spy.calls.values())  # recomputed in backward
    assert t_ck.export() == want

    # Reentrant checkpointing runs the first forward under no_grad: the default rule sees
    # nothing, a rule without the grad-mode test counts it once.
    re = _tiny_qwen3()
    re.activation_checkpointing_enable({"use_reentrant": True})
    t_default, t_custom = MoEBalanceTracker(), MoEBalanceTracker()
    install_moe_hooks(re, t_default)
    install_moe_hooks(re, t_custom, count_when=lambda m: m.training and not in_backward())
    _train_step(re, ids)
    assert all(r[2] == 0 for r in t_default.export()[TABLE].rows)
    assert t_custom.export() == want


def test_layer_offset_mtp_skip_and_install_errors() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    model = _tiny_qwen3(num_layers=2)
    stage = nn.ModuleDict(
        {
            "model": model.model,
            "mtp": nn.ModuleDict({"layers": nn.ModuleList([Qwen3MoeTopKRouter(model.config)])}),
        }
    )
    tracker = MoEBalanceTracker()
    hooks = install_moe_hooks(stage, tracker, layer_offset=10)
    assert hooks.layer_ids == {"model.layers.0.mlp.gate": 10, "model.layers.1.mlp.gate": 11}
    assert hooks.skipped == ["mtp.layers.0"]
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(3))
    model.train()
    model(input_ids=ids).logits.sum().backward()
    out = tracker.export()
    assert set(out) == {
        TABLE,
        "moe_balance/layer_10/max_over_ideal",
        "moe_balance/layer_11/max_over_ideal",
    }
    hooks.remove()

    other = MoEBalanceTracker()
    other.declare_layer(0, 3)  # conflicts with the model's 5 experts
    with pytest.raises(ValueError, match="already has layer 0"):
        install_moe_hooks(model, other)
    with pytest.raises(TypeError):
        install_moe_hooks(object(), other)  # type: ignore[arg-type]
    dense = nn.Sequential(nn.Linear(2, 2))
    assert install_moe_hooks(dense, MoEBalanceTracker()).layer_ids == {}


def test_hook_refuses_a_changed_router_contract() -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    class NewRouter(Qwen3MoeTopKRouter):
        def forward(self, hidden_states: torch.Tensor) -> Any:
            return super().forward(hidden_states)[:2]

    model = _tiny_qwen3(num_layers=1)
    router = NewRouter(model.config)
    holder = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"gate": router})])})
    install_moe_hooks(holder, MoEBalanceTracker())
    holder.train()
    with pytest.raises(TypeError, match="router_indices"):
        router(torch.randn(3, 16, requires_grad=True))


# ---------------------------------------------------------------- 2 gloo ranks


def _rank_data(rank: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return {0: rng.integers(0, 4, size=(9, 2)), 1: rng.integers(0, 4, size=(5, 2))}


def _ranks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    calls = {"all_reduce": 0, "all_gather_object": 0}
    real_reduce, real_gather = dist.all_reduce, dist.all_gather_object

    def spy_reduce(*a: Any, **k: Any) -> Any:
        calls["all_reduce"] += 1
        return real_reduce(*a, **k)

    def spy_gather(*a: Any, **k: Any) -> Any:
        calls["all_gather_object"] += 1
        return real_gather(*a, **k)

    dist.all_reduce, dist.all_gather_object = spy_reduce, spy_gather  # count, then forward
    res: dict[str, Any] = {}

    # 1) Same layout, different data.
    t = MoEBalanceTracker()
    for layer, ids in _rank_data(rank).items():
        t.record(layer, expert_ids=torch.from_numpy(ids), num_experts=4)
    res["same"] = t.export(reduce_group=dist.group.WORLD)
    res["calls"] = dict(calls)

    # 2) Pipeline stages: rank 0 holds layers 0-1 (4 experts), rank 1 layers 2-3
    #    (8 experts); both also record layer 1 (e.g. a shared boundary); rank 1 declares
    #    layer 3 without data.
    p = MoEBalanceTracker()
    if rank == 0:
        p.record(0, counts=torch.tensor([1, 2, 3, 4]))
        p.record(1, counts=torch.tensor([4, 0, 0, 0]))
    else:
        p.record(1, counts=torch.tensor([0, 0, 0, 4]))
        p.record(2, counts=torch.tensor([1, 1, 1, 1, 1, 1, 1, 9]))
        p.declare_layer(3, 8)
    res["pp"] = p.export(reduce_group=dist.group.WORLD)

    # 3) A rank with nothing at all still gets the union.
    e = MoEBalanceTracker()
    if rank == 1:
        e.record(5, counts=torch.tensor([2, 2]))
    res["empty"] = e.export(reduce_group=dist.group.WORLD)

    # 4) Mismatch: the same layer with different expert counts. Every rank raises.
    m = MoEBalanceTracker()
    m.record(5, counts=torch.ones(4 if rank == 0 else 6))
    try:
        m.export(reduce_group=dist.group.WORLD)
        res["mismatch"] = None
    except ValueError as exc:
        res["mismatch"] = str(exc)
    # ...and the group is still usable afterwards.
    res["after"] = t.export(reduce_group=dist.group.WORLD)
    dist.all_reduce, dist.all_gather_object = real_reduce, real_gather
    return res


def test_two_ranks() -> None:
    r0, r1 = run_ranks(_ranks, 2)
    for key in ("same", "pp", "empty", "after"):
        assert r0[key] == r1[key], key
    d0, d1 = _rank_data(0), _rank_data(1)
    check(
        r0["same"],
        {
            layer: np.bincount(np.concatenate([d0[layer].ravel(), d1[layer].ravel()]), minlength=4)
            for layer in (0, 1)
        },
    )
    assert r0["calls"] == {"all_reduce": 1, "all_gather_object": 1}  # one packed reduction
    check(
        r0["pp"],
        {
            0: np.array([1, 2, 3, 4]),
            1: np.array([4, 0, 0, 4]),
            2: np.array([1, 1, 1, 1, 1, 1, 1, 9]),
            3: np.zeros(8, dtype=np.int64),
        },
    )
    check(r0["empty"], {5: np.array([2, 2])})
    for r in (r0, r1):
        assert r["mismatch"] is not None
        assert "layer 5: 4 experts on group rank 0, 6 on group rank 1" in r["mismatch"]
    check(r0["after"], {0: np.zeros(4, dtype=np.int64), 1: np.zeros(4, dtype=np.int64)})


# ----------------------------------------- through StatsLogger to TensorBoard and W&B

# Two windows: layer 0 has 4 experts, layer 2 has 3 (a ragged heatmap), layer 5 none.
WINDOWS: list[dict[int, list[int]]] = [
    {0: [3, 1, 0, 4], 2: [2, 2, 2], 5: [0, 0]},
    {0: [1, 1, 1, 1], 2: [0, 9, 3], 5: [0, 0]},
]

LOGGER_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from test_moe_metrics import WINDOWS
from areal_stream import StatsLogger
from areal_stream.moe_metrics import MoEBalanceTracker
cfg = {"stats_logger": {"experiment_name": "exp", "trial_name": "t1", "fileroot": sys.argv[2],
       "wandb": {"mode": "offline", "project": "proj"}, "console": {"enabled": False}}}
tracker = MoEBalanceTracker()
with StatsLogger(cfg) as logger:
    for step, window in enumerate(WINDOWS):
        for layer, counts in window.items():
            if any(counts):
                tracker.record(layer, expert_ids=torch.repeat_interleave(
                    torch.arange(len(counts)), torch.tensor(counts)), num_experts=len(counts))
            else:
                tracker.declare_layer(layer, len(counts))
        logger.commit(0, step, step, tracker.export())
    assert logger.flush(timeout=60)
"""


def _expected_pixels(rows: list[tuple[int, int, int, float]]) -> np.ndarray:
    """The heatmap rule: rows = layers, columns = experts, round(255 * v / max), gaps 0."""
    layers = sorted({r[0] for r in rows})
    experts = sorted({r[1] for r in rows})
    grid = np.zeros((len(layers), len(experts)))
    for layer, expert, _, pct in rows:
        grid[layers.index(layer), experts.index(expert)] = pct
    vmax = grid.max()
    return np.array([[round(255 * v / vmax) for v in line] for line in grid], dtype=np.uint8)


def test_export_read_back_from_tensorboard_and_wandb(tmp_path: Path) -> None:
    from readback import (
        read_tensorboard_images,
        read_tensorboard_scalars,
        read_wandb_history,
        read_wandb_table,
    )

    env = dict(os.environ)
    env.update(
        HOME=str(tmp_path),
        WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb_data"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-c", LOGGER_CHILD, TESTS, str(tmp_path / "root")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    log_dir = next((tmp_path / "root" / "logs").glob("*/exp/t1"))
    refs = [reference({k: np.array(v) for k, v in w.items()}) for w in WINDOWS]

    images = read_tensorboard_images(log_dir / "tensorboard")
    scalars = read_tensorboard_scalars(log_dir / "tensorboard")
    history = read_wandb_history(log_dir)
    for step, ref in enumerate(refs):
        np.testing.assert_array_equal(images[TABLE][step], _expected_pixels(ref[TABLE]))
        for layer in (0, 2, 5):
            key = f"moe_balance/layer_{layer}/max_over_ideal"
            assert scalars[key][step] == float(np.float32(ref[key]))
            assert history[step][key] == pytest.approx(ref[key], rel=1e-12)
        table = read_wandb_table(log_dir, history[step], TABLE)
        assert table["columns"] == ["layer", "expert", "tokens", "load_percent"]
        assert len(table["data"]) == len(ref[TABLE]) == 4 + 3 + 2
        for got, want in zip(table["data"], ref[TABLE], strict=True):
            assert got[:3] == list(want[:3])
            assert got[3] == pytest.approx(want[3], rel=1e-12, abs=1e-12)
