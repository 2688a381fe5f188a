"""RL maths as small pure functions over named tensors: advantages, policy losses, KL estimators."""
