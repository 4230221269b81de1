"""``PostgresStore`` refuses what PostgreSQL cannot keep, naming it, before the first step.

PostgreSQL text holds no NUL character, and the store's keys (the run id,
and the run id with a step name) must fit a btree index entry. A run id
that breaks either rule is refused when the store is made, before it
connects; a step name when the run starts (``prepare_run``) or at a save,
always with a ``ValueError`` naming it, never ``psycopg.DataError`` after
the step was paid. Against the real server, with the limit's boundary.
"""

from __future__ import annotations

import asyncio
import json
from types import MappingProxyType
from typing import Any

import pytest

from ekit_runtime import PostgresStore, Step, UnencodableError, Workflow, WorkflowCheckpoint
from ekit_runtime.stores.rows import PG_KEY_BYTES
from tests.support.queue_backends import postgres_url

__all__ = ["postgres_url"]

# Two bytes each in UTF-8, exactly the limit, and in no repeating pattern:
# PostgreSQL compresses a repetitive key, which would pass whatever its size.
AT_LIMIT = "".join(chr(0x100 + (i * 7919) % 0x6FF) for i in range(PG_KEY_BYTES // 2))
OVER = AT_LIMIT + "x"


def _cp(outputs: dict[str, Any]) -> WorkflowCheckpoint:
    return WorkflowCheckpoint(len(outputs), MappingProxyType(outputs))


@pytest.mark.parametrize(
    ("run_id", "why"),
    [("run\x00id", "it holds a NUL character (at 3)"), (OVER, f"it is {PG_KEY_BYTES + 1} bytes in UTF-8")],
    ids=["nul", "too-long"],
)
def test_a_run_id_postgresql_cannot_key_is_refused_before_connecting(run_id: str, why: str) -> None:
    # Nothing listens there: the refusal comes before any connection is tried.
    with pytest.raises(ValueError, match=r"^run_id .* cannot be a PostgreSQL key: ") as info:
        PostgresStore("host=/nonexistent-ekit-socket-dir dbname=x", run_id=run_id)
    assert why in str(info.value)


def test_a_run_id_and_a_step_name_at_the_limit_are_stored(postgres_url: str) -> None:
    with PostgresStore(postgres_url, run_id=AT_LIMIT) as store:
        store(_cp({AT_LIMIT: "output"}))
        assert store.load() == _cp({AT_LIMIT: "output"})
        assert store.runs() == [AT_LIMIT]


@pytest.mark.parametrize(
    ("name", "why"),
    [("step\x00", "it holds a NUL character (at 4)"), (OVER, f"it is {PG_KEY_BYTES + 1} bytes in UTF-8")],
    ids=["nul", "too-long"],
)
def test_a_step_name_postgresql_cannot_key_is_refused_before_the_first_step(
    postgres_url: str, name: str, why: str
) -> None:
    ran: list[str] = []

    async def paid(ctx: dict[str, Any]) -> str:
        ran.append(name)
        return "output"

    with PostgresStore(postgres_url, run_id="r") as store:
        with pytest.raises(UnencodableError) as info:
            asyncio.run(Workflow([Step(name, paid)]).run(checkpoint_fn=store))
        assert ran == []
        assert info.value.step == name
        assert why in str(info.value)
        # Saved directly (no run to prepare), the same refusal, and nothing reaches the server.
        with pytest.raises(UnencodableError, match=r"cannot store step .* in PostgreSQL"):
            store(_cp({"fine": 1, name: "output"}))
        assert store.load() is None


def test_prepare_run_refuses_a_version_tag_utf8_cannot_hold(postgres_url: str) -> None:
    checkpoint = WorkflowCheckpoint(
        0, MappingProxyType({}), graph=MappingProxyType({"paid": ()}),
        versions=MappingProxyType({"paid": "\udc80"}),
    )
    with PostgresStore(postgres_url, run_id="r") as store:
        with pytest.raises(UnencodableError, match="the version tag of step 'paid'"):
            store.prepare_run(checkpoint)
        assert store.load() is None


def test_a_codec_that_writes_a_nul_is_refused_naming_the_step(postgres_url: str) -> None:
    def raw_nul(data: Any) -> str:
        return json.dumps(data).replace("\\u0000", "\x00")

    with PostgresStore(postgres_url, run_id="r", dumps=raw_nul, loads=json.loads) as store:
        with pytest.raises(UnencodableError, match=r"step 'a' in PostgreSQL: its encoded output holds a NUL"):
            store(_cp({"a": "nul \x00 inside"}))
        assert store.load() is None


@pytest.mark.parametrize("method", ["load", "delete"])
def test_another_run_id_with_a_nul_is_a_value_error_naming_it(postgres_url: str, method: str) -> None:
    with PostgresStore(postgres_url, run_id="r") as store:
        with pytest.raises(ValueError, match=r"^run_id 'x\\x00' cannot be a PostgreSQL key"):
            getattr(store, method)("x\x00")
        with pytest.raises(ValueError, match=r"^run_id must be a string, got int"):
            getattr(store, method)(3)
