"""KV groups: every layer in exactly one group of its own window, slots distinct within a group,
few idle slots, and one group when all layers attend alike."""

import pytest

from executor_svc.kv.groups import kv_layout


def _check(windows, layout):
    assert len(layout.layer_group) == len(layout.layer_slot) == len(windows)
    seen = set()
    for layer, (g, slot) in enumerate(zip(layout.layer_group, layout.layer_slot, strict=True)):
        assert layout.windows[g] == windows[layer]
        assert 0 <= slot < layout.group_size and (g, slot) not in seen
        seen.add((g, slot))


@pytest.mark.parametrize("windows", [[0] * 4, [7] * 3])
def test_one_kind_is_one_group_of_every_layer(windows):
    layout = kv_layout(windows)
    assert layout.windows == (windows[0],) and layout.group_size == len(windows)
    assert layout.layer_slot == tuple(range(len(windows)))
    _check(windows, layout)


@pytest.mark.parametrize("windows, size, groups", [
    ([512 if (i + 1) % 6 else 0 for i in range(26)], 4, 7),  # Gemma 3 1B: 4 global, 22 local
    ([4096 if i % 2 == 0 else 0 for i in range(26)], 13, 2),  # Gemma 2 2B: alternating
    ([128 if i % 2 == 0 else 0 for i in range(24)], 12, 2),  # gpt-oss 20B
    ([1024 if (i + 1) % 6 else 0 for i in range(62)], 10, 7),  # Gemma 3 27B
    ([0, 8, 16, 0, 8, 16], 2, 3),  # two windows and full attention
])
def test_mixed_kinds_group_by_window_with_few_idle_slots(windows, size, groups):
    layout = kv_layout(windows)
    assert (layout.group_size, layout.num_groups) == (size, groups)
    assert layout.windows[0] == 0  # full attention first
    assert layout.num_groups * layout.group_size - len(windows) <= 0.15 * len(windows)
    _check(windows, layout)


@pytest.mark.parametrize("windows", [[], [0, -1]])
def test_bad_windows_are_refused(windows):
    with pytest.raises(ValueError, match="windows"):
        kv_layout(windows)
