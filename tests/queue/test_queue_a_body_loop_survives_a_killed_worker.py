"""A loop whose body is a child workflow, driven by queue workers, on SQLite and PostgreSQL.

What users rely on: a worker SIGKILLed in the middle of iteration 3 (inside a
tool mapped over what the model asked for) leaves the run to another worker,
which finishes it paying for no body step recorded before the kill, and the
run ends as an uninterrupted one does (every step start is appended, and
fsynced, to a side file, so the count survives the kill). A question asked
in iteration 2 parks the run, and the answer verb resumes it in iteration 2;
the queue's rewind of ``agent/tool#2`` runs it again and asks again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ekit_runtime import Done, Repeat, Step, Workflow, ask
from ekit_runtime.queue import RunQueue, Worker, open_queue
from tests.support.queue_backends import live_leases, queue, queue_url, wait_for

__all__ = ["queue", "queue_url"]

ROOT = Path(__file__).resolve().parents[2]

FLOWS = '''
import asyncio, os
from ekit_runtime import Done, Repeat, Step, Workflow

LOG = os.environ["BODY_LOG"]
HELD = os.environ["BODY_HELD"]


def started(name):
    with open(LOG, "a", encoding="utf-8") as f:
        f.write(name + "\\n")
        f.flush()
        os.fsync(f.fileno())


def plan(ctx):
    it = ctx["agent"]
    started(f"agent/plan#{it.number}")
    carried = ctx["task"] if it.previous is None else it.previous
    return [carried + it.number, carried * 2]


async def tool(ctx):
    k = ctx["agent"].number
    x = ctx["plan"]
    started(f"agent/tool#{k}[{x}]")
    if k == 3 and not os.path.exists(HELD):
        open(HELD, "w").close()
        await asyncio.Event().wait()  # until SIGKILLed
    return x + 1


def fold(ctx):
    k = ctx["agent"].number
    started(f"agent/fold#{k}")
    value = sum(ctx["tool"]) % 1000
    return Done(value) if k == 5 else value


BODY = Workflow([
    Step("plan", plan),
    Step("tool", tool, ("plan",), map_over="plan"),
    Step("fold", fold, ("tool",)),
])
WORKFLOWS = {"agent": Workflow([
    Step("task", lambda ctx: started("task") or 1),
    Step("agent", depends_on=("task",), child=BODY, repeat=Repeat(max_iterations=8)),
    Step("report", lambda ctx: started("report") or ["saw", ctx["agent"]], ("agent",)),
])}
'''


def _expected() -> int:
    carried = 1
    for k in range(1, 6):
        carried = ((carried + k) + 1 + (carried * 2) + 1) % 1000
    return carried


def _worker(tmp_path: Path, url: str, *flags: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
           "BODY_LOG": str(tmp_path / "starts.log"), "BODY_HELD": str(tmp_path / "held")}
    argv = [sys.executable, "-m", "ekit_runtime", "worker", "--queue", url, "--workflows", "flows:WORKFLOWS",
            "--lease", "1", "--heartbeat", "0.2", *flags]
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / f"stderr-{len(flags)}", "w"), text=True)


@pytest.mark.timeout(180)
def test_a_worker_killed_mid_iteration_leaves_the_loop_to_another_that_pays_for_nothing_recorded(
        queue_url: str, tmp_path: Path) -> None:
    (tmp_path / "flows.py").write_text(FLOWS)
    q = open_queue(queue_url)
    run = q.submit("agent", run_id="body-loop")
    victim = _worker(tmp_path, queue_url)
    try:
        wait_for(lambda: (tmp_path / "held").exists(), timeout=90, what="the tool of iteration 3 to start")
        # the first of iteration 3's two tool items holds; wait until the other
        # one is recorded, or not, whichever: what counts is what the store has
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    at_kill = q.checkpoint(run)
    assert at_kill is not None
    recorded = set(at_kill.outputs)
    assert {"agent/plan#3", "agent/fold#2"} <= recorded and "agent/fold#3" not in recorded
    wait_for(lambda: live_leases(queue_url) == 0, timeout=30, what="the killed worker's lease to expire")
    taker = _worker(tmp_path, queue_url, "--until-idle")
    assert taker.wait(timeout=120) == 0, (tmp_path / "stderr-1").read_text()
    info = q.status(run)
    assert info.status == "finished", info.error
    result = q.result(run)
    assert result is not None
    assert result.outputs["agent"] == _expected()
    assert result.outputs["report"] == ["saw", _expected()]
    starts = Counter((tmp_path / "starts.log").read_text().split())
    ran_again = sorted(n for n in recorded if n in starts and starts[n] != 1)
    assert ran_again == [], f"recorded body steps ran again: {ran_again}"
    # every iteration's body ran, and nothing past iteration 3 ran twice
    assert all(starts[f"agent/fold#{k}"] == 1 for k in range(1, 6)) and starts["agent/plan#6"] == 0
    q.close()


def _asking_agent(calls: list[str]) -> Workflow:
    def plan(ctx: Any) -> int:
        it = ctx["agent"]
        calls.append(f"plan#{it.number}")
        return (ctx["task"] if it.previous is None else it.previous) + it.number

    def tool(ctx: Any) -> int:
        k = ctx["agent"].number
        calls.append(f"tool#{k}")
        extra = int(ask("how much?", details={"iteration": k})) if k == 2 else 0
        return int(ctx["plan"]) + extra

    def fold(ctx: Any) -> Any:
        k = ctx["agent"].number
        calls.append(f"fold#{k}")
        return Done(ctx["tool"]) if k == 3 else ctx["tool"]

    body = Workflow([Step("plan", plan), Step("tool", tool, ("plan",)), Step("fold", fold, ("tool",))])
    return Workflow([
        Step("task", lambda ctx: 1),
        Step("agent", depends_on=("task",), child=body, repeat=Repeat(max_iterations=5)),
    ])


def test_a_question_in_iteration_2_parks_the_queued_run_and_a_rewind_asks_it_again(
        queue: RunQueue, queue_url: str) -> None:
    calls: list[str] = []
    workflows = {"agent": _asking_agent(calls)}
    run = queue.submit("agent", run_id="asks")
    assert asyncio.run(Worker(queue, workflows, poll=0.01).run_until_idle()) == 1
    assert queue.status(run).status == "waiting", queue.status(run).error
    assert list(queue.questions(run)) == ["agent/tool#2"]
    assert live_leases(queue_url) == 0
    assert calls == ["plan#1", "tool#1", "fold#1", "plan#2", "tool#2"]
    calls.clear()
    queue.answer(run, "agent/tool#2", 100)
    assert asyncio.run(Worker(queue, workflows, poll=0.01).run_until_idle()) == 1
    assert queue.status(run).status == "finished", queue.status(run).error
    assert calls == ["tool#2", "fold#2", "plan#3", "tool#3", "fold#3"]  # in iteration 2, where it asked
    result = queue.result(run)
    assert result is not None and result.outputs["agent"] == 1 + 1 + 2 + 100 + 3
    calls.clear()
    rewound = queue.rewind(run, "agent/tool#2")
    assert "agent/plan#2" in rewound.outputs and "agent/tool#2" not in rewound.outputs
    assert asyncio.run(Worker(queue, workflows, poll=0.01).run_until_idle()) == 1
    assert calls == ["tool#2"] and list(queue.questions(run)) == ["agent/tool#2"]  # asked again
    queue.answer(run, "agent/tool#2", 7)
    assert asyncio.run(Worker(queue, workflows, poll=0.01).run_until_idle()) == 1
    result = queue.result(run)
    assert result is not None and result.outputs["agent"] == 1 + 1 + 2 + 7 + 3
