"""Where a plan's ranks run: nodes of one GPU type holding whole tensor-parallel groups.

The runtime numbers a plan's ranks owner by owner, replica by replica, DP rank by DP rank, TP rank
by TP rank (a replica of ``tp x dp`` GPUs is ``dp`` TP groups). The node layout cuts that
sequence into contiguous ranges: a new node starts when the GPU type changes or when the next TP
group would not fit in the node's ``gpus_per_node``. A TP group therefore never spans nodes (its
collectives use the intra-node link), and a node holds one GPU type; a replica's DP ranks may
(their experts' all-to-all crosses the network between NVLink domains). The planner checks an
inventory against the same layout, so every plan it returns can be deployed on the fleet it was
given (``opweave deploy`` writes the layout as ``nodes.json``).

An inventory of ``N`` GPUs of a type means ``N // gpus_per_node`` full nodes and one node with
the remainder. A layout fits when its nodes of each type can each be given a distinct
inventory node of that type with enough GPUs.

>>> groups = [("h100-sxm", 2), ("h100-sxm", 2), ("a100-sxm-80gb", 8), ("a100-sxm-80gb", 4)]
>>> node_layout(groups, {"h100-sxm": 8, "a100-sxm-80gb": 8})
[('h100-sxm', 0, 4), ('a100-sxm-80gb', 4, 8), ('a100-sxm-80gb', 12, 4)]
>>> fits_inventory([("h100-sxm", 4), ("a100-sxm-80gb", 8), ("a100-sxm-80gb", 4)],
...                {"a100-sxm-80gb": 12}, {"a100-sxm-80gb": 8})
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import Field, model_validator

from ..errors import ConfigError
from .base import Frozen
from .hardware import HardwareCatalog
from .plan import Plan


class Node(Frozen):
    """One machine of a deployment: GPUs of one type and the global ranks they run."""

    gpu: str = Field(description="GPU id (catalog) or profiled device name.")
    gpus: int = Field(ge=1, description="GPUs of the node the plan uses (one rank each).")
    ranks: tuple[int, ...] = Field(min_length=1, description="Global ranks, contiguous.")

    @model_validator(mode="after")
    def _contiguous(self) -> Node:
        if len(self.ranks) != self.gpus or list(self.ranks) != list(
            range(self.ranks[0], self.ranks[0] + self.gpus)
        ):
            raise ValueError("a node's ranks are `gpus` contiguous global ranks")
        return self


def plan_groups(plan: Plan) -> list[tuple[str, int]]:
    """``(gpu, tp)`` of every tensor-parallel group of ``plan`` (``dp`` per replica), in rank
    order: the decode owners', then the prefill pool's (its ranks come last)."""
    groups = [(o.gpu, o.tp) for o in plan.owners for _ in range(o.replicas * o.dp)]
    pool = plan.prefill
    if pool is not None:
        groups += [(pool.gpu, pool.tp)] * (pool.replicas * pool.dp)
    return groups


def node_layout(
    groups: Sequence[tuple[str, int]], gpus_per_node: Mapping[str, int]
) -> list[tuple[str, int, int]]:
    """``(gpu, first rank, gpus)`` of each node for TP ``groups`` ``(gpu, tp)`` in rank order."""
    out: list[tuple[str, int, int]] = []
    rank = 0
    for gpu, tp in groups:
        cap = gpus_per_node[gpu]
        if tp > cap:
            raise ConfigError(
                f"a tp{tp} group of {gpu} does not fit in one node of {cap} GPUs; "
                "lower its tp or raise gpus_per_node with --hardware"
            )
        if out and out[-1][0] == gpu and out[-1][2] + tp <= cap:
            out[-1] = (gpu, out[-1][1], out[-1][2] + tp)
        else:
            out.append((gpu, rank, tp))
        rank += tp
    return out


def inventory_nodes(count: int, gpus_per_node: int) -> list[int]:
    """GPUs per node of an inventory of ``count`` GPUs: full nodes, then the remainder."""
    full, rest = divmod(count, gpus_per_node)
    return [gpus_per_node] * full + ([rest] if rest else [])


def fits_inventory(
    nodes: Sequence[tuple[str, int]],
    inventory: Mapping[str, int | None],
    gpus_per_node: Mapping[str, int],
    copies: int = 1,
) -> bool:
    """Whether ``copies`` deployments of ``nodes`` (``(gpu, gpus)`` each) fit the inventory.

    Types missing from ``inventory`` or mapped to ``None`` are unbounded. Nodes and inventory
    nodes of a type are matched largest to largest, which finds a matching whenever one exists.
    """
    need: dict[str, list[int]] = {}
    for gpu, gpus in nodes:
        need.setdefault(gpu, []).extend([gpus] * copies)
    for gpu, sizes in need.items():
        count = inventory.get(gpu)
        if count is None:
            continue
        have = sorted(inventory_nodes(count, gpus_per_node[gpu]), reverse=True)
        if len(sizes) > len(have):
            return False
        if any(n > h for n, h in zip(sorted(sizes, reverse=True), have, strict=False)):
            return False
    return True


def copies_in_inventory(
    nodes: Sequence[tuple[str, int]],
    inventory: Mapping[str, int | None],
    gpus_per_node: Mapping[str, int],
) -> int | None:
    """How many independent deployments of ``nodes`` the inventory holds (``None``: no type of
    ``nodes`` is bounded)."""
    bounded = {gpu for gpu, _ in nodes if inventory.get(gpu) is not None}
    if not bounded:
        return None
    used = {gpu: sum(n for g, n in nodes if g == gpu) for gpu in bounded}
    k = min(int(inventory[gpu] or 0) // used[gpu] for gpu in bounded)
    while k > 0 and not fits_inventory(nodes, inventory, gpus_per_node, copies=k):
        k -= 1
    return k


def _gpus_per_node(
    gpus: Sequence[str], catalog: HardwareCatalog | Mapping[str, int]
) -> dict[str, int]:
    out: dict[str, int] = {}
    for gpu in dict.fromkeys(gpus):
        if isinstance(catalog, HardwareCatalog):
            out[gpu] = catalog.get(gpu).gpus_per_node
        elif gpu in catalog:
            out[gpu] = int(catalog[gpu])
        else:
            raise ConfigError(f"no gpus_per_node for {gpu!r}; give one for it")
    return out


def plan_nodes(plan: Plan, catalog: HardwareCatalog | Mapping[str, int]) -> list[Node]:
    """The nodes a plan runs on (the layout rule above), with their global ranks.

    ``catalog`` gives each GPU type's ``gpus_per_node`` (a catalog, or a mapping from GPU id).

    >>> from opweave.costmodel import canonical_plan, load_model
    >>> p = canonical_plan(load_model("qwen3-32b"), "afd", gpu="h100-sxm", batch=8, tp=4)
    >>> [(n.gpu, n.gpus, n.ranks) for n in plan_nodes(p, {"h100-sxm": 4})]
    [('h100-sxm', 4, (0, 1, 2, 3)), ('h100-sxm', 4, (4, 5, 6, 7))]
    """
    groups = plan_groups(plan)
    per_node = _gpus_per_node([g for g, _ in groups], catalog)
    return [
        Node(gpu=gpu, gpus=n, ranks=tuple(range(first, first + n)))
        for gpu, first, n in node_layout(groups, per_node)
    ]
