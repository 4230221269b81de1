"""A ReAct-style agent loop, ekit against LangGraph with its SQLite checkpointer.

    python -m benchmarks.agent_loop [--sizes 10,100,1000] [--crash-at 5] [--json PATH]

Both run the same scripted stand-in model (:func:`model`): turn ``t`` asks for
one tool call until the last turn, which answers; each tool result is a fixed
100 bytes. ekit runs the loop as ``Step("agent", turn, repeat=Repeat(...))``,
one iteration = one model call plus its tool calls, returning the conversation so
far (as the recipe in docs/recipes.md does); LangGraph runs the usual two-node
graph (``model`` -> ``tools`` -> ``model``, messages under an ``operator.add``
reducer) with ``SqliteSaver``. Measured:

- **bytes stored** after ``n`` iterations: ekit's largest checkpoint as
  ``JsonFileStore`` writes it (it holds only the latest) (with ``keep_last=1``, and with every iteration kept
  up to 100 iterations: each iteration's output is the whole conversation, so that
  grows quadratically); LangGraph's SQLite file (every superstep's checkpoint, as
  its saver keeps them).
- **calls paid again** by a resume after a crash in the tools of turn ``k``: model
  calls made for a turn already answered before the crash.

The LangGraph rows need ``pip install langgraph langgraph-checkpoint-sqlite``
(in a separate environment: it is not a dependency of ekit); without it they
are skipped with a message and the run exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sqlite3
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ekit_runtime import Done, Repeat, Step, Workflow

TOOL_RESULT = "x" * 100
TASK = {"role": "user", "content": "find the answer"}


class Crash(Exception):
    """The process dies here (its last checkpoint is what survives)."""


class Model:
    """The scripted stand-in: answers at turn ``turns``; counts the calls per turn."""

    def __init__(self, turns: int, crash_at: int | None = None) -> None:
        self.turns, self.crash_at, self.calls = turns, crash_at, Counter[int]()

    def __call__(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        turn = 1 + sum(m["role"] == "assistant" for m in messages)
        self.calls[turn] += 1
        if turn == self.turns:
            return {"role": "assistant", "content": f"done after {turn} turns"}
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"call_{turn}", "type": "function",
             "function": {"name": "lookup", "arguments": json.dumps({"turn": turn})}}]}

    def tools(self, reply: dict[str, Any]) -> list[dict[str, Any]]:
        turn = int(reply["tool_calls"][0]["id"][5:])
        if turn == self.crash_at:
            self.crash_at = None  # once: the resumed process does not crash
            raise Crash(f"crashed in the tools of turn {turn}")
        return [{"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT}
                for c in reply["tool_calls"]]

    def paid_again(self, upto: int) -> tuple[int, int]:
        """Calls made again for turns answered before the crash in turn ``upto``, and for
        turn ``upto`` itself (its model call had answered; its tools had not)."""
        return (sum(n - 1 for t, n in self.calls.items() if t < upto), self.calls[upto] - 1)


def ekit_agent(model: Model, keep_last: int | None) -> Workflow:
    def turn(ctx: dict[str, Any]) -> Any:
        messages = list(ctx["agent"].previous or [TASK])
        reply = model(messages)
        if "tool_calls" not in reply:
            return Done(reply["content"])
        return [*messages, reply, *model.tools(reply)]

    return Workflow([Step("agent", turn, repeat=Repeat(max_iterations=model.turns,
                                                        keep_last=keep_last))])


def ekit_bytes(n: int, keep_last: int | None) -> int:
    """The largest checkpoint (JSON, as ``JsonFileStore`` writes it) of a run of ``n``
    iterations: the one before the answer, which holds the whole conversation."""
    largest = 0

    def save(checkpoint: Any) -> None:
        nonlocal largest
        largest = max(largest, len(json.dumps(checkpoint.to_dict()).encode()))

    ekit_agent(Model(n), keep_last).run_sync(checkpoint_fn=save)
    return largest


def ekit_paid_again(n: int, crash_at: int) -> tuple[int, int]:
    model, saved = Model(n, crash_at), list[Any]()
    workflow = ekit_agent(model, keep_last=1)
    with contextlib.suppress(Exception):  # the Crash, as the run reports it
        workflow.run_sync(checkpoint_fn=saved.append)
    last = json.loads(json.dumps(saved[-1].to_dict()))  # what a JSON store would hold
    result = workflow.run_sync(resume_from=last)
    assert result.outputs["agent"] == f"done after {n} turns"
    return model.paid_again(crash_at)


def langgraph_graph(model: Model, saver: Any) -> Any:
    import operator
    from typing import Annotated, TypedDict

    from langgraph.graph import END, START, StateGraph

    # (The functional form: this module's string annotations would not resolve here.)
    State = TypedDict("State", {"messages": Annotated[list[dict[str, Any]], operator.add]})  # noqa: UP013

    def call_model(state: Any) -> dict[str, Any]:
        return {"messages": [model(state["messages"])]}

    def run_tools(state: Any) -> dict[str, Any]:
        return {"messages": model.tools(state["messages"][-1])}

    def route(state: Any) -> str:
        return "tools" if "tool_calls" in state["messages"][-1] else END

    graph = StateGraph(State)
    graph.add_node("model", call_model)
    graph.add_node("tools", run_tools)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route)
    graph.add_edge("tools", "model")
    return graph.compile(checkpointer=saver)


def langgraph_run(n: int, folder: Path, crash_at: int | None = None) -> tuple[int, tuple[int, int]]:
    """Bytes of the SQLite file after ``n`` iterations, and calls paid again by a resume."""
    from langgraph.checkpoint.sqlite import SqliteSaver

    path = folder / f"langgraph-{n}-{crash_at}.sqlite"
    connection = sqlite3.connect(path, check_same_thread=False)
    model = Model(n, crash_at)
    graph = langgraph_graph(model, SqliteSaver(connection))
    config = {"configurable": {"thread_id": "agent"}, "recursion_limit": 2 * n + 10}
    try:
        out = graph.invoke({"messages": [TASK]}, config)
    except Crash:
        out = graph.invoke(None, config)  # resume from its last checkpoint
    assert out["messages"][-1]["content"] == f"done after {n} turns"
    connection.commit()
    connection.close()
    return path.stat().st_size, model.paid_again(crash_at) if crash_at else (0, 0)


_COUNT = """
import asyncio, gc, sys
from ekit_runtime import Done, Repeat, Step, Workflow
shape, n = sys.argv[1], int(sys.argv[2])
async def noop(ctx):
    return 1
async def turn(ctx):
    return Done(1) if ctx["loop"].number == n else 1
steps = ([Step("loop", turn, repeat=Repeat(max_iterations=n))] if shape == "loop"
         else [Step(f"s{i}", noop, (f"s{i - 1}",) if i else ()) for i in range(n)])
gc.freeze()
asyncio.run(Workflow(steps).run(checkpoint_fn=[].append))
"""


def _count(shape: str, n: int) -> int:
    """Instructions of a process running ``shape`` (a loop, or a chain) at size ``n``."""
    import re
    import subprocess

    env = {"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", ""),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(["setarch", "-R", "valgrind", "--tool=callgrind",
                           "--callgrind-out-file=/dev/null", sys.executable, "-c", _COUNT, shape, str(n)],
                          env=env, capture_output=True, text=True, check=True)
    return int(re.findall(r"Collected : (\d+)", done.stderr)[-1])


def instructions(small: int = 200, big: int = 600) -> dict[str, Any]:
    """``(I_big - I_small) / (big - small)`` for a loop's iterations and a chain's steps,
    as :mod:`benchmarks.instructions` counts its workloads (no-op bodies, checkpoints to
    ``list.append``, default settings): start-up and imports cancel out."""
    import subprocess

    for shape in ("loop", "chain"):  # byte-compile first: else the first count pays for it
        subprocess.run([sys.executable, "-c", _COUNT, shape, "2"], check=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    per = {shape: (_count(shape, big) - _count(shape, small)) / (big - small) for shape in ("loop", "chain")}
    return {"iteration": per["loop"], "chain_step": per["chain"], "ratio": per["loop"] / per["chain"],
            "sizes": [small, big]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--crash-at", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--instructions", action="store_true",
                        help="also count instructions per iteration vs per chain step (callgrind)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    lg = importlib.util.find_spec("langgraph") is not None and \
        importlib.util.find_spec("langgraph.checkpoint.sqlite") is not None
    rows: dict[str, Any] = {"bytes": {}, "paid_again": {}}
    print(f"{'iterations':>10} {'ekit keep_last=1':>17} {'ekit all kept':>14} {'langgraph sqlite':>17}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            row = {"ekit_keep_last_1": ekit_bytes(n, 1),
                   "ekit_all_kept": ekit_bytes(n, None) if n <= 100 else None,
                   "langgraph_sqlite": langgraph_run(n, Path(tmp))[0] if lg else None}
            rows["bytes"][n] = row
            print(f"{n:>10} {row['ekit_keep_last_1']:>17,} "
                  f"{row['ekit_all_kept'] or 'skipped':>14} {row['langgraph_sqlite'] or 'skipped':>17}")
        n, k = max(sizes[0], args.crash_at + 2), args.crash_at
        rows["paid_again"] = {"iterations": n, "crash_in_tools_of_turn": k,
                              "ekit": ekit_paid_again(n, k),
                              "langgraph": langgraph_run(n, Path(tmp), k)[1] if lg else None}
    again = rows["paid_again"]
    print(f"model calls made again by a resume after a crash in turn {k}'s tools "
          f"(turns before it, turn {k}): ekit {again['ekit']}, langgraph {again['langgraph']}")
    if args.instructions:
        rows["instructions"] = instructions()
        print("instructions per loop iteration / per chain step (callgrind, no-op bodies): "
              f"{rows['instructions']['iteration']:,.0f} / {rows['instructions']['chain_step']:,.0f}"
              f" = {rows['instructions']['ratio']:.2f}x")
    if not lg:
        print("langgraph rows skipped: pip install langgraph langgraph-checkpoint-sqlite "
              "(in an environment of its own) to compare")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
