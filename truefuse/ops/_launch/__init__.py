"""What every family's launcher shares: registering a custom op (`custom_op`), whether and where Triton
runs (`triton`), DTensor inputs (`dtensor`), the dtype rules (`dtypes`) and what a CUDA-graph capture
forbids (`capture`). docs/design.md §5, §6.7, §6.9."""
