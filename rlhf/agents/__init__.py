"""Multi-turn, tool-using episodes: environments, token-in-token-out episodes, and the loop that runs them.

- `environment`: the interface a user's environment implements, and its loading by name (`module:Class`).
- `episode`: one episode as token ids (prompt, sampled turns, observations), its loss mask, behaviour
  logprobs and weight versions, its limits and end status, and the token-fidelity check.
- `calculator`: the shipped calculator tool.
- `runner`: many episodes turn by turn over any batch `generate` (a vLLM engine's, in tests a stand-in).
"""
