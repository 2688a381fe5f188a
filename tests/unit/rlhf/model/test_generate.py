import torch

from rlhf.schema import ModelConfig
from rlhf.model.generate import greedy_generate
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM


def test_batched_left_padded_greedy_equals_one_at_a_time():
    cfg = ModelConfig(vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, eos_token_id=2)
    model = Qwen3MoeForCausalLM(cfg).eval()
    model.init_weights(seed=5, std=0.5)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 24, (n,), generator=g).tolist() for n in (3, 7, 1, 5)]
    batched = greedy_generate(model, prompts, max_new_tokens=6)
    single = [greedy_generate(model, [p], max_new_tokens=6)[0] for p in prompts]
    assert batched == single
    assert all(len(o) <= 6 and cfg.eos_token_id not in o for o in batched)
