"""What every family's launcher shares: registering a custom op (`custom_op`), whether and where Triton
runs (`triton`), DTensor inputs (`dtensor`) and the dtype rules (`dtypes`). docs/design.md §5, §6.7, §6.9."""
