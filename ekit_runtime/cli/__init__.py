"""The ``ekit`` command line, one package: the command and each of its subcommands.

Floors, lowest first (each module imports only those before it):

- :mod:`~ekit_runtime.cli.common`: what every subcommand shares (exit codes,
  :class:`InputError`, the guarded ``--workflow`` import);
- :mod:`~ekit_runtime.cli.watch` (``ekit queue watch``),
  :mod:`~ekit_runtime.cli.cache` (``ekit cache``), :mod:`~ekit_runtime.cli.ui`
  (``ekit ui``), :mod:`~ekit_runtime.cli.queue` (``ekit worker``, ``ekit queue``);
- :mod:`~ekit_runtime.cli.command`: the ``ekit`` command itself (its parser,
  :func:`main`, and ``audit``, ``replay``, ``rewind``, ``graph``, ``demo``),
  whose docstring is the command line's contract: subcommands, inputs, exit codes.

The modules these were before (``ekit_runtime.cli_common``,
``ekit_runtime.queue.cli``, ``ekit_runtime.queue.watch``,
``ekit_runtime.ui.cli``, ``ekit_runtime.cache.cli``) still import: each is
the module it moved to, under its old name too.
"""

from ekit_runtime.cli.command import (
    EXIT_BROKEN_PIPE,
    EXIT_CLEAN,
    EXIT_FOUND,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    InputError,
    dot,
    main,
    mermaid,
)

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CLEAN",
    "EXIT_FOUND",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "InputError",
    "dot",
    "main",
    "mermaid",
]
