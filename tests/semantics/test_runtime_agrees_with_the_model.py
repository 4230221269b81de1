"""The runtime agrees with the reference model (``tests/semantics/model.py``) on random
workflows that combine the features, crashed and resumed at random points.

Hypothesis draws a workflow (``tests.support.strategies.combined_workflows``: maps over lists,
mappings and keyed records, zero items, item-wise chains, conditions some raising,
joins, questions, typed outputs through a codec, retries, timeouts, version bumps; or
``tests.semantics.strategies``: short chains where those meet, workflows whose steps
change shape between code phases, resumed with ``allow_graph_change``, child workflows,
children per item, changed code and a cache, loops whose body is a workflow), the run's
arguments (a concurrency limit, ``isolate_failures``, a budget, ``only=``), a store
(JSON file, journal, SQLite; PostgreSQL when ``EKIT_TEST_POSTGRES_DSN`` is set) and
a script of turns (bumps, rewinds of a step, an item or an upstream, crashes at a
save or at a step call). ``tests.semantics.drive`` runs it and compares every turn
with the model; see there for what is compared.

Concurrency makes the global order of events nondeterministic: with
``max_concurrency=1`` the whole order, every checkpoint and every call are compared;
with more, each step's and item's own event sequence and the final checkpoint,
when nothing order-dependent (a halt, a budget, a crash) decides the run's end.

``EKIT_MODEL_EXAMPLES`` raises the number of examples for a long hunt.
The default run draws the same examples every time (Hypothesis' ``derandomize``):
the suite's verdict must not depend on the day's draw while the model still
finds disagreements no one has settled (docs/testing.md lists them). A hunt
draws afresh: ``EKIT_MODEL_RANDOM=1``, or any ``EKIT_MODEL_EXAMPLES``.

A second test draws only workflows around one loop whose body is a workflow
(``body_loop_workflows``), ``EKIT_MODEL_BODY_EXAMPLES`` of them (300; set, it draws
afresh too): the body defects the hunts found need meetings the mixed draw seldom makes.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, event, given, reject, settings
from hypothesis import strategies as st

from tests.semantics.drive import DSN, KnownBug, RunArgs, Turn, drive
from tests.semantics.strategies import (
    CodedWorkflow,
    body_loop_workflows,
    body_workflows,
    chained_workflows,
    coded_workflows,
    flat_steps,
    nested_workflows,
    per_item_workflows,
    reshaped_workflows,
)
from tests.support.strategies import Features, PlannedWorkflow, combined_workflows

EXAMPLES = int(os.environ.get("EKIT_MODEL_EXAMPLES", "300"))
# (body loops' own draws: their defects need meetings the mixed draw seldom makes)
BODY_EXAMPLES = int(os.environ.get("EKIT_MODEL_BODY_EXAMPLES", "300"))
HUNTING = os.environ.get("EKIT_MODEL_RANDOM") == "1" or any(
    n in os.environ for n in ("EKIT_MODEL_EXAMPLES", "EKIT_MODEL_BODY_EXAMPLES"))
# EKIT_MODEL_SHRINK=0 reports the first disagreement as found (quicker while hunting).
PHASES = [p for p in Phase if os.environ.get("EKIT_MODEL_SHRINK") != "0" or p != Phase.shrink]
STORES = ["json", "journal", "sqlite"] + (["postgres"] if DSN else [])


def turns(plan: PlannedWorkflow) -> st.SearchStrategy[list[Turn]]:
    """Disturbed runs: bumps, rewinds of steps and items, crashes at saves and calls."""
    names = list(flat_steps(plan.steps))  # (a child's steps too: P/c0)
    bumps = st.booleans() if plan.phases > 1 else st.just(False)
    crash = st.none() | st.integers(1, 8)
    # (a fresh run, sharing the cache with the runs before it: where hits come from)
    fresh = st.integers(0, 1).map(lambda n: n == 0) if isinstance(plan, CodedWorkflow) \
        else st.just(False)
    return st.lists(st.builds(Turn, bumps, st.none() | st.sampled_from(names),
                              st.none() | st.integers(0, 3), crash, crash, fresh),
                    min_size=1, max_size=5)


def body_turns(plan: PlannedWorkflow) -> st.SearchStrategy[list[Turn]]:
    """As ``turns``, but rewinding at most turns, a step of the loop's body half the time,
    and bumping more often: what a body loop's defects need beside its own draws."""
    names = list(flat_steps(plan.steps))
    body = [n for n in names if "/" in n] or names
    rewinds = st.sampled_from(names) | st.sampled_from(body)
    crash = st.none() | st.integers(1, 8)
    return st.lists(st.builds(Turn, st.integers(0, 2).map(bool), st.none() | rewinds | rewinds,
                              st.none() | st.integers(0, 3), crash, crash),
                    min_size=2, max_size=5)


@st.composite
def run_args(draw: st.DrawFn, plan: PlannedWorkflow) -> RunArgs:
    """A run's arguments: mostly one attempt at a time (everything is then compared)."""
    only = None
    if draw(st.integers(0, 4)) == 0:
        only = (draw(st.sampled_from(list(flat_steps(plan.steps)))),)
    return RunArgs(
        concurrency=draw(st.sampled_from([1, 1, 1, 2, None])),
        isolate_failures=draw(st.booleans()),
        budget_calls=draw(st.integers(1, 12)) if draw(st.integers(0, 3)) == 0 else None,
        only=only,
        approval=draw(st.integers(0, 3)) == 0,
    )


@pytest.mark.timeout(max(600, 3 * EXAMPLES))  # a deadlock detector only (a long hunt: longer)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          phases=PHASES, derandomize=not HUNTING, database=None if not HUNTING else settings().database)
@given(plan=st.one_of(combined_workflows(), combined_workflows(Features(loops=True)),
                      combined_workflows(Features(loops=True)), chained_workflows(),
                      chained_workflows(upstream_changes=True), reshaped_workflows(),
                      nested_workflows(), nested_workflows(loops=True), per_item_workflows(),
                      coded_workflows(), body_workflows(), body_workflows(), body_workflows()),
       store=st.sampled_from(STORES),
       data=st.data())
def test_the_runtime_does_what_the_model_says(plan: PlannedWorkflow, store: str,
                                              data: st.DataObject) -> None:
    args = data.draw(run_args(plan), label="args")
    script = data.draw(turns(plan), label="turns")
    salt = data.draw(st.integers(0, 2**16), label="salt")  # the outputs, decisions, faults
    event(f"drawn: {type(plan).__name__}")
    try:
        drive(plan, store, script, args, salt)
    except KnownBug as bug:  # written down already: do not count the example
        event(f"met a known disagreement: {bug}")
        reject()


# (its own test, not a strategy weighted into the one above: the draws above stay as they
# were, and these get an examples budget of their own)
@pytest.mark.timeout(max(600, 3 * BODY_EXAMPLES))  # a deadlock detector only
@settings(max_examples=BODY_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
          phases=PHASES, derandomize=not HUNTING, database=None if not HUNTING else settings().database)
@given(plan=body_loop_workflows(), store=st.sampled_from(STORES), data=st.data())
def test_a_loop_whose_body_is_a_workflow_does_what_the_model_says(
        plan: PlannedWorkflow, store: str, data: st.DataObject) -> None:
    """The same comparison on workflows built around one body loop, where a condition
    above it, bumps, ``keep_last`` and a body map's failures and questions meet."""
    args = data.draw(run_args(plan), label="args")
    script = data.draw(body_turns(plan), label="turns")
    salt = data.draw(st.integers(0, 2**16), label="salt")
    try:
        drive(plan, store, script, args, salt)
    except KnownBug as bug:
        event(f"met a known disagreement: {bug}")
        reject()
