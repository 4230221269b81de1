"""Token usage: the one unit of cost the library accounts for.

This module owns the arithmetic of usage and the rule for when a budget is
reached. Everything here is a frozen value.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NO_USAGE", "TokenUsage", "check_usage"]


@dataclass(frozen=True, slots=True)
class TokenUsage:
    """Token and call counts spent by one step or by a whole run.

    Values add with ``+`` and subtract with ``-`` field by field. The same
    class doubles as a budget (see :meth:`reached`): a field left at ``0`` is
    not limited.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    llm_calls: int = 0

    def __add__(self, other: TokenUsage) -> TokenUsage:
        if not isinstance(other, TokenUsage):
            return NotImplemented
        return TokenUsage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.llm_calls + other.llm_calls,
        )

    def __sub__(self, other: TokenUsage) -> TokenUsage:
        if not isinstance(other, TokenUsage):
            return NotImplemented
        return TokenUsage(
            self.input_tokens - other.input_tokens,
            self.output_tokens - other.output_tokens,
            self.llm_calls - other.llm_calls,
        )

    @property
    def total_tokens(self) -> int:
        """Input plus output tokens."""
        return self.input_tokens + self.output_tokens

    def is_zero(self) -> bool:
        """True when every count is zero."""
        return not (self.input_tokens or self.output_tokens or self.llm_calls)

    def reached(self, used: TokenUsage) -> bool:
        """Read ``self`` as a budget: has ``used`` reached any limited field?

        A field of the budget that is ``0`` places no limit. A budget of all
        zeros is therefore never reached.
        """
        return (
            (self.input_tokens > 0 and used.input_tokens >= self.input_tokens)
            or (self.output_tokens > 0 and used.output_tokens >= self.output_tokens)
            or (self.llm_calls > 0 and used.llm_calls >= self.llm_calls)
        )

    def to_dict(self) -> dict[str, int]:
        """The three counts as a plain dict."""
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "llm_calls": self.llm_calls,
        }


NO_USAGE = TokenUsage()
"""Zero usage, shared: TokenUsage is immutable, so one instance serves every default."""

_COUNTS = ("input_tokens", "output_tokens", "llm_calls")


def check_usage(value: object, name: str) -> TokenUsage:
    """``value`` if a :class:`TokenUsage` of counts (ints >= 0), else a ``ValueError`` naming
    ``name`` (and the count): a NaN, negative, float or bool count is no usage a checkpoint holds,
    and a NaN one is never reached by a budget."""
    if not isinstance(value, TokenUsage):
        raise ValueError(f"{name} must be a TokenUsage, got {type(value).__name__}")
    for field_name in _COUNTS:
        count = getattr(value, field_name)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{name}.{field_name} must be an int >= 0, got {count!r:.80}")
    return value
