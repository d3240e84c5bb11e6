"""MoE expert load balance per layer (``moe_balance/*``).

Accumulate how many routing assignments each expert of each layer received (top-k repeats
counted, shared experts excluded) over a window of training forwards, across
micro-batches and ranks, then export per layer ``max_over_ideal`` = max load / (total / E)
(1 when perfectly balanced, 0 for a layer with no assignments) and one table of every
expert's ``tokens`` and ``load_percent`` = 100 * c_e / sum(c) (a layer sums to 100)::

    tracker = MoEBalanceTracker()
    hooks = install_moe_hooks(model, tracker)          # transformers Qwen3-MoE / Qwen3.5-MoE
    tracker.record(7, expert_ids=topk_idx, num_experts=128)   # or by hand, any engine
    stats.update(tracker.export(reduce_group=dp_group))

Layer ids are global (from 0, unique across pipeline stages). Recording never waits for
the device; export makes one host copy and, with a group, one ``all_gather_object`` of
the layer layout plus one packed ``all_reduce`` for all layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from areal_stream._moe_hooks import MoEHooks, in_backward, install, training_forward
from areal_stream._table import Table

__all__ = [
    "MoEBalanceTracker",
    "MoEHooks",
    "in_backward",
    "install_moe_hooks",
    "training_forward",
]

_PREFIX = "moe_balance/"
TABLE_KEY = _PREFIX + "expert_loads"
OUT_OF_RANGE_KEY = _PREFIX + "out_of_range_assignments"


def _index(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _collective_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class MoEBalanceTracker:
    """Per-layer expert assignment counts for one window; :meth:`export` starts the next.

    Each layer keeps a float64 vector of ``num_experts + 1`` counts on the device of the
    data: slot ``E`` collects expert ids outside ``[0, E)`` (reported as
    ``moe_balance/out_of_range_assignments``, never silently dropped). Known layers (from
    :meth:`declare_layer`, the hooks, or a first record) stay known across windows, so a
    layer that saw no assignments exports 0.
    """

    def __init__(self) -> None:
        self._experts: dict[int, int] = {}
        self._counts: dict[int, torch.Tensor] = {}

    @property
    def layers(self) -> dict[int, int]:
        """Known layers of this rank: ``{layer_id: num_experts}``."""
        return dict(self._experts)

    def declare_layer(self, layer_id: int, num_experts: int) -> None:
        """Make ``layer_id`` known with ``num_experts`` experts (no assignments yet)."""
        layer = _index("layer_id", layer_id, 0)
        experts = _index("num_experts", num_experts, 1)
        known = self._experts.get(layer)
        if known is not None and known != experts:
            raise ValueError(f"layer {layer} has {known} experts; cannot declare it with {experts}")
        self._experts[layer] = experts

    def _accumulator(self, layer: int, experts: int, device: torch.device) -> torch.Tensor:
        acc = self._counts.get(layer)
        if acc is None:
            acc = torch.zeros(experts + 1, dtype=torch.float64, device=device)
            self._counts[layer] = acc
        return acc

    def record(
        self,
        layer_id: int,
        *,
        expert_ids: Any = None,
        counts: Any = None,
        num_experts: int | None = None,
    ) -> None:
        """Add one batch of routing decisions of ``layer_id``.

        ``expert_ids``: integer tensor of any shape, one routed expert per entry (e.g. a
        router's ``[tokens, top_k]`` indices); needs ``num_experts`` unless the layer is
        known. ``counts``: 1-D tensor (or sequence) of per-expert assignment counts of
        length E. Exactly one of the two. No host sync happens here.
        """
        layer = _index("layer_id", layer_id, 0)
        if (expert_ids is None) == (counts is None):
            raise TypeError("record() takes exactly one of expert_ids= or counts=")
        known = self._experts.get(layer)
        experts = None if num_experts is None else _index("num_experts", num_experts, 1)
        if counts is not None:
            values = counts if isinstance(counts, torch.Tensor) else torch.as_tensor(counts)
            if values.dtype == torch.bool or values.dtype.is_complex:
                raise TypeError(f"counts must be an integer or float tensor, got {values.dtype}")
            if values.dim() != 1 or values.numel() < 1:
                raise ValueError(
                    f"counts must be a non-empty 1-D tensor, got shape {tuple(values.shape)}"
                )
            if experts is not None and experts != values.numel():
                raise ValueError(
                    f"counts has {values.numel()} entries but num_experts is {experts}"
                )
            experts = values.numel()
        else:
            ids = expert_ids
            if not isinstance(ids, torch.Tensor):
                raise TypeError(f"expert_ids must be a torch.Tensor, got {type(ids).__name__}")
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                raise TypeError(f"expert_ids must be an integer tensor, got {ids.dtype}")
            if experts is None:
                if known is None:
                    raise ValueError(
                        f"layer {layer} is not known yet: pass num_experts= with expert_ids"
                    )
                experts = known
        if known is not None and known != experts:
            raise ValueError(f"layer {layer} has {known} experts, this record has {experts}")
        self._experts[layer] = experts
        if counts is not None:
            acc = self._accumulator(layer, experts, values.device)
            acc[:experts] += values.detach().to(device=acc.device, dtype=torch.float64)
            return
        flat = ids.detach().reshape(-1)
        acc = self._accumulator(layer, experts, flat.device)
        flat = flat.to(device=acc.device, dtype=torch.int64)
        slot = flat.masked_fill((flat < 0) | (flat >= experts), experts)  # E: out of range
        if slot.device.type == "cpu":
            acc += torch.bincount(slot, minlength=experts + 1)  # exactly E + 1 bins
        else:  # bincount sizes its output on the host (a sync); index_add_ does not
            acc.index_add_(0, slot, torch.ones(slot.numel(), dtype=acc.dtype, device=acc.device))

    def reset(self) -> None:
        """Drop this window's counts (known layers stay known)."""
        self._counts = {}

    def _agreed_layout(self, group: Any) -> dict[int, int]:
        """Union of every rank's layers; the same ValueError on every rank on a conflict."""
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, dict(self._experts), group=group)
        merged: dict[int, tuple[int, int]] = {}
        conflicts: list[str] = []
        for rank, layout in enumerate(gathered):
            for layer, experts in layout.items():
                first = merged.setdefault(layer, (experts, rank))
                if first[0] != experts:
                    conflicts.append(
                        f"layer {layer}: {first[0]} experts on group rank {first[1]}, "
                        f"{experts} on group rank {rank}"
                    )
        if conflicts:
            raise ValueError(
                "MoE layer layouts disagree across ranks (layer ids must be global and "
                "unique across pipeline stages): " + "; ".join(conflicts)
            )
        return {layer: e for layer, (e, _) in merged.items()}

    def export(self, reduce_group: Any = None) -> dict[str, Any]:
        """Per-layer ``max_over_ideal`` scalars and the ``expert_loads`` table; resets.

        With ``reduce_group`` every rank of the group must call this and gets the same
        result, covering the union of the ranks' layers (pipeline stages may hold
        different layers; the same layer with different expert counts is a ValueError on
        every rank). Returns ``{}`` when no layer is known anywhere. The group should see
        each routed token once: data- and context-parallel ranks across pipeline stages;
        ranks that repeat the same routing (tensor-parallel peers) would add it again.
        """
        try:
            layout = (
                dict(self._experts) if reduce_group is None else self._agreed_layout(reduce_group)
            )
        except ValueError:
            self.reset()
            raise
        layers = sorted(layout)
        if not layers:
            self.reset()
            return {}
        if reduce_group is not None:
            device = _collective_device(reduce_group)
        else:
            device = next((t.device for t in self._counts.values()), torch.device("cpu"))
        packed = torch.zeros(
            sum(layout[layer] + 1 for layer in layers), dtype=torch.float64, device=device
        )
        offset = 0
        for layer in layers:
            size = layout[layer] + 1
            acc = self._counts.get(layer)
            if acc is not None:
                packed[offset : offset + size] += acc.to(device)
            offset += size
        self.reset()
        if reduce_group is not None:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=reduce_group)
        host = packed.cpu().tolist()
        return _summarise(layers, layout, host)


def _summarise(layers: list[int], layout: dict[int, int], host: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rows: list[tuple[int, int, int, float]] = []
    out_of_range = 0.0
    offset = 0
    for layer in layers:
        experts = layout[layer]
        counts = host[offset : offset + experts]
        out_of_range += host[offset + experts]
        offset += experts + 1
        bad = next((c for c in counts if not (c >= 0 and math.isfinite(c) and c == int(c))), None)
        if bad is not None:  # NaN would otherwise read as an idle layer (ratio 0)
            raise ValueError(
                f"layer {layer} has an expert count of {bad!r} after reduction; counts "
                "must be finite non-negative whole numbers (check record(counts=...))"
            )
        total = sum(counts)
        ratio = max(counts) * experts / total if total > 0 else 0.0
        out[f"{_PREFIX}layer_{layer}/max_over_ideal"] = ratio
        for expert, c in enumerate(counts):
            rows.append((layer, expert, int(c), 100.0 * c / total if total > 0 else 0.0))
    out[TABLE_KEY] = Table(
        columns=("layer", "expert", "tokens", "load_percent"),
        rows=rows,
        index=("layer", "expert"),
        heatmap="load_percent",
    )
    if out_of_range:
        out[OUT_OF_RANGE_KEY] = int(out_of_range)
    return out


def install_moe_hooks(
    model: nn.Module,
    tracker: MoEBalanceTracker,
    *,
    layer_offset: int = 0,
    count_when: Callable[[nn.Module], bool] | None = None,
) -> MoEHooks:
    """Hook every supported router of ``model`` into ``tracker``; see :mod:`._moe_hooks`.

    A router's layer id is the ``n`` of its ``layers.<n>`` module path plus
    ``layer_offset`` (for a pipeline stage whose layer list starts at a later global
    layer). Layers are declared on the tracker at once, so a layer that received no
    assignments exports 0. ``count_when(router_module) -> bool`` replaces the default
    :func:`training_forward` rule. A model with no supported router gets no hooks
    (``hooks.layer_ids`` is empty).
    """
    return install(model, tracker, layer_offset=layer_offset, count_when=count_when)
