"""Server-drawn SVG charts: a metric's curve over steps and the checks over steps.

Each chart has both axes with ticks and labels and a legend; steps the server
challenged are marked on the curve (replayed and verified, replay failed, or
chosen and not replayed yet). No scripts: hover titles are SVG ``<title>``s.

Example::

  svg = metric_chart("loss", [(0, 0.7), (1, 0.5)], {1: "verified"})
"""

import html
import math

e = html.escape
WIDTH, HEIGHT = 680, 230
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 16, 34, 40
CHECK_COLUMNS = WIDTH - _LEFT - _RIGHT  # a checks chart's ticks a kind and outcome, at most
MAX_POINTS = 1500  # points of a curve drawn; marked steps are always drawn
MARK_STYLES = {  # mark -> (legend text, fill, stroke)
    "verified": ("replayed by the server, verified", "#1a7f37", "#1a7f37"),
    "failed": ("replayed by the server, failed", "#cf222e", "#cf222e"),
    "challenged": ("challenged, not replayed yet", "#ffffff", "#57606a"),
    "discarded": ("discarded by a resume: not the run's training", "#d0d7de", "#8c959f"),
}
OFF_CURVE = ("discarded",)  # marks whose steps the curve leaves out (dots only)
MAX_MARKS = 400  # marks drawn on a curve (a full replay marks every step); failed ones first


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
  """About ``count`` round tick values covering [low, high]. Example:
  ``nice_ticks(0, 0.93)`` is ``[0.0, 0.2, 0.4, 0.6, 0.8, 1.0]``."""
  if not high > low:  # one value: a span around it
    wider = (low - abs(low) / 2 - 1, high + abs(high) / 2 + 1)
    low, high = wider if all(map(math.isfinite, wider)) else (low, high)
  raw = (high - low) / count
  if not (math.isfinite(raw) and raw > 0 and math.isfinite(low / raw)):
    return [low, high]  # a span no round step describes (near the float range's ends)
  magnitude = 10.0 ** math.floor(math.log10(raw))
  step = next((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw), None)
  if step is None:  # a subnormal span: its power of ten underflows to 0
    return [low, high]
  first = math.floor(low / step) * step
  ticks = [first]
  while ticks[-1] < high and len(ticks) <= 2 * count + 2:
    ticks.append(first + len(ticks) * step)
  # Multiples of a step carry float noise (0.30000000000000004): round to its precision.
  digits = max(0, -math.floor(math.log10(step)) + 2)
  return [round(t, digits) if digits < 300 else t for t in ticks]


def _label(value: float) -> str:
  return f"{value:.4g}"


class _Frame:
  """Maps (step, value) into the plot area of a chart."""

  def __init__(self, x_ticks: list[float], y_ticks: list[float]):
    self.x0, self.x1 = x_ticks[0], x_ticks[-1]
    self.y0, self.y1 = y_ticks[0], y_ticks[-1]

  def x(self, step: float) -> float:
    return _LEFT + (WIDTH - _LEFT - _RIGHT) * (step - self.x0) / ((self.x1 - self.x0) or 1)

  def y(self, value: float) -> float:
    return HEIGHT - _BOTTOM - (HEIGHT - _TOP - _BOTTOM) * (value - self.y0) / (
        (self.y1 - self.y0) or 1)


def _axes(frame: _Frame, x_ticks, y_ticks, y_title: str) -> str:
  bottom, right = HEIGHT - _BOTTOM, WIDTH - _RIGHT
  parts = [f"<g class='axis x' font-size='11'><line x1='{_LEFT}' x2='{right}' y1='{bottom}' "
           f"y2='{bottom}' stroke='#57606a'/>"]
  for t in x_ticks:
    x = frame.x(t)
    parts.append(f"<line class='tick' x1='{x:.1f}' x2='{x:.1f}' y1='{bottom}' "
                 f"y2='{bottom + 4}' stroke='#57606a'/><text x='{x:.1f}' y='{bottom + 16}' "
                 f"text-anchor='middle'>{_label(t)}</text>")
  parts.append(f"<text class='label' x='{(_LEFT + right) / 2:.0f}' y='{HEIGHT - 4}' "
               "text-anchor='middle'>step</text></g>")
  parts.append(f"<g class='axis y' font-size='11'><line x1='{_LEFT}' x2='{_LEFT}' y1='{_TOP}' "
               f"y2='{bottom}' stroke='#57606a'/>")
  for t in y_ticks:
    y = frame.y(t)
    parts.append(f"<line class='grid' x1='{_LEFT}' x2='{right}' y1='{y:.1f}' y2='{y:.1f}' "
                 f"stroke='#eaeef2'/><line class='tick' x1='{_LEFT - 4}' x2='{_LEFT}' "
                 f"y1='{y:.1f}' y2='{y:.1f}' stroke='#57606a'/><text x='{_LEFT - 6}' "
                 f"y='{y + 4:.1f}' text-anchor='end'>{_label(t)}</text>")
  parts.append(f"<text class='label' transform='translate(12 {(_TOP + bottom) / 2:.0f}) "
               f"rotate(-90)' text-anchor='middle'>{e(y_title)}</text></g>")
  return "".join(parts)


def _legend(entries: list[tuple[str, str]]) -> str:
  """``entries``: (swatch SVG at the origin, text), laid out in one row at the top."""
  parts, x = ["<g class='legend' font-size='11'>"], _LEFT
  for swatch, text in entries:
    parts.append(f"<g transform='translate({x} 14)'>{swatch}<text x='16' y='4'>{e(text)}"
                 "</text></g>")
    x += 26 + 6 * len(text)
  return "".join(parts) + "</g>"


def _thin(points: list[tuple[int, float]], keep: set[int]) -> list[tuple[int, float]]:
  """At most about MAX_POINTS points, evenly strided; steps in ``keep`` stay."""
  stride = max(1, math.ceil(len(points) / MAX_POINTS))
  return [p for i, p in enumerate(points) if i % stride == 0 or p[0] in keep
          or i == len(points) - 1]


def _shown_marks(steps: list[int], marks: dict[int, str]) -> set[int]:
  """At most MAX_MARKS of the marked ``steps``: by kind, failed first, then discarded,
  challenged and verified, each evenly strided over what room is left."""
  shown: list[int] = []
  for kind in ("failed", "discarded", "challenged", "verified"):
    of_kind = [s for s in steps if marks.get(s) == kind]
    room = MAX_MARKS - len(shown)
    if of_kind and room > 0:
      shown += of_kind[::math.ceil(len(of_kind) / room)]
  return set(shown)


def metric_chart(name: str, points: list[tuple[int, float]], marks: dict[int, str]) -> str:
  """A metric's committed values over steps, with the challenged steps marked (steps a
  resume discarded as dots off the curve).

  Non-finite values are left out of the curve and counted in the legend.
  """
  finite = [(s, v) for s, v in points if math.isfinite(v)]
  skipped = len(points) - len(finite)
  if not finite:
    return (f"<p class='empty' data-metric='{e(name)}'>{e(name)}: no finite value committed "
            f"yet ({skipped} non-finite).</p>")
  steps = [s for s, _ in finite]
  values = [v for _, v in finite]
  x_ticks = nice_ticks(min(steps), max(max(steps), min(steps) + 1), 6)
  x_ticks = [t for t in x_ticks if t == int(t)] or x_ticks
  y_ticks = nice_ticks(min(values), max(values), 5)
  frame = _Frame(x_ticks, y_ticks)
  marked = [s for s in steps if s in marks]
  shown = _shown_marks(marked, marks)
  drawn = [p for p in _thin(finite, shown) if marks.get(p[0]) not in OFF_CURVE]
  path = " ".join(f"{frame.x(s):.1f},{frame.y(v):.1f}" for s, v in drawn)
  dots = []
  for step, value in finite:
    mark = marks.get(step) if step in shown else None
    if mark is None:
      continue
    text, fill, stroke = MARK_STYLES[mark]
    dots.append(f"<circle class='mark {mark}' data-step='{step}' cx='{frame.x(step):.1f}' "
                f"cy='{frame.y(value):.1f}' r='4' fill='{fill}' stroke='{stroke}' "
                f"stroke-width='1.5'><title>step {step}: {e(name)} = {value:.6g} ({text})"
                "</title></circle>")
  legend = [("<line x1='0' x2='12' y1='0' y2='0' stroke='#0969da' stroke-width='2'/>",
             f"{name} (committed by every step)")]
  for mark in sorted({marks[s] for s in steps if s in marks}):
    text, fill, stroke = MARK_STYLES[mark]
    legend.append((f"<circle cx='6' cy='0' r='4' fill='{fill}' stroke='{stroke}'/>", text))
  if len(shown) < len(marked):
    legend.append(("", f"{len(shown)} of {len(marked)} marked steps drawn (failed first)"))
  if skipped:
    legend.append(("", f"{skipped} non-finite values not drawn"))
  return (f"<svg class='metric-chart' data-metric='{e(name)}' width='{WIDTH}' "
          f"height='{HEIGHT}' role='img' aria-label='{e(name)} over steps'>"
          f"{_axes(frame, x_ticks, y_ticks, name)}"
          f"<polyline class='curve' fill='none' stroke='#0969da' stroke-width='1.5' "
          f"points='{path}'/>{''.join(dots)}{_legend(legend)}</svg>")


def checks_chart(steps: int, ticks: list[dict]) -> str:
  """The server's replayed checks over steps: a tick per pixel column, kind and outcome
  that holds any (``Store.check_ticks`` with ``CHECK_COLUMNS``), titled with its steps."""
  x_ticks = nice_ticks(0, max(steps - 1, 1), 6)
  x_ticks = [t for t in x_ticks if t == int(t)] or x_ticks
  order = {"update": 0, "state": 1, "probe": 2, "start": 3}
  present = sorted({c["kind"] for c in ticks}, key=lambda k: (order.get(k, len(order)), k))
  frame = _Frame(x_ticks, [0, len(present) or 1])
  rows = {k: i for i, k in enumerate(reversed(present))}  # the first kind on top
  lines = []
  for c in ticks:
    x, y = frame.x(c["first"]), frame.y(rows[c["kind"]] + 0.5)
    color = "#1a7f37" if c["status"] == "verified" else "#cf222e"
    title = (f"step {c['first']} {e(c['kind'])} check: {e(c['status'])}" if c["count"] == 1
             else f"steps {c['first']}–{c['last']}: {c['count']} {e(c['kind'])} checks "
                  f"{e(c['status'])}")
    lines.append(f"<line class='check {e(c['status'])}' data-step='{c['first']}' "
                 f"data-count='{c['count']}' x1='{x:.1f}' x2='{x:.1f}' y1='{y - 9:.1f}' "
                 f"y2='{y + 9:.1f}' stroke='{color}' stroke-width='2'><title>{title}</title>"
                 "</line>")
  bottom = HEIGHT - _BOTTOM
  axes = [f"<g class='axis x' font-size='11'><line x1='{_LEFT}' x2='{WIDTH - _RIGHT}' "
          f"y1='{bottom}' y2='{bottom}' stroke='#57606a'/>"]
  for t in x_ticks:
    axes.append(f"<line class='tick' x1='{frame.x(t):.1f}' x2='{frame.x(t):.1f}' "
                f"y1='{bottom}' y2='{bottom + 4}' stroke='#57606a'/><text x='{frame.x(t):.1f}' "
                f"y='{bottom + 16}' text-anchor='middle'>{_label(t)}</text>")
  axes.append(f"<text class='label' x='{(WIDTH + _LEFT) / 2:.0f}' y='{HEIGHT - 4}' "
              "text-anchor='middle'>step</text></g><g class='axis y' font-size='11'>")
  for kind, row in rows.items():
    axes.append(f"<text x='{_LEFT - 6}' y='{frame.y(row + 0.5) + 4:.1f}' "
                f"text-anchor='end'>{e(kind)}</text>")
  axes.append("</g>")
  legend = _legend([
      ("<line x1='6' x2='6' y1='-6' y2='6' stroke='#1a7f37' stroke-width='2'/>", "verified"),
      ("<line x1='6' x2='6' y1='-6' y2='6' stroke='#cf222e' stroke-width='2'/>", "failed")])
  return (f"<svg class='checks' width='{WIDTH}' height='{HEIGHT}' role='img' "
          f"aria-label='checks over steps'>{''.join(axes)}{''.join(lines)}{legend}</svg>")


# Colors of overlaid runs (colour-blind safe, Okabe-Ito), in run order.
RUN_COLORS = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442",
              "#000000")


def overlay_chart(name: str, runs: list[tuple[str, str, list[tuple[int, float]]]]) -> str:
  """One metric of several runs on shared axes: ``runs`` is [(run id, label, points)], at
  most ``len(RUN_COLORS)``; each curve's hover title names its run and its last value."""
  drawn = [(run, label, [(s, v) for s, v in points if math.isfinite(v)])
           for run, label, points in runs[:len(RUN_COLORS)]]
  drawn = [d for d in drawn if d[2]]
  if not drawn:
    return f"<p class='empty' data-metric='{e(name)}'>{e(name)}: no finite value committed.</p>"
  steps = [s for _, _, points in drawn for s, _ in points]
  values = [v for _, _, points in drawn for _, v in points]
  x_ticks = nice_ticks(min(steps), max(max(steps), min(steps) + 1), 6)
  x_ticks = [t for t in x_ticks if t == int(t)] or x_ticks
  y_ticks = nice_ticks(min(values), max(values), 5)
  frame = _Frame(x_ticks, y_ticks)
  curves, legend = [], []
  for color, (run, label, points) in zip(RUN_COLORS, drawn):
    path = " ".join(f"{frame.x(s):.1f},{frame.y(v):.1f}" for s, v in _thin(points, set()))
    last_step, last = points[-1]
    curves.append(f"<polyline class='run-curve' data-run='{e(run)}' fill='none' "
                  f"stroke='{color}' stroke-width='1.5' points='{path}'><title>{e(label)}: "
                  f"{e(name)} = {last:.6g} at step {last_step}</title></polyline>")
    legend.append((f"<line x1='0' x2='12' y1='0' y2='0' stroke='{color}' stroke-width='2'/>",
                   label if len(label) <= 24 else label[:23] + "…"))
  return (f"<svg class='overlay-chart' data-metric='{e(name)}' width='{WIDTH}' "
          f"height='{HEIGHT}' role='img' aria-label='{e(name)} of {len(drawn)} runs'>"
          f"{_axes(frame, x_ticks, y_ticks, name)}{''.join(curves)}"
          f"{_legend(legend)}</svg>")
