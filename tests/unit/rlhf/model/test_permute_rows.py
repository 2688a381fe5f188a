"""permute_rows (the experts' and the dispatcher's row permutations): the values and gradients of indexing
with a permutation, its backward a gather by the inverse instead of a zero-fill and index_put."""

import torch

from rlhf.model.layers import inverse_permutation, permute_rows


def test_inverse_permutation_is_the_argsort_of_a_permutation():
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(inverse_permutation(order), torch.argsort(order))


def test_values_and_gradients_equal_indexing_both_ways():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 6, generator=g)
    order = torch.argsort(torch.randint(0, 5, (37,), generator=g), stable=True)
    grad = torch.randn(37, 6, generator=g)
    for inverse in (None, inverse_permutation(order)):
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = permute_rows(a, order, inverse), b[order]
        assert torch.equal(ya, yb)
        (ya * grad).sum().backward()
        (yb * grad).sum().backward()
        assert torch.equal(a.grad, b.grad)
    # back again: the round trip is the identity, and so is its gradient
    a = x.clone().requires_grad_()
    inv = inverse_permutation(order)
    y = permute_rows(permute_rows(a, order, inv), inv, order)
    assert torch.equal(y, x)
    (y * grad).sum().backward()
    assert torch.equal(a.grad, grad)
