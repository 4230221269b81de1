"""A step asks a person for a value or an approval: the run parks, and resumes with the answer.

What users rely on: a step that asks waits (nothing that needs it starts,
the rest runs, the run raises ``RunWaiting`` with the questions after its
final save); a resume without the answer never runs the step again; a
resume with it runs the step again and hands it the answer; a denial ends
the run denied without running the step; bad answers are refused before
any step runs; the questions and answers are in the checkpoint, survive the
stores, and ``audit`` shows who answered what.
"""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ekit_core import (
    Answer,
    CheckpointError,
    Event,
    Question,
    RunSettled,
    StepWaiting,
    WorkflowCheckpoint,
    answer,
    audit,
    questions,
    replay,
    rewind,
)
from ekit_runtime import (
    ApprovalDenied,
    Attempt,
    Executor,
    InputRequired,
    JournalStore,
    JsonFileStore,
    ProgressPrinter,
    RetryPolicy,
    RunHalted,
    RunWaiting,
    SqliteStore,
    Step,
    Workflow,
    approve,
    ask,
)

ran: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    ran.clear()


async def fetch(context: dict[str, Any]) -> str:
    ran["fetch"] += 1
    return "report"


async def name_it(context: dict[str, Any]) -> str:
    ran["name_it"] += 1
    title = ask("What title?", details={"draft": context["fetch"]})
    return f"{title}: {context['fetch']}"


def pay(context: dict[str, Any]) -> str:  # a sync step: it runs in a thread
    ran["pay"] += 1
    approve("Spend $3 on the paid call?", details={"usd": 3})
    ran["paid"] += 1
    return f"paid for {context['name_it']}"


async def other(context: dict[str, Any]) -> int:
    ran["other"] += 1
    return 7


def workflow() -> Workflow:
    return Workflow([
        Step("fetch", fetch),
        Step("name_it", name_it, depends_on=("fetch",)),
        Step("pay", pay, depends_on=("name_it",)),
        Step("other", other),
    ])


async def waiting(wf: Workflow, **options: Any) -> RunWaiting:
    with pytest.raises(RunWaiting) as caught:
        await wf.run(**options)
    return caught.value


def test_a_value_question_parks_the_run_and_the_answer_resumes_it() -> None:
    async def main() -> None:
        wf = workflow()
        parked = await waiting(wf)
        assert isinstance(parked, RunHalted)
        assert dict(parked.questions) == {
            "name_it": Question("value", "What title?", {"draft": "report"})}
        # Its dependents did not start; the independent step ran.
        assert ran == Counter(fetch=1, name_it=1, other=1)
        assert set(parked.checkpoint.outputs) == {"fetch", "other"}
        assert parked.checkpoint.format_version == 3
        assert "name_it" in str(parked) and "What title?" in str(parked)

        # Resumed without an answer: nothing runs again, it still waits.
        again = await waiting(wf, resume_from=parked.checkpoint)
        assert ran == Counter(fetch=1, name_it=1, other=1)
        assert dict(again.questions) == dict(parked.questions)

        # With the answer: the step runs again and gets it; the next one asks.
        second = await waiting(wf, resume_from=parked.checkpoint,
                               answers={"name_it": Answer("Tides", by="ann", at="2026-12-02T03:00Z")})
        assert second.checkpoint.outputs["name_it"] == "Tides: report"
        assert dict(second.questions) == {
            "pay": Question("approval", "Spend $3 on the paid call?", {"usd": 3})}
        assert ran == Counter(fetch=1, name_it=2, other=1, pay=1)

        result = await wf.run(resume_from=second.checkpoint,
                              answers={"pay": Answer.approve(by="boss")})
        assert result.outputs["pay"] == "paid for Tides: report"
        assert ran["paid"] == 1 and ran["pay"] == 2 and ran["name_it"] == 2
        # The answers stay in the checkpoint, for audit.
        assert result.checkpoint is not None
        asked = result.checkpoint.asked
        assert asked["name_it"][0].answer == Answer("Tides", by="ann", at="2026-12-02T03:00Z")
        assert asked["pay"][0].answer == Answer.approve(by="boss")
        assert not questions(result.checkpoint)

    asyncio.run(main())


def test_a_plain_value_answers_a_value_question() -> None:
    async def main() -> None:
        wf = Workflow([Step("fetch", fetch), Step("name_it", name_it, depends_on=("fetch",))])
        parked = await waiting(wf)
        result = await wf.run(resume_from=parked.checkpoint, answers={"name_it": "Plain"})
        assert result.outputs["name_it"] == "Plain: report"
        assert result.checkpoint is not None
        assert result.checkpoint.asked["name_it"][0].answer == Answer("Plain")

    asyncio.run(main())


def test_a_denial_ends_the_run_denied_without_running_the_step_again() -> None:
    async def main() -> None:
        wf = workflow()
        parked = await waiting(wf)
        second = await waiting(wf, resume_from=parked.checkpoint, answers={"name_it": "T"})
        saved: list[WorkflowCheckpoint] = []
        with pytest.raises(ApprovalDenied) as caught:
            await wf.run(resume_from=second.checkpoint, checkpoint_fn=saved.append,
                         answers={"pay": Answer.deny("too expensive", by="boss")})
        denied = caught.value
        assert denied.step == "pay" and denied.reason == "too expensive"
        assert ran["pay"] == 1 and ran["paid"] == 0
        # The denial was saved before the run ended, and a resume is denied again, at once.
        assert saved and saved[-1].asked["pay"][0].answer == Answer.deny("too expensive", by="boss")
        with pytest.raises(ApprovalDenied):
            await wf.run(resume_from=saved[-1])
        assert ran["pay"] == 1
        # Rewinding the step drops the denial: it asks again.
        rewound = rewind(wf, saved[-1], "pay")
        assert "pay" not in rewound.asked and "name_it" in rewound.asked
        third = await waiting(wf, resume_from=rewound)
        assert set(third.questions) == {"pay"} and ran["pay"] == 2

    asyncio.run(main())


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ({"fetch": "x"}, "step 'fetch' has no pending question; steps waiting: 'name_it'"),
        ({"nope": "x"}, "step 'nope' has no pending question"),
        ({"name_it": Answer.approve(by="x")}, "asks for a value"),
        ({1: "x"}, "answers keys must be step names"),
    ],
)
def test_bad_answers_are_refused_before_any_step_runs(answers: Any, message: str) -> None:
    async def main() -> None:
        wf = workflow()
        parked = await waiting(wf)
        ran.clear()
        saved: list[WorkflowCheckpoint] = []
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            await wf.run(resume_from=parked.checkpoint, answers=answers, checkpoint_fn=saved.append)
        assert not ran and not saved

    asyncio.run(main())


def test_an_approval_needs_approve_or_deny_and_answers_need_a_waiting_run() -> None:
    async def main() -> None:
        wf = workflow()
        parked = await waiting(wf)
        second = await waiting(wf, resume_from=parked.checkpoint, answers={"name_it": "T"})
        ran.clear()
        for plain in (True, "yes"):
            with pytest.raises(ValueError, match=r"asks for an approval: answer with Answer\.approve"):
                await wf.run(resume_from=second.checkpoint, answers={"pay": plain})
        with pytest.raises(ValueError, match="step 'pay' has no pending question; no step is waiting"):
            await wf.run(answers={"pay": Answer.approve()})
        with pytest.raises(ValueError, match="answers must be a mapping"):
            await wf.run(resume_from=second.checkpoint, answers=[("pay", True)])  # type: ignore[typeddict-item]
        assert not ran

    asyncio.run(main())


def test_a_branch_runs_on_while_another_waits() -> None:
    parked_seen = asyncio.Event()
    order: list[str] = []

    async def asks(context: dict[str, Any]) -> str:
        order.append("asks")
        return str(ask("Go?"))

    async def slow(context: dict[str, Any]) -> str:
        await asyncio.wait_for(parked_seen.wait(), 30)  # runs on after the other step waits
        order.append("slow")
        return "slow"

    async def after(context: dict[str, Any]) -> str:
        order.append("after")
        return context["slow"] + "+"

    def trace(event: Event) -> None:
        if isinstance(event, StepWaiting):
            order.append(f"waiting {event.name}")
            parked_seen.set()

    async def main() -> None:
        wf = Workflow([Step("asks", asks), Step("slow", slow), Step("after", after, depends_on=("slow",)),
                       Step("needs", after, depends_on=("asks",))])
        parked = await waiting(wf, trace=trace)
        assert order == ["asks", "waiting asks", "slow", "after"]
        assert set(parked.checkpoint.outputs) == {"slow", "after"}
        result = await wf.run(resume_from=parked.checkpoint, answers={"asks": "yes"})
        assert result.outputs["asks"] == "yes"

    asyncio.run(main())


def test_an_item_of_a_mapped_step_asks_and_the_others_finish() -> None:
    async def split(context: dict[str, Any]) -> list[int]:
        return [1, 2, 3]

    def check(context: dict[str, Any]) -> str:
        ran[f"check {context['split']}"] += 1
        if context["split"] == 2:
            return f"2 by {ask('Is 2 fine?', details={'item': 2})}"
        return str(context["split"])

    async def main() -> None:
        wf = Workflow([Step("split", split), Step("check", check, depends_on=("split",), map_over="split"),
                       Step("total", lambda c: "|".join(c["check"]), depends_on=("check",))])
        parked = await waiting(wf)
        assert dict(parked.questions) == {"check[1]": Question("value", "Is 2 fine?", {"item": 2})}
        assert {"check[0]", "check[2]"} <= set(parked.checkpoint.outputs)
        assert "check" not in parked.checkpoint.outputs and "total" not in parked.checkpoint.outputs
        again = await waiting(wf, resume_from=parked.checkpoint)
        assert set(again.questions) == {"check[1]"}
        result = await wf.run(resume_from=parked.checkpoint, answers={"check[1]": Answer("ann", by="ann")})
        assert result.outputs["total"] == "1|2 by ann|3"
        assert ran == Counter({"check 1": 1, "check 2": 2, "check 3": 1})

    asyncio.run(main())


def test_a_step_that_asks_twice_gets_each_answer_in_order() -> None:
    async def two(context: dict[str, Any]) -> str:
        ran["two"] += 1
        first = ask("first?")
        approve("go on?")
        second = ask("second?")
        return f"{first}-{second}"

    async def main() -> None:
        wf = Workflow([Step("two", two)])
        p1 = await waiting(wf)
        p2 = await waiting(wf, resume_from=p1.checkpoint, answers={"two": "a"})
        assert p2.questions["two"] == Question("approval", "go on?")
        p3 = await waiting(wf, resume_from=p2.checkpoint, answers={"two": Answer.approve(by="b")})
        assert p3.questions["two"] == Question("value", "second?")
        result = await wf.run(resume_from=p3.checkpoint, answers={"two": Answer("c", by="c")})
        assert result.outputs["two"] == "a-c" and ran["two"] == 4
        assert result.checkpoint is not None
        assert [e.question.prompt for e in result.checkpoint.asked["two"]] == [
            "first?", "go on?", "second?"]

    asyncio.run(main())


def test_a_retry_policy_never_retries_a_question() -> None:
    async def asks(context: dict[str, Any]) -> str:
        ran["asks"] += 1
        return str(ask("?"))

    async def main() -> None:
        policy = RetryPolicy(max_attempts=5, backoff_base=0, retry_on=(Exception,))
        wf = Workflow([Step("asks", asks, retry=policy)])
        parked = await waiting(wf)
        assert ran["asks"] == 1 and not parked.checkpoint.failures

    asyncio.run(main())


def test_a_step_swallowing_the_question_is_the_documented_pitfall() -> None:
    # InputRequired derives from Exception: a bare `except Exception` hides it.
    assert issubclass(InputRequired, Exception)

    async def swallows(context: dict[str, Any]) -> str:
        try:
            return str(ask("?"))
        except Exception:
            return "swallowed"

    result = Workflow([Step("s", swallows)]).run_sync()
    assert result.outputs["s"] == "swallowed"


def test_iterate_raises_run_waiting_too() -> None:
    async def main() -> None:
        wf = workflow()
        with pytest.raises(RunWaiting) as caught:
            async for _ in wf.iterate():
                pass
        assert set(caught.value.questions) == {"name_it"}

    asyncio.run(main())


def test_trace_and_progress_show_the_waiting_step() -> None:
    events: list[Event] = []
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=False, tick=None)

    async def main() -> None:
        wf = workflow()
        parked = await waiting(wf, trace=[events.append, printer])
        waits = [e for e in events if isinstance(e, StepWaiting)]
        assert waits == [StepWaiting("name_it", parked.questions["name_it"], 1)]
        assert isinstance(events[-1], RunSettled) and events[-1].outcome == "waiting"
        # A resume announces the questions still waiting.
        events.clear()
        await waiting(wf, resume_from=parked.checkpoint, trace=events.append)
        assert [e.name for e in events if isinstance(e, StepWaiting)] == ["name_it"]

    asyncio.run(main())
    text = out.getvalue()
    assert "WAITING name_it for an answer: What title?" in text
    assert "run waiting:" in text and "1 waiting for an answer" in text


@pytest.mark.parametrize("kind", ["json", "journal", "sqlite"])
def test_questions_and_answers_survive_a_store(tmp_path: Path, kind: str) -> None:
    def store_at() -> Any:
        if kind == "json":
            return JsonFileStore(tmp_path / "cp.json")
        if kind == "journal":
            return JournalStore(tmp_path / "cp.jsonl")
        return SqliteStore(tmp_path / "cp.db", run_id="r")

    def load() -> WorkflowCheckpoint:
        with store_at() as store:
            loaded = store.load()
        assert loaded is not None
        return loaded

    async def main() -> None:
        wf = workflow()
        with store_at() as store:
            parked = await waiting(wf, checkpoint_fn=store)
        loaded = load()
        assert loaded == parked.checkpoint and questions(loaded) == parked.questions
        with store_at() as store:
            second = await waiting(wf, resume_from=store.load(), checkpoint_fn=store,
                                   answers={"name_it": Answer("T", by="ann", at=1764644400.5)})
        loaded = load()
        assert loaded == second.checkpoint
        assert loaded.asked["name_it"][0].answer == Answer("T", by="ann", at=1764644400.5)
        with store_at() as store:
            await wf.run(resume_from=store.load(), checkpoint_fn=store,
                         answers={"pay": Answer.approve(by="boss")})
        final = load()
        assert final.outputs["pay"] == "paid for T: report"
        assert final.asked["pay"][0].answer == Answer.approve(by="boss")
        assert ran["name_it"] == 2 and ran["pay"] == 2

    asyncio.run(main())


def test_the_checkpoint_records_questions_as_json_and_reads_them_back() -> None:
    async def main() -> WorkflowCheckpoint:
        parked = await waiting(workflow())
        return answer(parked.checkpoint, "name_it", Answer("T", by="ann"))

    cp = asyncio.run(main())
    data = json.loads(json.dumps(cp.to_dict()))
    assert data["format_version"] == 3
    assert data["asked"] == {"name_it": [{
        "kind": "value", "prompt": "What title?", "details": {"draft": "report"},
        "answer": {"by": "ann", "value": "T"}}]}
    assert WorkflowCheckpoint.from_dict(data) == cp
    # A run that never asks writes what it always did.
    plain = Workflow([Step("fetch", fetch)]).run_sync().checkpoint
    assert plain is not None and "asked" not in plain.to_dict() and plain.format_version == 1


def _bad(data: dict[str, Any], change: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(data))
    change(data)
    return data


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d.update(asked=[]), "asked"),
        (lambda d: d["asked"].update(name_it=[]), "asked.name_it"),
        (lambda d: d["asked"]["name_it"][0].update(kind="maybe"), "asked.name_it[0].kind"),
        (lambda d: d["asked"]["name_it"][0].update(prompt=3), "asked.name_it[0].prompt"),
        (lambda d: d["asked"]["name_it"][0].update(colour="red"), "asked.name_it[0].colour"),
        (lambda d: d["asked"]["name_it"][0].update(answer={"by": 3}), "asked.name_it[0].answer"),
        (lambda d: d["asked"]["name_it"][0].update(answer={"approved": True}),
         "asked.name_it[0].answer.approved"),
        (lambda d: d["asked"]["name_it"].append(dict(d["asked"]["name_it"][0])), "asked.name_it[0]"),
        (lambda d: d["asked"].update({"pay": [{"kind": "approval", "prompt": "?",
                                               "answer": {"value": 1}}]}),
         "asked.pay[0].answer.approved"),
        (lambda d: d.update(format_version=4), "format_version"),
    ],
)
def test_loading_refuses_a_malformed_question_naming_the_field(change: Any, field: str) -> None:
    parked = asyncio.run(waiting(workflow()))
    data = _bad(parked.checkpoint.to_dict(), change)
    with pytest.raises(CheckpointError) as caught:
        WorkflowCheckpoint.from_dict(data)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["asked"].update(ghost=[{"kind": "value", "prompt": "?"}]), "no step of this run"),
        (lambda d: d["asked"].update(fetch=[{"kind": "value", "prompt": "?"}]), "and its output too"),
        (lambda d: d["asked"].update(pay=[{"kind": "value", "prompt": "?"}]), "which it needs"),
    ],
)
def test_a_resume_refuses_questions_its_record_contradicts(change: Any, message: str) -> None:
    parked = asyncio.run(waiting(workflow()))
    data = _bad(parked.checkpoint.to_dict(), change)
    ran.clear()
    with pytest.raises(CheckpointError, match=message):
        workflow().run_sync(resume_from=data)
    assert not ran


def test_audit_shows_who_answered_what() -> None:
    async def main() -> WorkflowCheckpoint:
        wf = workflow()
        parked = await waiting(wf)
        second = await waiting(wf, resume_from=parked.checkpoint,
                               answers={"name_it": Answer("T", by="ann", at="03:00")})
        return second.checkpoint

    cp = asyncio.run(main())
    report = audit(workflow(), cp)
    steps = {s.name: s for s in report.steps}
    assert (steps["pay"].action, steps["pay"].reason) == ("wait", "asked")
    assert (steps["name_it"].action, steps["name_it"].reason) == ("skip", "recorded")
    assert report.waiting == ("pay",) and "pay" not in report.to_run
    assert [(e.question.prompt, e.answer) for e in steps["name_it"].asked] == [
        ("What title?", Answer("T", by="ann", at="03:00"))]
    text = report.format()
    assert "waits for a person's answer to question 1: 'Spend $3 on the paid call?'" in text
    assert "question 1 ('What title?') answered by ann at 03:00: 'T'" in text
    assert report.to_dict()["wait"] == ["pay"]


class Elsewhere(Executor):
    """Runs a sync step in a fresh context, as another process would: no answers there."""

    async def run(self, attempt: Attempt) -> Any:
        return await asyncio.to_thread(contextvars.Context().run, attempt.step.run, attempt.context)


def test_an_executor_that_cannot_carry_answers_fails_the_step_saying_so() -> None:
    def asks(context: dict[str, Any]) -> str:
        return str(ask("?"))

    async def main() -> None:
        wf = Workflow([Step("asks", asks)])
        parked = await waiting(wf, executor=Elsewhere())  # a first question travels back
        with pytest.raises(RuntimeError, match="executor=LocalExecutor"):
            await wf.run(resume_from=parked.checkpoint, executor=Elsewhere(), answers={"asks": "x"})

    asyncio.run(main())


def test_ask_refuses_details_that_are_not_json() -> None:
    def asks(context: dict[str, Any]) -> str:
        return str(ask("?", details={"when": object()}))

    with pytest.raises(TypeError, match="JSON data"):
        Workflow([Step("asks", asks)]).run_sync()


def test_ask_outside_a_step_raises_input_required() -> None:
    with pytest.raises(InputRequired) as caught:
        ask("anyone?")
    assert caught.value.question == Question("value", "anyone?") and caught.value.number == 1


def test_replay_of_a_parked_and_answered_run_is_legal_and_tells_who_answered() -> None:
    saved: list[WorkflowCheckpoint] = []

    async def main() -> None:
        wf = workflow()
        parked = await waiting(wf, checkpoint_fn=saved.append, max_concurrency=1)
        second = await waiting(wf, resume_from=parked.checkpoint, checkpoint_fn=saved.append,
                               answers={"name_it": Answer("T", by="ann")})
        await wf.run(resume_from=second.checkpoint, checkpoint_fn=saved.append,
                     answers={"pay": Answer.approve(by="boss", at=5)})

    asyncio.run(main())
    report = replay(workflow(), saved)
    assert report.ok, report.format()
    asked = {n: p for e in report.timeline for n, p in e.asked.items()}
    answered = {n: a for e in report.timeline for n, a in e.answered.items()}
    assert asked == {"name_it": "What title?", "pay": "Spend $3 on the paid call?"}
    assert answered == {"name_it": "'T' by ann", "pay": "approved by boss at 1970-01-01T00:00:05Z"}
    text = report.format()
    assert "answered: pay (approved by boss at 1970-01-01T00:00:05Z)" in text
    assert "waits for an answer: name_it ('What title?')" in text
    # The save a question makes is progress, not a repeat: no resume is invented inside a run.
    assert not any(e.repeat for e in report.timeline)


def test_a_changed_step_upstream_of_a_waiting_one_asks_it_again() -> None:
    async def main() -> None:
        parked = await waiting(workflow())
        second = await waiting(workflow(), resume_from=parked.checkpoint, answers={"name_it": "T"})
        assert set(second.questions) == {"pay"}
        # fetch's code changed (its version): it runs again, and what asked below it asks again.
        bumped = Workflow([
            Step("fetch", fetch, version="2"),
            Step("name_it", name_it, depends_on=("fetch",)),
            Step("pay", pay, depends_on=("name_it",)),
            Step("other", other),
        ])
        ran.clear()
        again = await waiting(bumped, resume_from=second.checkpoint)
        assert set(again.questions) == {"name_it"} and "pay" not in again.checkpoint.asked
        assert ran == Counter(fetch=1, name_it=1)

    asyncio.run(main())


def test_opentelemetry_ends_a_waiting_step_s_span_and_a_parked_run_is_no_error() -> None:
    from ekit_runtime import OtelTracer
    from tests.support.fake_tracer import FakeTracer

    tracer = FakeTracer()
    with pytest.raises(RunWaiting):
        Workflow([Step("fetch", fetch), Step("name_it", name_it, depends_on=("fetch",))]).run_sync(
            trace=OtelTracer(tracer))
    run, *steps = tracer.spans
    assert run.attributes["ekit.outcome"] == "waiting" and "status" not in run.attributes
    asking = next(s for s in steps if s.name == "ekit.step name_it")
    assert asking.ended == 1 and asking.attributes["ekit.outcome"] == "waiting"
