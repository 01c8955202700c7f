"""Thin modules: parameters, initialisation, repr; each forward is one call into ``truefuse.autograd``."""
