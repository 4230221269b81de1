"""A context value the codec cannot encode is an ``UnencodableError`` naming its key.

What users rely on (docs/outputs.md, docs/stores.md): a value no store can
hold is refused as an ``UnencodableError`` that names the step or the
context key at fault, before anything is written; an output of a step
already was, whatever the codec's encoding raised. A context value was
named only when its type was not registered: one that nests too deeply
(or holds itself), or whose registered encoder raised, ended the run with
a bare ``RecursionError`` or the encoder's own error, naming nothing,
where the same run without a codec named the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Codec, JsonFileStore, Step, UnencodableError, Workflow


@dataclasses.dataclass
class Opaque:
    n: int


def _raising_codec() -> Codec:
    codec = Codec()
    codec.register(Opaque, encode=lambda value: 1 // 0, decode=lambda data: Opaque(data))
    return codec


def _self_holding() -> list[Any]:
    held: list[Any] = []
    held.append(held)
    return held


CASES = {
    "holds itself": (Codec, lambda: _self_holding(), "nests too deeply"),
    "encoder raises": (_raising_codec, lambda: Opaque(1), "ZeroDivisionError"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_context_value_the_codec_cannot_encode_names_its_key(tmp_path: Path, case: str) -> None:
    codec, value, why = CASES[case]
    ran: list[str] = []

    def step(ctx: Any) -> int:
        ran.append("a")
        return 1

    wf = Workflow([Step("a", step)], codec=codec())
    with JsonFileStore(tmp_path / "cp.json") as store, pytest.raises(UnencodableError) as refused:
        wf.run_sync({"held": value()}, checkpoint_fn=store)
    assert "context key 'held'" in str(refused.value) and why in str(refused.value)
    assert refused.value.step is None and ran == []
    assert not (tmp_path / "cp.json").exists()
