"""What a resume does with a step whose code changed since its output was recorded: the rule.

This module owns the rule of issue 45's fingerprints. The shell hashes each
step's code (``ekit_runtime.fingerprints``) when the workflow asks for it and
hands the core the fingerprints, as it hands it the ``version`` tags; the
core records them (``WorkflowCheckpoint.code_fingerprints``) and, on a
resume, compares them with the recorded ones. A step whose recorded
fingerprint differs from its current one has *changed since recorded*, and
meets its policy:

=========  ====================================================================
policy     what the resume does
=========  ====================================================================
again      runs it again, with everything downstream (what a ``version`` bump
           does): its outputs and its items' go, its next attempt has a new key
keep       keeps its recorded outputs; the record keeps the old fingerprint, so
           ``audit`` goes on saying it was kept although the code changed; its
           items not recorded run the new code under new attempt numbers
           (``CodeDecision.kept``, which the core is handed as ``code_kept``)
refuse     refuses the resume before anything runs: :class:`CodeChangedError`
           names every such step
=========  ====================================================================

A fingerprint on one side only (a checkpoint recorded before the workflow
asked for fingerprints, or a run that stopped asking) claims nothing: no
change. Only a step with something recorded (its output, or an item's)
meets a policy: a step that never finished runs its current code anyway,
and its attempt is numbered past the old code's interrupted ones all the
same (``changed_steps`` counts it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from ekit_core.usage import NO_USAGE, TokenUsage

__all__ = ["POLICIES", "CacheHit", "CodeChangedError", "CodeDecision", "CodePolicy", "code_changed",
           "decide"]

CodePolicy = Literal["again", "keep", "refuse"]
POLICIES: tuple[CodePolicy, ...] = ("again", "keep", "refuse")
"""The policies a changed fingerprint meets on resume, by name."""


class CodeChangedError(ValueError):
    """A resume was refused: steps with ``on_code_change="refuse"`` changed since recorded.

    ``steps`` names them, in declaration order. Nothing ran and nothing was
    paid. Bump nothing: choose ``"again"`` or ``"keep"`` for them (or rewind
    them) and resume again.
    """

    def __init__(self, steps: tuple[str, ...]) -> None:
        super().__init__(
            "the code of step(s) " + ", ".join(map(repr, steps)) + " changed since their outputs "
            "were recorded, and their on_code_change is 'refuse': choose 'again' (run them "
            "again) or 'keep' (keep what was recorded) to resume"
        )
        self.steps = steps


def code_changed(recorded: Mapping[str, str], current: Mapping[str, str], name: str) -> bool:
    """Whether step ``name``'s code changed: both sides have a fingerprint and they differ."""
    old = recorded.get(name)
    if old is None:
        return False
    new = current.get(name)
    return new is not None and new != old


@dataclass(frozen=True, slots=True)
class CodeDecision:
    """What a resume does with each step's code, decided before anything runs.

    ``fingerprints`` is what the run hands the core and records: the
    current fingerprint of each step, except the recorded one for a step
    kept (``keep``). ``changed`` names every recorded step whose code
    changed since recorded, ``again`` those that run again, ``kept`` those
    kept, ``refused`` those whose policy refuses the resume.
    """

    fingerprints: MappingProxyType[str, str]
    changed: tuple[str, ...] = ()
    again: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()


def decide(names: Iterable[str], recorded: Mapping[str, str], current: Mapping[str, str],
           policies: Mapping[str, CodePolicy], outputs: Mapping[str, object]) -> CodeDecision:
    """The :class:`CodeDecision` of a resume (see the module for the rule).

    ``names`` are the graph's steps in declaration order; ``recorded`` the
    checkpoint's ``code_fingerprints``, ``current`` the steps' fingerprints
    now, ``policies`` each fingerprinted step's policy, ``outputs`` the
    checkpoint's outputs (a step counts as recorded with its own output or
    an item's, ``step[key]``).
    """
    if not recorded or not current or recorded == current:  # (the usual resume: nothing changed)
        return CodeDecision(MappingProxyType(dict(current)))
    changed = [n for n in names if code_changed(recorded, current, n) and _has_output(n, outputs)]
    if not changed:
        return CodeDecision(MappingProxyType(dict(current)))
    by: dict[str, list[str]] = {p: [] for p in POLICIES}
    for name in changed:
        by[policies.get(name, "again")].append(name)
    fingerprints = dict(current)
    for name in by["keep"]:
        fingerprints[name] = recorded[name]
    return CodeDecision(MappingProxyType(fingerprints), tuple(changed), tuple(by["again"]),
                        tuple(by["keep"]), tuple(by["refuse"]))


def _has_output(name: str, outputs: Mapping[str, object]) -> bool:
    if name in outputs:
        return True
    prefix = f"{name}["
    return any(k.startswith(prefix) for k in outputs)


@dataclass(frozen=True, slots=True)
class CacheHit:
    """An output a run's cache handed back instead of running its step (see ``docs/cache.md``).

    ``key`` is the cache entry's key, ``saved`` the usage that making the
    output cost when it was made (what the hit saved). Recorded in the
    checkpoint's ``cache_hits`` beside the output, and carried by resumes
    while the output stays recorded.
    """

    key: str
    saved: TokenUsage = NO_USAGE

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-safe data."""
        return {"key": self.key, "saved": self.saved.to_dict()}
