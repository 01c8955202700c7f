"""The batch-invariant Triton grouped GEMM (`grouped_gemm`) and its tile table (`grouped_gemm_config`);
not a planner backend (docs/design.md §3)."""
