"""The run's weight-sync group: which transfer-rank pairs share a device (they go through shared memory)."""

from pathlib import Path

import pytest

from rlhf.config import load_model_config
from rlhf.layout import Layout
from rlhf.placement.transfer import SyncLayout
from weight_sync.plan import Topology

TINY = Path(__file__).resolve().parents[4] / "configs" / "model" / "qwen3_moe_tiny.yaml"


def test_same_device_pairs_from_a_device_map():
    sync = SyncLayout(load_model_config(TINY), Layout(tp=2), 2, Topology.single_node(4))
    # trainer ranks 0, 1 on devices 0, 1; engine hosts (ranks 2, 3) on devices 1 and 5
    assert sync.same_device_pairs([0, 1, 1, 5]) == {(1, 2)}
    assert sync.same_device_pairs([0, 0, 0, 7]) == {(0, 2), (1, 2)}
    with pytest.raises(ValueError, match="3 devices given for 4 transfer ranks"):
        sync.same_device_pairs([0, 1, 2])
