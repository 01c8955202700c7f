"""Attention's host code: the launchers and reference (`attention`), the row-invariant PyTorch path
(`attention_blocked`), the mask (`attention_mask`) and the launch table (`attention_config`). docs/attention.md."""
