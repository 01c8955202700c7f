"""The LM head's host code: the chunked head (`chunked_head`), its GEMMs and vocabulary split
(`chunked_head_gemms`), the cross-entropy and log-prob chunk math (`linear_cross_entropy*`,
`linear_log_probs`) and the lean vocabulary slices (`linear_cross_entropy_slices`). docs/design.md §3, §5."""
