"""`truefuse.gemm` and what it stands on: the entry points (`gemm`), the one argument check
(`gemm_checks`), the plain call's kept plans (`gemm_runners`), the custom ops (`gemm_op`), the
planner (`gemm_plan`), its executor (`gemm_exec`) and backends (`gemm_backends/`), the
batch-invariant launch table (`gemm_bi_config`), and the epilogues' math (`activation`,
`bias_grad`). docs/design.md §3, docs/gemm.md."""
