"""KV groups: how a model's layers share the block pool when some attend through a window.

A layer that only looks back W positions needs only the blocks of its window; a layer of full
attention needs them all. The layers are split into groups of `group_size` layers of one
attention kind (one window, 0 = full); a block id names one block of every layer of the group
holding it, and the pool is shared by all groups. The cache is `group_size` tensors (slots);
layer l keeps its K/V in slot ``layer_slot[l]`` at the block ids of group ``layer_group[l]``::

    Gemma-3-like, 8 layers, windows [W W W 0 W W W 0], group_size 2:
        group 0 (full): layers 3, 7      -> slots 0, 1
        group 1 (W):    layers 0, 1      -> slots 0, 1
        group 2 (W):    layers 2, 4      -> slots 0, 1
        group 3 (W):    layers 5, 6      -> slots 0, 1

A sequence holds one block per group per position (the scheduler's block manager releases the
windowed groups' blocks that left every window), so the full-attention layers' KV grows with
the context and the windowed layers' stays bounded by the window. A model whose layers all
have one kind is one group of all its layers: a block holds every layer, as without groups.

`group_size` is chosen to waste few slots (a group with fewer layers than slots leaves some
unused) without making many groups (each adds a block-table entry per position to every
sequence): the size minimising slots x (1 + GROUP_COST x groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

GROUP_COST = 0.02  # one more group per sequence position weighs like 2% more KV memory


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int, ...]  # per group: its layers' window, 0 = full attention
    layer_group: tuple[int, ...]  # per layer
    layer_slot: tuple[int, ...]  # per layer: the cache tensor it reads and writes
    group_size: int  # cache tensors (slots); a block id is one block of each

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def windowed(self) -> bool:
        return any(self.windows)


def kv_layout(layer_windows: Sequence[int]) -> KVLayout:
    """Groups for layers with these windows (0 = full attention), kinds in order of first
    appearance except that full attention, when present, is group 0."""
    if not layer_windows or any(w < 0 for w in layer_windows):
        raise ValueError(f"layer windows must be >= 0, one per layer, got {list(layer_windows)}")
    kinds = sorted(set(layer_windows), key=lambda w: (w != 0, list(layer_windows).index(w)))
    members = {w: [i for i, lw in enumerate(layer_windows) if lw == w] for w in kinds}
    if len(kinds) == 1:
        size = len(layer_windows)
    else:
        def cost(size: int) -> float:
            groups = sum(-(-len(m) // size) for m in members.values())
            return groups * size * (1 + GROUP_COST * groups)

        # Ties go to the larger size (fewer groups).
        size = min(range(min(len(m) for m in members.values()), 0, -1), key=cost)
    windows, layer_group, layer_slot = [], [0] * len(layer_windows), [0] * len(layer_windows)
    for w in kinds:
        layers = members[w]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(w)
    return KVLayout(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
