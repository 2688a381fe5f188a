"""Generation stepped by the engine actor itself, one decode step at a time (`actors.vllm.engine`): partial
rollouts park it between two steps while weights are installed, and streamed rollouts hand each prompt's
group of samples back as soon as its last sample finishes, and stop the rest when told.

Each step runs on one weight version: every token records the version of the step that made it. The KV
cache of tokens made before an install stays as the old weights computed it, as in other partial-rollout
systems; the behaviour logprobs are the ones really sampled from.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterator, Sequence

_REQUESTS = itertools.count()  # request ids of stepwise generations


def sampled_logprobs(c) -> tuple[float, ...]:
    """The logprob of each sampled token from a vLLM CompletionOutput (asked with logprobs=0)."""
    return tuple(step[t].logprob for step, t in zip(c.logprobs or [], c.token_ids))


def first_token_at(req) -> float:
    """When the request's first token came out, wall clock (its arrival and vLLM's first-token latency, both taken
    by the frontend); 0 where vLLM kept no timings (`disable_log_stats`)."""
    m = getattr(req, "metrics", None)
    latency = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
    return m.arrival_time + latency if latency else 0.0


def ray_cancelled() -> Callable[[], bool]:
    """In a Ray actor's task: whether the caller cancelled it (`ray.cancel`, a flag the task reads); elsewhere
    never."""
    try:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().get_actor_id():
            return ray.get_runtime_context().is_canceled
    except Exception:
        pass
    return lambda: False


def step_groups(eng, prompts: Sequence[Sequence[int]], params: Sequence, n: int,
                stop: Callable[[], bool] = lambda: False) -> Iterator[list[tuple[int, str, list]]]:
    """After each decode step that finished some prompts' last samples: those prompts, each as (prompt index,
    request id, its n samples as [tokens, logprobs, versions, finish reason, cached prompt tokens, when the
    first token came out (0: no timings kept)]). `eng`: the VLLMEngine (its
    `llm`, weight version, install parking and serving check). `stop()` true between two steps, or the
    consumer closing the generator, aborts every request still running (their samples are never yielded);
    so does an error. The caller takes (or drops) the requests' captured routes afterwards."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine, tag = eng.llm.llm_engine, next(_REQUESTS)
    ids = [f"rlhf-{tag}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    seqs: dict[str, list] = {rid: [None] * n for rid in ids}  # request -> per sample [tokens, logp, versions, finish,
    # cached, first token at]
    left = {rid: n for rid in ids}  # samples still running
    for rid, p, sp in zip(ids, prompts, params):
        sp.output_kind = RequestOutputKind.DELTA
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), sp)
    try:
        while engine.has_unfinished_requests():
            if stop():
                engine.abort_request([rid for rid, k in left.items() if k])
                return
            eng._step_boundary()
            eng._check_serving()  # an install that failed part-way: never continue on a mix
            done = []
            for out in engine.step():
                for c in out.outputs:
                    seq = seqs[out.request_id][c.index]
                    if seq is None:
                        seq = seqs[out.request_id][c.index] = [[], [], [], None, 0, first_token_at(out)]
                    seq[4] = out.num_cached_tokens or 0
                    seq[0] += c.token_ids
                    seq[1] += sampled_logprobs(c)
                    seq[2] += [eng.weight_version] * len(c.token_ids)
                    if c.finish_reason and seq[3] is None:
                        seq[3] = c.finish_reason
                        left[out.request_id] -= 1
                        if not left[out.request_id]:
                            done.append(out.request_id)
            if done:
                yield [(index[rid], rid, seqs[rid]) for rid in done]
    except BaseException:  # an error, or the consumer closed the generator (GeneratorExit)
        engine.abort_request([rid for rid, k in left.items() if k])
        raise
    missing = [(rid, k) for rid in ids for k in range(n) if seqs[rid][k] is None or seqs[rid][k][3] is None]
    if missing:
        raise RuntimeError(f"vLLM finished without output for {len(missing)} sample(s), e.g. {missing[0]}")
