"""Integrations of truefuse into other frameworks; each lives on top of the public API and imports
its framework lazily (an optional extra): ``huggingface`` (``pip install truefuse[hf]``)."""
