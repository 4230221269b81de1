"""Which queued run is whose child, and the database's half of the durable join.

A step declared ``child=Child(wf, queued=True)`` runs its child as a run of
its own (:mod:`ekit_runtime.queue.lifecycle`: ``spawn``, ``join``, ``wake``).
The link is a row of ``ekit_queue_children`` (child, parent, step), written in
the transaction that submits the child, so a child never exists unlinked.

The wake-up is a trigger, not a verb's statement: every path that ends a run
(a holder's finish, a worker's batch of endings, a cancel, a claim sweeping an
abandoned run) is one ``UPDATE`` of its status, and the trigger on it queues
the waiting parent in that same transaction. A SIGKILL between the child's end
and the parent's wake-up is thus impossible: there is no between. On
PostgreSQL the trigger locks the parent's row first, so a parent parking at
that moment (``join``, which locks its row and then reads its children) either
sees the child ended or is woken by it.

Nothing here runs SQL: the statements are data, executed by the backends when
a queue is opened.
"""

from __future__ import annotations

import hashlib

from ekit_runtime.queue.lifecycle import CHILDREN_REASON, FINAL

__all__ = [
    "DESCENDANTS",
    "JOIN_LOCK",
    "child_run_id",
    "FORGOTTEN_LINKS",
    "NOT_A_KEPT_CHILD",
    "POSTGRES_LINKS",
    "SQLITE_LINKS",
    "sqlite_close_children",
    "wake_condition",
]


def wake_condition(parent: str) -> str:
    """SQL of the runs a child's end (``NEW``) wakes: ``parent`` (an expression naming it), if it
    waits for its children (a parent waiting for a person is left for the person's answer), once
    the last of its children not yet ended ends, or at once when one fails or is cancelled (its
    rules decide what else stops): a parent of a hundred items' children is woken once, not a
    hundred times. Run after the join's lock on PostgreSQL, so that of two last children ending
    at once the second to commit sees the first ended."""
    unended = (f"SELECT 1 FROM ekit_queue_children l JOIN ekit_queue_runs c ON c.run_id = l.child "
               f"WHERE l.parent = {parent} AND NOT {FINAL.replace('status', 'c.status')}")
    return (f"run_id = {parent} AND status = 'waiting' AND reason LIKE '{CHILDREN_REASON}%' "
            f"AND (NEW.status <> 'finished' OR NOT EXISTS ({unended}))")


_NEW_FINAL = FINAL.replace("status", "NEW.status")
_OLD_NOT_FINAL = "NOT " + FINAL.replace("status", "OLD.status")

JOIN_LOCK = 0x656B6A6E  # "ekjn"
"""The first key of the advisory lock (with ``hashtext`` of the parent's id) under which, on
PostgreSQL, a parent's ``join`` reads its children and a child's end wakes it."""

_NEW_ENDED_EARLY = "NEW.status IN ('failed', 'cancelled')"
_LINKED_CHILD = "run_id IN (SELECT child FROM ekit_queue_children WHERE parent = NEW.run_id)"
_STOPPED_AT_ONCE = "(status IN ('queued', 'waiting') OR (status = 'running' AND lease_until <= {now}))"
_FLAGGED = "status = 'running' AND lease_until > {now}"

_TABLE = (
    "CREATE TABLE IF NOT EXISTS ekit_queue_children (child {text} PRIMARY KEY, parent {text} NOT NULL, "
    "step {text} NOT NULL)"
)
_INDEX = "CREATE INDEX IF NOT EXISTS ekit_queue_children_parent ON ekit_queue_children (parent)"

SQLITE_LINKS = f"""
{_TABLE.format(text="TEXT")};
{_INDEX};
CREATE TRIGGER IF NOT EXISTS ekit_queue_wake_parent AFTER UPDATE OF status ON ekit_queue_runs
WHEN {_NEW_FINAL} AND {_OLD_NOT_FINAL} BEGIN
    UPDATE ekit_queue_runs SET status = 'queued', epoch = epoch + 1, reason = NULL,
        updated_at = (julianday('now') - 2440587.5) * 86400.0
    WHERE {wake_condition("(SELECT parent FROM ekit_queue_children WHERE child = NEW.run_id)")};
END;
"""
"""The link table, its index and the wake-up trigger, as SQLite runs them (each ``IF NOT EXISTS``)."""

_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


def sqlite_close_children(fold: str) -> str:
    """The close trigger, as SQLite runs it: a run ending ``failed`` or ``cancelled`` cancels its
    children not yet ended, by the table's ``close`` rows (``fold``: what SQLite's writes that take a
    run out of ``running`` add to their ``SET``). A child it ends fires it in turn, down the tree
    (the connection sets ``recursive_triggers``)."""
    now = _SQLITE_NOW
    return f"""
CREATE TRIGGER IF NOT EXISTS ekit_queue_close_children AFTER UPDATE OF status ON ekit_queue_runs
WHEN {_NEW_ENDED_EARLY} AND {_OLD_NOT_FINAL} BEGIN
    UPDATE ekit_queue_runs SET status = 'cancelled', epoch = epoch + 1, lease_until = NULL,
        cancel_requested = TRUE, updated_at = {now}{fold}
    WHERE {_LINKED_CHILD} AND {_STOPPED_AT_ONCE.format(now=now)};
    UPDATE ekit_queue_runs SET cancel_requested = TRUE WHERE {_LINKED_CHILD} AND {_FLAGGED.format(now=now)};
END;
"""

POSTGRES_LINKS = f"""
{_TABLE.format(text="text")};
{_INDEX};
CREATE OR REPLACE FUNCTION ekit_queue_wake_parent() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE p text;
BEGIN
    SELECT parent INTO p FROM ekit_queue_children WHERE child = NEW.run_id;
    IF p IS NULL THEN RETURN NULL; END IF;
    -- A join holds this lock (taken after its parent's row) from before it reads the
    -- children to its commit: this waits for it, then finds the parent waiting; a join
    -- that takes it after this commits reads the child ended. A person's reopening write
    -- takes it before the row: this waits for its commit or rollback. Another child's end
    -- holds it too: of two last children ending at once, the second sees the first ended.
    PERFORM pg_advisory_xact_lock({JOIN_LOCK}, hashtext(p));
    -- The parent's row is not waited for: whoever holds it is a join waiting for the
    -- lock above (it reads the child ended once this commits), or moves the parent out
    -- of waiting anyway (its end, a claim, a cancel). Waiting for it would
    -- deadlock with a parent's end that closes this child (parent's row, then this one).
    PERFORM 1 FROM ekit_queue_runs WHERE run_id = p FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN RETURN NULL; END IF;
    UPDATE ekit_queue_runs SET status = 'queued', epoch = epoch + 1, reason = NULL,
        updated_at = extract(epoch from now())::float8
    WHERE {wake_condition("p")};
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER ekit_queue_wake_parent AFTER UPDATE OF status ON ekit_queue_runs
FOR EACH ROW WHEN ({_NEW_FINAL} AND {_OLD_NOT_FINAL}) EXECUTE FUNCTION ekit_queue_wake_parent();
CREATE OR REPLACE FUNCTION ekit_queue_close_children() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE ekit_queue_runs SET status = 'cancelled', epoch = epoch + 1, lease_until = NULL,
        cancel_requested = TRUE, updated_at = extract(epoch from now())::float8
    WHERE {_LINKED_CHILD} AND {_STOPPED_AT_ONCE.format(now="extract(epoch from now())::float8")};
    UPDATE ekit_queue_runs SET cancel_requested = TRUE
    WHERE {_LINKED_CHILD} AND {_FLAGGED.format(now="extract(epoch from now())::float8")};
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER ekit_queue_close_children AFTER UPDATE OF status ON ekit_queue_runs
FOR EACH ROW WHEN ({_NEW_ENDED_EARLY} AND {_OLD_NOT_FINAL}) EXECUTE FUNCTION ekit_queue_close_children();
"""
"""The same for PostgreSQL, the close trigger included (run under the schema's advisory lock: two
openers do not race)."""

DESCENDANTS = (
    "WITH RECURSIVE tree(run_id, depth) AS ("
    "SELECT child, 1 FROM ekit_queue_children WHERE parent = :run_id "
    "UNION ALL SELECT c.child, t.depth + 1 FROM ekit_queue_children c JOIN tree t ON c.parent = t.run_id "
    "WHERE t.depth < 100) "
    "SELECT t.run_id, t.depth FROM tree t ORDER BY t.depth DESC, t.run_id"
)
"""The run's children, theirs, and so on (deepest first: a cascade locks a child before its parent,
in the order a child's end does, so two never wait on each other), at most 100 levels down."""

NOT_A_KEPT_CHILD = (
    "NOT EXISTS (SELECT 1 FROM ekit_queue_children l JOIN ekit_queue_runs p ON p.run_id = l.parent "
    "WHERE l.child = ekit_queue_runs.run_id)"
)
"""SQL of a run (of ``ekit_queue_runs``) that no run the queue keeps has as its child: a prune takes
a child only once its parent is gone (a child is pruned with its parent, never before)."""

FORGOTTEN_LINKS = "DELETE FROM ekit_queue_children WHERE child NOT IN (SELECT run_id FROM ekit_queue_runs)"
"""Drop the links of pruned children."""


def child_run_id(parent: str, step: str, number: int = 1) -> str:
    """The id of the child run of ``parent``'s ``step`` at its attempt ``number``: the attempt's key
    (``parent/step/number``, ``/1`` left out), the same at every resume of that attempt (so a
    submit made again finds it) and never another attempt's (a rewind, a changed version, another
    item: other work, another child); past the 200 characters a run id holds, ``parent``'s first
    100, ``/`` and a digest of all three."""
    plain = f"{parent}/{step}" if number == 1 else f"{parent}/{step}/{number}"
    if len(plain) <= 200:
        return plain
    digest = hashlib.sha256(f"{len(parent)}:{plain}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"{parent[:100]}/{digest[:64]}"
