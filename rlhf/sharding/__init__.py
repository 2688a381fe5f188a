"""Which rank holds which slice, in one place. Pure: no torch, nothing started.

    layout    the trainer's layout (pp x dp x tp, ep out of dp x tp, expert maps) and the engines'
              (tp, ep, attention dp), their coordinates, stages and fit checks
    trainer   the trainer's shard declarations: each parameter's pieces on each rank (ZeRO-3 rows, EP
              experts, TP splits), as a `weight_sync.spec.ShardSpec`
    engine    the engines' shard declarations: the slices each vLLM worker's buffers hold
    sync      `SyncLayout`: the trainer's layout to every engine rank, its two specs and the plan

The specs and the planner are `weight_sync.spec` and `weight_sync.plan` (the layer below, with no model
knowledge); the executors that run a plan (`weight_sync.p2p`, `shm`), the trainer's parallel code
(`rlhf.parallel`) and the memory estimate (`rlhf.placement.device_memory`) read their slices from here.
"""
