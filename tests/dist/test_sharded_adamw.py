"""`ShardedAdamW` (rlhf/parallel/optim.py, ZeRO-1) over two gloo processes: each rank steps its slice of the
flattened parameters and the slices are gathered back in pieces of `GATHER_BYTES`; whatever the piece size
(odd sizes, a padded last slice, pieces that cross parameter boundaries), every rank ends with exactly the
parameters torch's AdamW gives in one process."""

import torch

import rlhf.parallel.optim as optim
from rlhf.parallel.launch import run_ranks

SHAPES = [(7, 5), (13,), (3, 4, 2), (1,), (50, 3)]  # 223 elements: slices of 112, the second padded by one
STEPS = 3


def params_and_grads(seed: int = 0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(STEPS)]
    return params, grads


def sharded(rank, cases):
    return [stepped(rank, gather_bytes, shapes) for shapes, gather_bytes in cases]


def stepped(rank, gather_bytes, shapes):
    import torch.distributed as dist

    optim.GATHER_BYTES = gather_bytes
    values, grads = params_and_grads(shapes=shapes)
    params = [torch.nn.Parameter(v.clone()) for v in values]
    opt = optim.ShardedAdamW({"dp": (dist.group.WORLD, 2, rank, params)}, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                             weight_decay=0.1)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return [p.detach().tolist() for p in params]


def one_process(shapes):
    values, grads = params_and_grads(shapes=shapes)
    params = [torch.nn.Parameter(v.clone()) for v in values]
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, fused=True)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return [p.detach().tolist() for p in params]


def test_gathered_in_pieces_equals_one_process_adamw():
    # odd (the last slice padded) and even; one element a piece, pieces across parameters, one piece
    cases = [(shapes, b) for shapes in (SHAPES, SHAPES + [(1,)]) for b in (4, 12, 100, 1 << 20)]
    ranks = run_ranks(sharded, 2, cases)
    for i, (shapes, gather_bytes) in enumerate(cases):
        assert ranks[0][i] == ranks[1][i] == one_process(shapes), (shapes, gather_bytes)
