"""A step's fingerprint sees the code of its own module that the step reaches through what it holds.

What users rely on (docs/cache.md, "What a fingerprint covers"): editing the
code of a function or class of the step's module that the step runs changes
its fingerprint, so a resume or a cache never takes old output for new code.
These are the ways a step reaches such code other than by a global name: a
bound method's other methods, a property, a base class, a callable object's
class, an object of a class of the module, and a function a decorator (of
another module, without ``functools.wraps``) holds in its closure.
"""

from __future__ import annotations

from typing import Any

from ekit_runtime.fingerprints import code_fingerprint

_DECORATOR = '''
def plain(fn):
    def wrapper(ctx):
        return fn(ctx)
    return wrapper
'''


def _namespace(source: str, **globals_: Any) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "steps", **globals_}
    exec(compile(source, "<steps>", "exec", dont_inherit=True), namespace)
    return namespace


def _differ(source: str, pick: Any, old: str = "'A'", new: str = "'B'") -> bool:
    assert old in source
    first = code_fingerprint(pick(_namespace(source)))
    return first != code_fingerprint(pick(_namespace(source.replace(old, new))))


def test_a_bound_method_sees_the_other_methods_it_calls() -> None:
    source = "class Critic:\n    def prompt(self):\n        return 'A'\n" \
             "    def run(self, ctx):\n        return self.prompt() + ctx['draft']\n"
    assert _differ(source, lambda ns: ns["Critic"]().run)


def test_a_property_the_step_reads_is_part_of_it() -> None:
    source = "class Critic:\n    @property\n    def tone(self):\n        return 'A'\n" \
             "    def run(self, ctx):\n        return self.tone + ctx['draft']\n"
    assert _differ(source, lambda ns: ns["Critic"]().run)


def test_a_callable_object_sees_its_base_class() -> None:
    source = "class Base:\n    def prompt(self):\n        return 'A'\n" \
             "class Critic(Base):\n    def __call__(self, ctx):\n        return self.prompt()\n"
    assert _differ(source, lambda ns: ns["Critic"]())


def test_an_object_of_the_module_the_step_names_is_seen_by_its_class() -> None:
    source = "class Critic:\n    def run(self, text):\n        return 'A' + text\n" \
             "critic = Critic()\n" \
             "def step(ctx):\n    return critic.run(ctx['draft'])\n"
    assert _differ(source, lambda ns: ns["step"])


def test_a_function_a_decorator_of_another_module_holds_is_seen() -> None:
    lib: dict[str, Any] = {"__name__": "lib"}
    exec(compile(_DECORATOR, "<lib>", "exec"), lib)
    source = "@plain\ndef step(ctx):\n    return 'A' + ctx['draft']\n"
    first = code_fingerprint(_namespace(source, plain=lib["plain"])["step"])
    second = code_fingerprint(_namespace(source.replace("'A'", "'B'"), plain=lib["plain"])["step"])
    assert first != second


def test_the_same_code_keeps_its_fingerprint() -> None:
    source = "class Base:\n    def prompt(self):\n        return 'A'\n" \
             "class Critic(Base):\n    @property\n    def tone(self):\n        return 'A'\n" \
             "    def __call__(self, ctx):\n        return self.prompt() + self.tone\n" \
             "critic = Critic()\n" \
             "def step(ctx):\n    return critic(ctx)\n"
    assert code_fingerprint(_namespace(source)["step"]) == code_fingerprint(_namespace(source)["step"])
    assert code_fingerprint(_namespace(source)["Critic"]()) == \
        code_fingerprint(_namespace(source)["Critic"]())


def test_where_the_module_lives_is_not_part_of_the_fingerprint() -> None:
    # A step that finds its prompt file beside its module names __file__: two checkouts of the
    # same code (two hosts of a fleet, a resume elsewhere) must agree on its fingerprint.
    source = "import os\ndef step(ctx):\n    return os.path.dirname(__file__) + __name__ + ctx['x']\n"
    here = _namespace(source, __file__="/home/a/project/steps.py")
    there = _namespace(source, __file__="/srv/b/checkout/steps.py")
    assert code_fingerprint(here["step"]) == code_fingerprint(there["step"])


def test_a_partial_the_step_calls_by_name_is_seen_with_its_arguments() -> None:
    source = "import functools\ndef render(template, ctx):\n    return template + ctx['x']\n" \
             "build = functools.partial(render, 'A')\n" \
             "def step(ctx):\n    return build(ctx)\n"
    assert _differ(source, lambda ns: ns["step"])


def test_a_bound_method_the_step_calls_by_name_is_seen() -> None:
    source = "class Renderer:\n    def render(self, ctx):\n        return 'A' + ctx['x']\n" \
             "render = Renderer().render\n" \
             "def step(ctx):\n    return render(ctx)\n"
    assert _differ(source, lambda ns: ns["step"])


_CLASS_DECORATOR = '''
import functools
class traced:
    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn)
    def __call__(self, ctx):
        return self.fn(ctx)
'''


def test_a_function_an_object_wraps_is_seen_through_its_wrapped() -> None:
    lib: dict[str, Any] = {"__name__": "lib"}
    exec(compile(_CLASS_DECORATOR, "<lib>", "exec"), lib)
    source = "@traced\ndef step(ctx):\n    return 'A' + ctx['draft']\n"
    first = code_fingerprint(_namespace(source, traced=lib["traced"])["step"])
    second = code_fingerprint(_namespace(source.replace("'A'", "'B'"), traced=lib["traced"])["step"])
    assert first != second


_MODES = "import enum\nclass Mode(enum.Enum):\n    FAST = 'fast'\n    SLOW = 'slow'\n"


def test_an_enum_member_in_a_default_or_a_constant_is_seen_by_which_it_is() -> None:
    default = _MODES + "def step(ctx, mode=Mode.FAST):\n    return mode.value + ctx['x']\n"
    constant = _MODES + "MODE = Mode.FAST\ndef step(ctx):\n    return MODE.value + ctx['x']\n"
    assert _differ(default, lambda ns: ns["step"], "=Mode.FAST", "=Mode.SLOW")
    assert _differ(constant, lambda ns: ns["step"], "= Mode.FAST", "= Mode.SLOW")


def test_settings_in_a_frozen_dataclass_or_namedtuple_constant_are_seen_by_value() -> None:
    # The model and its temperature held in one immutable settings constant of the module.
    frozen = "import dataclasses\n@dataclasses.dataclass(frozen=True)\nclass Settings:\n" \
             "    model: str\n    temperature: float\n" \
             "SETTINGS = Settings('gpt', 0.2)\ndef step(ctx):\n    return SETTINGS.model + ctx['x']\n"
    named = "import typing\nclass Settings(typing.NamedTuple):\n    model: str\n    temperature: float\n" \
            "SETTINGS = Settings('gpt', 0.2)\ndef step(ctx):\n    return SETTINGS.model + ctx['x']\n"
    for source in (frozen, named):
        assert _differ(source, lambda ns: ns["step"], "0.2)", "0.9)")
