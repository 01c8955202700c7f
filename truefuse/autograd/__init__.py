"""torch.autograd.Function classes and the functional API built on them (docs/design.md §5)."""
