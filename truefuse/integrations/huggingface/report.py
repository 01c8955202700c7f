"""``PatchReport``: what ``apply_truefuse`` replaced, by type and count, and what it left and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class PatchReport:
    """The outcome of one ``apply_truefuse`` call.

    Attributes:
        architecture: the architecture key (``llama``, ``gemma2``, ...).
        replaced: ``{(stock type, truefuse path): count}`` of the modules now on truefuse.
        left: ``{(stock type, reason): count}`` of the modules of a patchable kind left stock.
        loss: whether the causal-LM forward computes ``truefuse.linear_cross_entropy``.
        loss_memory: its ``memory`` (``apply_truefuse(loss_memory=...)``).
        batch_invariant: ``{(module, path): count}`` of what runs batch-invariant while the model's
            forward runs (``apply_truefuse(batch_invariant=True)``; empty otherwise).
        attention: what the attention modules run when ``attention=True`` patched them ("": not asked).
    """

    architecture: str
    replaced: Counter = field(default_factory=Counter)
    left: Counter = field(default_factory=Counter)
    loss: bool = False
    loss_note: str = ""
    loss_memory: str = "default"
    batch_invariant: Counter = field(default_factory=Counter)
    attention: str = ""

    def count(self, stock_type: str) -> int:
        """How many modules of ``stock_type`` were replaced."""
        return sum(n for (t, _), n in self.replaced.items() if t == stock_type)

    def __str__(self) -> str:
        lines = [f"truefuse patch of a {self.architecture} model"]
        for (t, how), n in sorted(self.replaced.items()):
            lines.append(f"  replaced {n:4d} x {t:<24} -> {how}")
        lean = ", memory='lean'" if self.loss_memory == "lean" else ""
        # the model's own forward; TRL's trainers replace it with their head (docs/trl.md)
        fused = (
            f"truefuse.linear_cross_entropy (no logits when labels are given{lean}; TRL's trainers run "
            "their own head unless truefuse.integrations.trl.use_truefuse_head() is on)"
        )
        loss = fused if self.loss else f"stock ({self.loss_note})"
        lines.append(f"  loss: {loss}")
        if self.attention:
            lines.append(f"  attention: {self.attention}")
        for (t, why), n in sorted(self.left.items()):
            lines.append(f"  left     {n:4d} x {t:<24} ({why})")
        for (t, how), n in sorted(self.batch_invariant.items()):
            lines.append(f"  batch-invariant {n:4d} x {t:<24} ({how})")
        return "\n".join(lines)
