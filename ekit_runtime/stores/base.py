"""What every store object is: something that closes (``with store:``) and takes only checkpoints."""

from __future__ import annotations

from typing import Self

from ekit_core import WorkflowCheckpoint

__all__ = [
    "Store",
    "require_checkpoint",
]


def require_checkpoint(checkpoint: object) -> None:
    """Refuse anything but a :class:`WorkflowCheckpoint` with a ``ValueError``."""
    if not isinstance(checkpoint, WorkflowCheckpoint):
        raise ValueError(f"checkpoint must be a WorkflowCheckpoint, got {type(checkpoint).__name__}")


class Store:
    """What every store shares beyond its codec: ``with store:`` closes it at the block's end."""

    __slots__ = ()

    def close(self) -> None:
        """Let go of what the store holds (its write lock, its connection)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
