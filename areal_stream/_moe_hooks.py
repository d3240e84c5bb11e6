"""Forward hooks that feed router decisions of transformers MoE models to a tracker.

Supported routers (transformers 5.x): ``Qwen3MoeTopKRouter`` and ``Qwen3_5MoeTopKRouter``
(and subclasses). Their ``forward`` returns ``(router_logits, router_scores,
router_indices)`` with ``router_indices`` of shape ``[tokens, top_k]``: the routed expert
of each assignment (top-k repeats are separate assignments). Shared experts are not
routed, so they never appear. Routers under an ``mtp*`` module are skipped.

Which forwards count (the default rule, :func:`training_forward`): the router module is in
training mode, autograd is recording (not ``torch.no_grad()`` / inference mode), and the
autograd engine is not running a backward pass. Activation-checkpoint recomputation runs
inside backward, so it is not counted again. Reentrant checkpointing
(``use_reentrant=True``) runs the original forward under ``no_grad``: pass
``count_when=lambda m: m.training and not in_backward()`` for such models (transformers'
own ``gradient_checkpointing_enable()`` is non-reentrant by default).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from areal_stream.moe_metrics import MoEBalanceTracker

ROUTER_CLASS_NAMES = frozenset({"Qwen3MoeTopKRouter", "Qwen3_5MoeTopKRouter"})
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return bool(torch._C._current_graph_task_id() != -1)


def training_forward(module: nn.Module) -> bool:
    """The default rule: a training forward, not eval, no_grad, or backward recomputation."""
    return (
        module.training
        and torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
        and not in_backward()
    )


def is_supported_router(module: nn.Module) -> bool:
    """Whether ``module`` is (a subclass of) a router whose return contract we know."""
    return any(cls.__name__ in ROUTER_CLASS_NAMES for cls in type(module).__mro__)


class MoEHooks:
    """Installed router hooks; ``remove()`` (or leaving the ``with`` block) uninstalls them.

    ``layer_ids`` maps each hooked router's module path to its global layer id;
    ``skipped`` lists the paths of supported routers left out (MTP).
    """

    def __init__(self) -> None:
        self.layer_ids: dict[str, int] = {}
        self.skipped: list[str] = []
        self._handles: list[Any] = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> MoEHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _make_hook(
    tracker: MoEBalanceTracker,
    layer_id: int,
    num_experts: int,
    path: str,
    count_when: Callable[[nn.Module], bool],
) -> Callable[[nn.Module, Any, Any], None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not count_when(module):
            return
        if not (
            isinstance(output, tuple) and len(output) == 3 and isinstance(output[2], torch.Tensor)
        ):
            raise TypeError(
                f"router {path!r} returned {type(output).__name__}; expected the transformers "
                "contract (router_logits, router_scores, router_indices)"
            )
        tracker.record(layer_id, expert_ids=output[2].detach(), num_experts=num_experts)

    return hook


def install(
    model: nn.Module,
    tracker: MoEBalanceTracker,
    *,
    layer_offset: int = 0,
    count_when: Callable[[nn.Module], bool] | None = None,
) -> MoEHooks:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(layer_offset, bool) or not isinstance(layer_offset, int) or layer_offset < 0:
        raise ValueError(f"layer_offset must be an int >= 0, got {layer_offset!r}")
    rule = training_forward if count_when is None else count_when
    if not callable(rule):
        raise TypeError(f"count_when must be callable, got {count_when!r}")
    hooks = MoEHooks()
    found: list[tuple[str, nn.Module, int, int]] = []
    seen: dict[int, str] = {}
    for path, module in model.named_modules():
        if not is_supported_router(module):
            continue
        if any(part.startswith("mtp") for part in path.split(".")):
            hooks.skipped.append(path)
            continue
        match = _LAYER.search(path)
        if match is None:
            raise ValueError(f"router {path!r} is not under a 'layers.<n>' module: no layer id")
        layer_id = int(match.group(1)) + layer_offset
        if layer_id in seen:
            raise ValueError(
                f"routers {seen[layer_id]!r} and {path!r} both map to layer {layer_id}"
            )
        seen[layer_id] = path
        num_experts = int(getattr(module, "num_experts", 0))
        if num_experts < 1:
            raise ValueError(f"router {path!r} has no positive num_experts")
        found.append((path, module, layer_id, num_experts))
    known = tracker.layers
    for path, _, layer_id, num_experts in found:
        if known.get(layer_id, num_experts) != num_experts:
            raise ValueError(
                f"router {path!r} has {num_experts} experts but the tracker already has "
                f"layer {layer_id} with {known[layer_id]}"
            )
    for path, module, layer_id, num_experts in found:
        tracker.declare_layer(layer_id, num_experts)
        hooks._handles.append(
            module.register_forward_hook(_make_hook(tracker, layer_id, num_experts, path, rule))
        )
        hooks.layer_ids[path] = layer_id
    return hooks
