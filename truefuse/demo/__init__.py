"""``python -m truefuse demo``: train a small Llama (transformers, random init) on the Python standard
library's own sources twice, stock and patched with ``apply_truefuse``, from the same weights on the
same batches, and show loss curves, step time and memory side by side.

``data`` builds the corpus, tokenizer and batches; ``train`` runs the training; ``report`` prints the
table and writes ``results.json`` and ``demo.png``; ``cli`` is the command; ``fsdp`` runs the same
under FSDP2 on N local ranks (``--world-size N``) and ``profile`` counts host syncs and profiles a step. transformers and
tokenizers (``pip install truefuse[hf]``) are imported only when a demo runs.
"""

from truefuse.demo.train import PRESETS, DemoConfig, DemoResult, RunResult, make_config, run_demo

__all__ = ["PRESETS", "DemoConfig", "DemoResult", "RunResult", "make_config", "run_demo"]
