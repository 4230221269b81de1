"""A run's graph drawn as inline SVG, server-side: a layered layout, one column per depth.

A step's column is the length of the longest dependency path that reaches
it (a root is in column 0), its row its place among the steps of that
column in declaration order. Nodes are rects with the step's name (and,
for a mapped step, its items done/total); edges are straight lines from a
dependency's right side to the dependent's left side. Every name is
escaped (``html.escape`` with ``quote=True``); nothing else of the run's
data reaches the SVG.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

__all__ = ["STATES", "layers", "svg"]

STATES: tuple[tuple[str, str], ...] = (
    ("recorded", "recorded"),
    ("running", "running"),
    ("ready", "ready, not begun"),
    ("failed", "failed"),
    ("waiting", "waiting for a person"),
    ("skipped", "skipped by a condition"),
    ("not-started", "not started"),
)
"""Each node state (its CSS class is ``state-<name>``) and how the legend words it."""

_W, _H, _GAP_X, _GAP_Y, _PAD = 170, 34, 60, 14, 10


def layers(names: Sequence[str], deps: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Each step's column: the length of the longest dependency path ending at it.

    A dependency that is not among ``names`` is ignored; so is a cycle's
    back edge (a ``GraphSpec`` has none).
    """
    known = set(names)
    depth: dict[str, int] = {}
    on_path: set[str] = set()
    for root in names:
        if root in depth:
            continue
        stack: list[tuple[str, int]] = [(root, 0)]
        on_path.add(root)
        while stack:
            name, i = stack[-1]
            ds = [d for d in deps.get(name, ()) if d in known]
            if i < len(ds):
                stack[-1] = (name, i + 1)
                d = ds[i]
                if d not in depth and d not in on_path:
                    on_path.add(d)
                    stack.append((d, 0))
                continue
            stack.pop()
            on_path.discard(name)
            depth[name] = max((depth[d] + 1 for d in ds if d in depth), default=0)
    return depth


def _short(text: str, limit: int = 24) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def svg(
    names: Sequence[str],
    deps: Mapping[str, Sequence[str]],
    states: Mapping[str, str],
    items: Mapping[str, tuple[int, int | None]] | None = None,
) -> str:
    """The SVG text of the graph; ``states[name]`` picks each node's class (default ``not-started``).

    ``items`` maps a mapped step to (items done, items in all or ``None``
    while unknown), shown under its name.
    """
    items = items or {}
    depth = layers(names, deps)
    rows: dict[int, int] = {}
    where: dict[str, tuple[int, int]] = {}
    for name in names:
        col = depth[name]
        row = rows.get(col, 0)
        rows[col] = row + 1
        where[name] = (_PAD + col * (_W + _GAP_X), _PAD + row * (_H + _GAP_Y))
    width = _PAD * 2 + (max(depth.values(), default=0) + 1) * (_W + _GAP_X) - _GAP_X
    height = _PAD * 2 + max(rows.values(), default=1) * (_H + _GAP_Y) - _GAP_Y
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="graph" class="graph" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="run graph">',
        '<g class="edges">',
    ]
    for name in names:
        x2, y2 = where[name]
        for dep in deps.get(name, ()):
            if dep in where:
                x1, y1 = where[dep]
                out.append(
                    f'<line class="edge" x1="{x1 + _W}" y1="{y1 + _H // 2}" x2="{x2}" y2="{y2 + _H // 2}"/>'
                )
    out.append("</g><g class=\"nodes\">")
    for name in names:
        x, y = where[name]
        state = states.get(name, "not-started")
        label = escape(_short(name), quote=True)
        full = escape(name, quote=True)
        text_y = y + (_H // 2 + 5 if name not in items else 14)
        node = [
            f'<g class="node state-{escape(state, quote=True)}" data-step="{full}">',
            f"<title>{full}</title>",
            f'<rect x="{x}" y="{y}" width="{_W}" height="{_H}" rx="5"/>',
            f'<text x="{x + 8}" y="{text_y}">{label}</text>',
        ]
        if name in items:
            done, total = items[name]
            shown = f"{done}/{'?' if total is None else total} items"
            node.append(f'<text class="items" x="{x + 8}" y="{y + 28}">{shown}</text>')
        node.append("</g>")
        out.append("".join(node))
    out.append("</g></svg>")
    return "\n".join(out)
