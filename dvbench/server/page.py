"""Server-rendered HTML: experiments, proofs, the leaderboard. No scripts, no CDN:
plots are inline SVG and the stylesheet is served from the ``static`` mount.

Every function takes ``url(name, **params)``, the app's named routes, e.g.
``url("proof_page", proof_id=p["id"])``.

Example::

  html = index(url, experiments, proofs)
"""

import datetime
import html
from collections.abc import Callable

from dvbench.server.labels import SELF_AUDITED

e = html.escape
Url = Callable[..., str]
_STATE_ORDER = {"verified": 0, "self-reported": 1, "verifying": 2, "pending": 2, "invalid": 3}
_STATES = f"""<p>States say who chose the checks. <span class='state verified'>verified</span>:
DVBench chose the checks after storing each step and replayed at least one update check.
<span class='state unchallenged'>unchallenged</span>: DVBench chose the checks, but none hit an
update, so nothing was replayed against a dishonest prover.
<span class='state self-audited'>self-audited</span>: {e(SELF_AUDITED)}; never ranked.</p>"""


def _time(t: float) -> str:
  return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _badge(state: str) -> str:
  return f"<span class='state {e(state)}'>{e(state)}</span>"


def _page(url: Url, title: str, body: str) -> str:
  return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)} · DVBench</title>
<link rel="stylesheet" href="{e(url('static', path='/style.css'))}"></head><body>
<nav><a href="{e(url('index'))}">Proofs</a><a href="{e(url('leaderboard'))}">Leaderboard</a></nav>
<h1>{e(title)}</h1>
{body}
</body></html>"""


def index(url: Url, experiments: list[dict], proofs: list[dict]) -> str:
  rows = "".join(
      f"<tr data-proof='{e(p['id'])}' data-state='{e(p['state'])}'>"
      f"<td>{e(p['experiment'])}</td>"
      f"<td><a href='{e(url('proof_page', proof_id=p['id']))}'><code>{e(p['id'][:16])}…"
      f"</code></a></td>"
      f"<td class='num'>{p['steps']}</td><td class='num'>{p['records']}</td>"
      f"<td>{_badge(p['state'])}</td><td>{e(p['failure'] or '')}</td>"
      f"<td>{_time(p['updated_at'])}</td></tr>" for p in proofs)
  exp_rows = "".join(
      f"<tr><td>{e(x['full_name'])}</td>"
      f"<td class='num'>{sum(p['experiment'] == x['full_name'] for p in proofs)}</td></tr>"
      for x in experiments)
  return _page(url, "DVBench", f"""
<p>Proofs are verified by server-side replay of the checks DVBench chose; only
{_badge('verified')} proofs count.</p>{_STATES}
<h2>Experiments</h2>
<table id="experiments"><tr><th>experiment</th><th>proofs</th></tr>{exp_rows}</table>
<h2>Proofs</h2>
<table id="proofs"><tr><th>experiment</th><th>transcript</th><th>steps</th><th>records</th>
<th>state</th><th>failure</th><th>updated</th></tr>{rows}</table>""")


def _bars(rows: list[dict]) -> str:
  """A horizontal bar chart of measurement values, coloured by state."""
  if not rows:
    return ""
  top = max(abs(r["value"]) for r in rows) or 1.0
  colour = {"verified": "#1a7f37", "self-reported": "#0969da"}
  height, bar = 26 * len(rows) + 10, []
  for i, r in enumerate(rows):
    width = 360 * abs(r["value"]) / top
    bar.append(
        f"<text x='0' y='{26 * i + 22}' font-size='12'>{e(r['experiment'])}</text>"
        f"<rect x='220' y='{26 * i + 8}' width='{width:.1f}' height='18' "
        f"fill='{colour.get(r['state'], '#8c959f')}'><title>{r['value']:.6g} "
        f"({e(r['state'])})</title></rect>"
        f"<text x='{226 + width:.1f}' y='{26 * i + 22}' font-size='12'>{r['value']:.4g}</text>")
  return (f"<svg class='values' width='680' height='{height}' role='img' "
          f"aria-label='measurement values'>{''.join(bar)}</svg>")


def leaderboard(url: Url, rows: list[dict], checks: dict, probes: dict,
                contamination: dict) -> str:
  sections = []
  for metric in sorted({r["metric"] for r in rows}):
    ranked = [r for r in rows if r["metric"] == metric]
    higher = ranked[0]["higher_is_better"]
    ranked.sort(key=lambda r: (_STATE_ORDER.get(r["state"], 2),
                               -r["value"] if higher else r["value"]))
    dirty = contamination.get(metric)
    body, rank = [], 0
    for r in ranked:
      counted = r["state"] == "verified"
      rank += counted
      replayed, verified = checks.get(r["proof_id"], (0, 0))
      overlap = "—" if dirty is None else str(dirty.get(r["proof_id"], 0))
      body.append(
          f"<tr data-experiment='{e(r['experiment'])}' data-state='{e(r['state'])}' "
          f"data-proof-state='{e(r['proof_state'])}'>"
          f"<td class='num'>{rank if counted else ''}</td><td>{e(r['experiment'])}</td>"
          f"<td class='num'>{r['value']:.6g}</td><td>{_badge(r['state'])}</td>"
          f"<td>{_badge(r['proof_state'])}</td>"
          f"<td><code title='{e(r['checkpoint'])}'>{e(r['checkpoint'][:12])}…</code></td>"
          f"<td class='num'>{r['steps']}</td><td class='num'>{verified} / {replayed}</td>"
          f"<td class='num'>{r['sampled']} / {r['batches']}</td>"
          f"<td class='num'>{probes.get(r['proof_id'], 0)}</td><td class='num'>{overlap}</td>"
          f"<td><a href='{e(url('proof_page', proof_id=r['proof_id']))}'>transcript</a>"
          f"{'<br><span class=muted>' + e(r['failure']) + '</span>' if r['failure'] else ''}"
          f"</td></tr>")
    plotted = [r for r in ranked if r["state"] in ("verified", "self-reported")]
    sections.append(f"""
<h2 id="metric-{e(metric)}">{e(metric)} <span class="muted">({'higher' if higher else 'lower'}
 is better)</span></h2>
{_bars(plotted)}
<table class="leaderboard" data-metric="{e(metric)}"><tr><th>rank</th><th>experiment</th>
<th>value</th><th>measurement</th><th>proof</th><th>checkpoint</th><th>steps</th>
<th>server-replayed checks</th><th>replayed batches</th><th>distinct probed rows</th>
<th>probes in eval set</th><th></th></tr>{''.join(body)}</table>""")
  return _page(url, "Leaderboard", f"""
<p>Only {_badge('verified')} measurements are ranked: the server replayed the sampled
evaluations and recomputed the aggregate on the checkpoint that a verified transcript produced.
{_badge('self-reported')} values passed the replayed evaluations but their aggregate could
not be recomputed.</p>{''.join(sections) or '<p>No measurements yet.</p>'}""")


def _checks_strip(steps: int, checks: list[dict]) -> str:
  """Checks over steps: one tick per check, green if it verified."""
  width, span = 680, max(steps - 1, 1)
  ticks = "".join(
      f"<line x1='{10 + 660 * c['step'] / span:.1f}' x2='{10 + 660 * c['step'] / span:.1f}' "
      f"y1='{8 if c['kind'] == 'update' else 30}' y2='{28 if c['kind'] == 'update' else 50}' "
      f"stroke='{'#1a7f37' if c['status'] == 'verified' else '#cf222e'}' stroke-width='2'>"
      f"<title>step {c['step']} {e(c['kind'])} {e(c['status'])}</title></line>"
      for c in checks)
  return (f"<svg class='checks' width='{width}' height='70' role='img' aria-label='checks "
          f"over steps'><line x1='10' x2='670' y1='55' y2='55' stroke='#8c959f'/>{ticks}"
          f"<text x='10' y='68' font-size='11'>step 0</text>"
          f"<text x='620' y='68' font-size='11'>step {max(steps - 1, 0)}</text></svg>")


def _challenge_rows(summary: dict) -> str:
  counts, p = summary["server_challenges"], summary["update_check_probability"]
  if summary["challenger"] == "self":
    return f"<tr><th>checks chosen by</th><td>the prover: {e(SELF_AUDITED)}</td></tr>"
  return f"""<tr><th>checks chosen by</th><td>DVBench, after storing each step</td></tr>
<tr><th>update check probability p</th><td>{p:g}</td></tr>
<tr><th>server challenges</th><td>{counts['required']} over {counts['steps']} steps
 ({counts['update']} update, {counts['state']} state, {counts['probe']} probe);
 {counts['answered']} answered</td></tr>
<tr><th>server-chosen update checks replayed</th><td>{counts['update_replayed']}</td></tr>
<tr><th>chance one faked step escaped</th>
<td>{summary['escape_probability_one_faked_step']:.3g} (1 − p)</td></tr>"""


def proof(url: Url, p: dict, summary: dict, checks: list[dict], probed_rows: int) -> str:
  """The proof page; ``summary`` is ``labels.challenge_summary`` of the proof."""
  rows = "".join(
      f"<tr data-state='{e(c['status'])}'><td class='num'>{c['step']}</td><td>{e(c['kind'])}</td>"
      f"<td>{e(c['mode'])}</td><td>{_badge(c['status'])}</td>"
      f"<td class='num'>{c['max_abs_error']:.3g}</td><td class='num'>{c['max_ulp_error']}</td></tr>"
      for c in checks)
  return _page(url, f"Proof {p['id'][:16]}…", f"""
<table id="summary">
<tr><th>experiment</th><td>{e(p['experiment'])}</td></tr>
<tr><th>transcript id</th><td><code>{e(p['id'])}</code></td></tr>
<tr><th>state</th><td>{_badge(p['state'])} <span id="label">{e(summary['label'])}</span></td></tr>
{_challenge_rows(summary)}
<tr><th>steps</th><td>{p['steps']}</td></tr><tr><th>records</th><td>{p['records']}</td></tr>
<tr><th>final params</th><td><code>{e(p['final_params'] or '—')}</code></td></tr>
<tr><th>probed batch rows</th><td>{probed_rows}</td></tr>
<tr><th>server-replayed checks</th><td>{sum(c['status'] == 'verified' for c in checks)} verified
 of {len(checks)}</td></tr></table>
<h2>Checks over steps</h2>{_checks_strip(p['steps'], checks)}
<table id="checks"><tr><th>step</th><th>kind</th><th>mode</th><th>status</th>
<th>max abs error</th><th>max ulp</th></tr>{rows}</table>""")
