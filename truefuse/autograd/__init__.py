"""torch.autograd.Function classes and the functional API built on them (DESIGN §5)."""
