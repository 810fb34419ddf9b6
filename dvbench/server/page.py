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
  """A horizontal bar chart of the ranked entries' values."""
  if not rows:
    return ""
  top = max(abs(r["value"]) for r in rows) or 1.0
  height, bar = 26 * len(rows) + 10, []
  for i, r in enumerate(rows):
    width = 360 * abs(r["value"]) / top
    bar.append(
        f"<text x='0' y='{26 * i + 22}' font-size='12'>{e(r['experiment'])}</text>"
        f"<rect x='220' y='{26 * i + 8}' width='{width:.1f}' height='18' fill='#1a7f37'>"
        f"<title>{r['value']:.6g}</title></rect>"
        f"<text x='{226 + width:.1f}' y='{26 * i + 22}' font-size='12'>{r['value']:.4g}</text>")
  return (f"<svg class='values' width='680' height='{height}' role='img' "
          f"aria-label='ranked values'>{''.join(bar)}</svg>")


def leaderboards(url: Url, benchmarks: list[dict], measurements: list[dict]) -> str:
  """The benchmarks (each links to its leaderboard) and the self-reported measurements."""
  def link(full_name: str) -> str:
    owner, name = full_name.split("/")
    return e(url("benchmark_page", owner=owner, name=name))

  bench_rows = "".join(
      f"<tr data-benchmark='{e(b['full_name'])}'><td><a href='{link(b['full_name'])}'>"
      f"{e(b['full_name'])}</a></td><td>{e(b['metric'])}</td>"
      f"<td>{'higher' if b['higher_is_better'] else 'lower'}</td><td class='num'>{b['rows']}</td>"
      f"<td class='num'>{b['min_update_check_probability']:g}</td></tr>" for b in benchmarks)
  measured = "".join(
      f"<tr data-measurement='{e(m['id'])}' data-state='{e(m['state'])}'>"
      f"<td>{e(m['experiment'])}</td><td>{e(m['metric'])}</td>"
      f"<td class='num'>{m['value']:.6g}</td><td>{_badge(m['state'])}</td>"
      f"<td class='num'>{m['sampled']} / {m['batches']}</td>"
      f"<td><a href='{e(url('proof_page', proof_id=m['proof_id']))}'>proof</a>"
      f"{'<br><span class=muted>' + e(m['failure']) + '</span>' if m['failure'] else ''}"
      f"</td></tr>" for m in measurements)
  return _page(url, "Leaderboard", f"""
<p>Rankings belong to benchmarks: the owner registers the evaluation program, the rows and
the audit a proof needs; the server scores each verified checkpoint itself.</p>
<table id="benchmarks"><tr><th>benchmark</th><th>metric</th><th>better</th><th>rows</th>
<th>minimum p</th></tr>{bench_rows}</table>
<h2>Self-reported measurements</h2>
<p>{_badge('self-reported')}: the submitter's own program on its own batches; the server
replayed the batches it chose after the outputs were committed. Never ranked.</p>
<table id="measurements"><tr><th>experiment</th><th>metric</th><th>value</th><th>state</th>
<th>replayed batches</th><th></th></tr>{measured}</table>""")


# (column key, header) of a benchmark's leaderboard.
_COLUMNS = (("rank", "rank"), ("experiment", "experiment"), ("value", "value"),
            ("state", "state"), ("challenger", "challenged by"),
            ("checks_replayed", "checks replayed"), ("update_check_probability", "p"),
            ("escape_probability", "escape (1 − p)"), ("start_attested", "start"),
            ("program_pinned", "program"), ("contamination", "contamination"),
            ("outside_training_set", "training set"), ("proof", "proof"))


def _entry(url: Url, r: dict) -> str:
  value = "—" if r["value"] is None else f"{r['value']:.6g}"
  dirty = (f"<span class='state invalid' title='probed training rows found in the evaluation "
           f"set'>contaminated: {r['contamination']}</span>" if r["contamination"] else "0")
  programs = "".join(
      f"<br><a class='program' href='{e(url('proof_blob', proof_id=r['proof_id'], digest=p))}'>"
      f"<code>{e(p[:12])}…</code></a>" for p in r["training_programs"])
  outside = r["outside_training_set"]
  training = ("not pinned" if outside is None else "probed rows in it" if not outside else
              f"<span class='state invalid' title='probed rows not proven members of the "
              f"registered training set'>outside: {outside}</span>")
  unranked = "" if r["ranked"] else (
      "<br><span class=muted>unranked: " + e("; ".join(r["unranked_because"])) + "</span>")
  state = _badge(r["state"]) + (
      f"<br><span class=muted>{e(r['failure'])}</span>" if r["failure"] else "") + unranked
  challenger = "DVBench" if r["challenger"] == "dvbench" else e(r["challenger"])
  return (f"<tr data-experiment='{e(r['experiment'])}' data-state='{e(r['state'])}' "
          f"data-ranked='{str(r['ranked']).lower()}' data-strict='{str(r['strict']).lower()}' "
          f"data-contamination='{r['contamination']}' data-outside='{outside}'>"
          f"<td class='num'>{r['rank'] or ''}</td><td>{e(r['experiment'])}</td>"
          f"<td class='num'>{value}</td><td>{state}</td><td>{challenger}</td>"
          f"<td class='num'>{r['checks_replayed']}</td>"
          f"<td class='num'>{r['update_check_probability']:g}</td>"
          f"<td class='num'>{r['escape_probability']:.3g}</td>"
          f"<td>{'attested' if r['start_attested'] else 'unattested'}</td>"
          f"<td>{'pinned' if r['program_pinned'] else 'not pinned'}{programs}</td><td>{dirty}</td>"
          f"<td>{training}</td>"
          f"<td><a href='{e(url('proof_page', proof_id=r['proof_id']))}'><code>"
          f"{e(r['proof_id'][:12])}…</code></a></td></tr>")


def _training_set(pin: dict | None) -> str:
  if pin is None:
    return "not pinned (any rows)"
  return (f"{pin['size']} rows, Merkle root <code>{e(pin['root'][:16])}…</code>; probed rows "
          "must be proven members")


def benchmark(url: Url, bench: dict, entries: list[dict], sort: str, sorts) -> str:
  """A benchmark's definition and its leaderboard (``routes_benchmarks.leaderboard_entries``);
  the headers of the columns in ``sorts`` link to the page sorted by them."""
  owner, name = bench["name"].split("/")
  here = url("benchmark_page", owner=owner, name=name)
  heads = "".join(
      f"<th data-column='{key}'>"
      + (f"<a href='{e(here)}?sort={key}'>{e(title)}</a>{' ▾' if key == sort else ''}"
         if key in sorts else e(title)) + "</th>" for key, title in _COLUMNS)
  pins = bench["allowed_programs"]
  return _page(url, f"Benchmark {bench['name']}", f"""
<table id="definition">
<tr><th>metric</th><td>{e(bench['metric'])} ({'higher' if bench['higher_is_better'] else 'lower'}
 is better), the {e(bench['aggregate'])} of the program's output on every row</td></tr>
<tr><th>evaluation rows</th><td>{bench['rows']} ({'published' if bench['public_rows'] else
 'private to the server; digests public'})</td></tr>
<tr><th>evaluation program</th><td><code>{e(bench['program'])}</code></td></tr>
<tr><th>required audit</th><td>{e(bench['audit'])}: server-chosen update checks at p ≥
 {bench['min_update_check_probability']:g}</td></tr>
<tr><th>training programs</th><td>{'pinned: ' + ', '.join(e(p[:16]) + '…' for p in pins)
 if pins is not None else 'not pinned (any)'}</td></tr>
<tr><th>training set</th><td>{_training_set(bench['training_set'])}</td></tr></table>
<p>Ranked: scored by the server, the proof passes <code>zkdv verify --strict</code> (server
challenges, exact replays, an attested start, a program whose update reads the batch, probes),
no probed training row is in the evaluation set and, where a training set is registered,
every probed row is proven (Merkle) to be in it. Any other entry is shown with what it lacks
and not ranked.</p>
{_bars([r for r in entries if r['ranked']])}
<table class="leaderboard" data-benchmark="{e(bench['name'])}"><tr>{heads}</tr>
{''.join(_entry(url, r) for r in entries)}</table>""")


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
