"""``truefuse verify``: every declared contract, checked on the device at hand (docs/design.md §1)."""

from truefuse.verify.registry import Case, all_cases, register
from truefuse.verify.runner import Row, print_table, run_case, verify

__all__ = ["Case", "Row", "all_cases", "print_table", "register", "run_case", "verify"]
