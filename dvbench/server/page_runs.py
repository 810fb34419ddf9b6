"""Run listings as a tracker shows them: run names, tags, timing, a search and filter form,
curves of several runs overlaid, and a compare view of two or more runs.

Script-free like every page (``page``): the filter and compare forms are GET forms, the
curves inline SVG whose hover titles name the run.

Example::

  html = compare(url, runs)  # runs: [{"proof", "config", "curves"}...], 2 to MAX_COMPARED
"""

import html
import time
import urllib.parse

from dvbench.server import charts
from dvbench.server import page_frame as page

e = html.escape
MAX_COMPARED = len(charts.RUN_COLORS)  # runs overlaid or compared at once


def run_label(p: dict) -> str:
  """A run's name as lists show it: its declared run name, else its id's first 12 digits."""
  return p.get("run_name") or p["id"][:12]


def duration(seconds: float) -> str:
  """E.g. '45 s', '12 min 03 s', '3 h 07 min'."""
  seconds = max(0, int(seconds))
  if seconds < 60:
    return f"{seconds} s"
  if seconds < 3600:
    return f"{seconds // 60} min {seconds % 60:02d} s"
  return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def timing(p: dict, now: float | None = None) -> str:
  """How long a run took ('12 min 03 s'), or has been receiving ('running, 45 s')."""
  if p.get("ended_at") is None:
    return f"running, {duration((now or time.time()) - p['created_at'])}"
  return duration(p["ended_at"] - p["created_at"])


def tags_html(tags) -> str:
  return " ".join(f"<span class='tag'>{e(t)}</span>" for t in tags)


def filter_form(action: str, only, states) -> str:
  """A GET form: search text, state and tag (``store_listing.ProofFilter``)."""
  options = "".join(f"<option value='{e(s)}'{' selected' if s == only.state else ''}>{e(s)}"
                    "</option>" for s in states)
  reset = f" <a href='{e(action)}'>clear</a>" if only else ""
  return (f"<form id='filter' method='get' action='{e(action)}'>"
          f"<input type='search' name='q' value='{e(only.search)}' maxlength='200' "
          f"placeholder='run name, experiment or proof id'> <select name='state'>"
          f"<option value=''>any state</option>{options}</select> "
          f"<input type='text' name='tag' value='{e(only.tag)}' maxlength='64' "
          f"placeholder='tag'> <button type='submit'>filter</button>{reset}</form>")


def filter_query(only) -> str:
  """The filter as query parameters to keep on pager links, e.g. '&q=lr&state=verified'."""
  params = {k: v for k, v in (("q", only.search), ("state", only.state), ("tag", only.tag))
            if v}
  return "&" + urllib.parse.urlencode(params) if params else ""


def zoom_form(action: str, window: tuple[int, int], zoomed: bool,
              keep: list[tuple[str, str]] = ()) -> str:
  """A GET form drawing the charts for steps ``from`` to ``to`` only (``keep``: the page's
  other query parameters, as hidden fields)."""
  hidden = "".join(f"<input type='hidden' name='{e(k)}' value='{e(v)}'>" for k, v in keep)
  query = urllib.parse.urlencode(list(keep))
  whole = (f" <a class='unzoom' href='{e(action)}{'?' + e(query) if query else ''}'>whole run"
           "</a>" if zoomed else "")
  low, high = (window[0], window[1]) if zoomed else ("", "")
  return (f"<form class='zoom' method='get' action='{e(action)}'>{hidden}steps "
          f"<input type='number' name='from' min='0' value='{low}' placeholder='first'> to "
          f"<input type='number' name='to' min='0' value='{high}' placeholder='last'> "
          f"<button type='submit'>zoom</button>{whole}</form>")


def overlay(runs: list[dict]) -> str:
  """One chart per metric with every run's curve (``runs``: {"proof", "curves"})."""
  names = list(dict.fromkeys(n for r in runs for n in r["curves"]))
  if not names:
    return "<p class='empty' id='no-overlay'>No run has committed a scalar metric yet.</p>"
  return "".join(charts.overlay_chart(n, [(r["proof"]["id"], run_label(r["proof"]),
                                           r["curves"].get(n, [])) for r in runs])
                 for n in names)


def _rows_of(run: dict) -> dict[str, str]:
  """A run's comparable rows: state and timing, its declared config, its program."""
  p, config = run["proof"], run["config"]
  rows = {"state": p["state"], "steps": str(p["steps"]), "duration": timing(p),
          "tags": ", ".join(config["tags"])}
  rows.update({f"declared: {k}": v for k, v in config["declared"]})
  for program in config["programs"]:
    rows[f"program {program['number']}"] = (
        f"{program['function']} ({program['parameters']:,} parameters, {program['mode']})")
  return rows


def compare(url: "page.Url", runs: list[dict], zoom: str = "") -> str:
  """Two or more runs side by side: every row (declared config, program, state) with the
  rows that differ marked and listed first, then their curves overlaid (``zoom``: the
  ``zoom_form`` above them)."""
  table = [_rows_of(r) for r in runs]
  keys = list(dict.fromkeys(k for rows in table for k in rows))
  differs = {k for k in keys if len({rows.get(k, "—") for rows in table}) > 1}
  keys.sort(key=lambda k: k not in differs)
  heads = "".join(
      f"<th data-run='{e(r['proof']['id'])}'><a href='"
      f"{e(url('proof_page', proof_id=r['proof']['id']))}'>{e(run_label(r['proof']))}</a>"
      f"<br>{page.experiment_link(url, r['proof']['experiment'])}</th>" for r in runs)
  body = "".join(
      f"<tr data-key='{e(k)}'{' class=differs' if k in differs else ''}><th>{e(k)}</th>"
      + "".join(f"<td>{e(rows.get(k, '—'))}</td>" for rows in table) + "</tr>" for k in keys)
  return page.page(url, f"Compare {len(runs)} runs", f"""
<p>{len(differs)} of {len(keys)} rows differ (marked, listed first). Rows named
<em>declared</em> are the run config each prover declared, shown as declared: what the server
verified is each run's program and its replayed steps.</p>
<table id='compare'><tr><th></th>{heads}</tr>{body}</table>
<h2>Metrics over steps</h2>{zoom}{overlay(runs)}""")
