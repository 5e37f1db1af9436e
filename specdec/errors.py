"""Errors raised by specdec.

::

    SpecDecError                 base of everything specdec raises
    ├── ProposerConfigError      a proposer or policy config value is out of range (ValueError)
    └── VerifyInputError         verify() got logits/proposals/sampling that do not line up (ValueError)

Internal invariants use ``assert``; these are for values that cross a boundary
(a compiled config, the engine's call into verify).
"""

from __future__ import annotations


class SpecDecError(Exception):
    """Base of every error raised by specdec."""


class ProposerConfigError(SpecDecError, ValueError):
    """A proposer or depth-policy config value is out of range; the message names it."""


class VerifyInputError(SpecDecError, ValueError):
    """Logits, proposals and sampling parameters passed to verify() do not line up."""
