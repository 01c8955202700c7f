"""The LM head's host code: the chunked head (`chunked_head`), its GEMMs and vocabulary split
(`chunked_head_gemms`), the cross-entropy and log-prob chunk math (`linear_cross_entropy*`,
`linear_log_probs`), the lean vocabulary slices (`linear_cross_entropy_slices`), and per-token
log-probabilities from given logits (`token_log_probs`). docs/design.md §3, §5."""
