"""The vLLM engine role and its parts: the Ray actor (`engine`), what runs inside vLLM's worker processes
(`worker_ext`: weight sync receive and exact install; `route_capture`: the experts each token took;
`sampler`, `stepwise`), the CPU platform's settings (`platform`) and the install of weights into vLLM's
own buffers (`install`). Only this package and `actors.roles` import vllm.
"""
