"""Which trainer ranks share a node, as the expert dispatchers need it (trainer.hierarchical_ep)."""

import pytest

from rlhf.parallel.dispatch import ranks_per_node


@pytest.mark.parametrize("nodes,per_node", [(["a"], 1), (["a", "a"], 2), (["a", "b"], 1), (["a", "a", "b", "b"], 2),
                                            (["x", "y", "z", "w"], 1), (["n"] * 4, 4)])
def test_equal_blocks_of_consecutive_ranks(nodes, per_node):
    assert ranks_per_node(nodes) == per_node


@pytest.mark.parametrize("nodes", [["a", "b", "a", "b"], ["a", "a", "b"], ["a", "b", "b", "a"], ["a", "a", "a", "b"]])
def test_other_arrangements_are_refused_naming_them(nodes):
    with pytest.raises(ValueError, match="equal blocks of consecutive ranks; their nodes by rank are"):
        ranks_per_node(nodes)
