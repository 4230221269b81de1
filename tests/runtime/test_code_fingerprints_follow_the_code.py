"""A step's code fingerprint changes with its code and with nothing else (issue 45).

What users rely on: editing what a step does (its expression, a constant, a
prompt held in a module constant or an enclosing variable, a default, a helper
of the same module) changes its fingerprint, so a resume or a cache never
takes old output for new code; moving it, reformatting it or editing a comment
does not, so they are not paid again for nothing.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_runtime.fingerprints import code_fingerprint

_OPS = ("+", "-", "*", "%")
_term = st.one_of(
    st.tuples(st.just("ctx"), st.sampled_from(["a", "b", "draft"])),
    st.tuples(st.just("const"), st.one_of(st.integers(-5, 5), st.text("xyz", max_size=3))),
)
_body = st.tuples(st.sampled_from(["a", "b", "draft"]),
                  st.lists(st.tuples(st.sampled_from(_OPS), _term), max_size=4))


def _source(body: tuple[str, list[tuple[str, tuple[str, Any]]]], *, pretty: bool = False) -> str:
    first, rest = body
    expr = f"ctx[{first!r}]"
    for op, (kind, value) in rest:
        operand = f"ctx[{value!r}]" if kind == "ctx" else repr(value)
        expr = f"(  {expr}  {op}\n        {operand})" if pretty else f"({expr} {op} {operand})"
    if pretty:  # other lines, other spacing, comments: the same code
        return f"\n\n# a comment\n\ndef f(ctx):\n    # why\n    return (\n        {expr}\n    )  # done\n"
    return f"def f(ctx):\n    return {expr}\n"


def _fingerprint(source: str, filename: str = "<a>", **globals_: Any) -> str:
    namespace: dict[str, Any] = {"__name__": "steps", **globals_}
    exec(compile(source, filename, "exec"), namespace)
    return code_fingerprint(namespace["f"])


@settings(max_examples=150, deadline=None)
@given(_body, _body)
def test_a_change_in_the_code_changes_the_fingerprint_and_nothing_else_does(a: Any, b: Any) -> None:
    same = ast.dump(ast.parse(_source(a))) == ast.dump(ast.parse(_source(b)))
    assert (_fingerprint(_source(a)) == _fingerprint(_source(b))) == same


@settings(max_examples=60, deadline=None)
@given(_body)
def test_layout_comments_and_file_do_not_change_it(body: Any) -> None:
    assert _fingerprint(_source(body)) == _fingerprint(_source(body, pretty=True), "<elsewhere>")


def test_a_prompt_in_a_module_constant_is_part_of_the_step() -> None:
    source = "def f(ctx):\n    return PROMPT.format(**ctx)\n"
    assert _fingerprint(source, PROMPT="Critique {draft}") != _fingerprint(source, PROMPT="Praise {draft}")


def test_a_helper_of_the_same_module_is_part_of_the_step() -> None:
    source = "def helper(x):\n    return x + {!r}\ndef f(ctx):\n    return helper(ctx['a'])\n"
    assert _fingerprint(source.format("!")) != _fingerprint(source.format("?"))


def test_closure_values_and_defaults_are_part_of_the_step() -> None:
    def make(prompt: str) -> Any:
        def f(ctx: Any, n: int = 1) -> str:
            return prompt * n
        return f

    assert code_fingerprint(make("a")) == code_fingerprint(make("a"))
    assert code_fingerprint(make("a")) != code_fingerprint(make("b"))
    g = make("a")
    g.__defaults__ = (2,)
    assert code_fingerprint(g) != code_fingerprint(make("a"))


def test_an_object_it_cannot_see_into_counts_by_its_type_only() -> None:
    class Client:
        def __init__(self, temperature: float) -> None:
            self.temperature = temperature

    source = "def f(ctx):\n    return CLIENT.temperature\n"
    # Documented: the state of a non-plain object is invisible (docs/cache.md says what to declare).
    assert _fingerprint(source, CLIENT=Client(0.1)) == _fingerprint(source, CLIENT=Client(0.9))


def test_partials_count_their_arguments() -> None:
    def f(ctx: Any, tone: str) -> str:
        return tone

    assert code_fingerprint(functools.partial(f, tone="dry")) != code_fingerprint(
        functools.partial(f, tone="warm"))
    assert code_fingerprint(functools.partial(f, tone="dry")) == code_fingerprint(
        functools.partial(f, tone="dry"))


def test_set_constants_hash_the_same_whatever_their_order() -> None:
    source = "def f(ctx):\n    return ctx['a'] in {'x', 'y', 'zz', 'w'}\n"
    assert _fingerprint(source) == _fingerprint(source, "<other>")
