"""Server-rendered HTML: experiments, proofs, the leaderboard. No scripts, no CDN:
plots are inline SVG and the stylesheet is served from the ``static`` mount.

Every function takes ``url(name, **params)``, the app's named routes, e.g.
``url("proof_page", proof_id=p["id"])``.

Example::

  html = index(url, experiments, counts, proofs, first=True, following=None, total=len(proofs))
"""

import datetime
import json

from dvbench.server import charts
from dvbench.server import page_runs
from dvbench.server.page_frame import Url, e, experiment_link, page
from dvbench.server import pins as pins_lib
from dvbench.server.labels import SELF_AUDITED
from dvbench.server.store_listing import ProofFilter

_STATES = f"""<p>States say what the server's verification showed.
<span class='state verified'>verified</span>: DVBench chose the checks after storing each step,
replayed them bit for bit, and every claim of <code>zkdv verify --strict</code> holds (attested
start, a program that reads its batch, probed data); only these are ranked.
<span class='state verified-steps'>verified steps</span>: the replays hold, and the label names
each claim that does not (e.g. "start unattested").
<span class='state within-tolerance'>within tolerance</span>: replays matched only within a
tolerance, not bit for bit.
<span class='state unchallenged'>unchallenged</span>: DVBench chose the checks, but none hit an
update, so nothing was replayed against a dishonest prover.
<span class='state self-audited'>self-audited</span>: {e(SELF_AUDITED)}; never ranked.
<span class='state unverifiable'>unverifiable</span>: the server's verification itself failed
(its worker or verifier, not the proof) and was given up: could not verify, no verdict.
Every proof slot counts as an attempt of its owner, shown with each proof.</p>"""


def _time(t: float) -> str:
  return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _badge(state: str) -> str:
  return f"<span class='state {e(state.replace(' ', '-'))}'>{e(state)}</span>"


PAGE_SIZE = 50  # proofs per page of the index
FAILURE_SUMMARY = 120  # characters of a failure shown in a table


def failure_summary(failure: str | None) -> str:
  """The first line of a failure, cut at FAILURE_SUMMARY characters (the proof page has it all)."""
  if not failure:
    return ""
  line = failure.strip().splitlines()[0] if failure.strip() else ""
  return line if len(line) <= FAILURE_SUMMARY else line[:FAILURE_SUMMARY - 1] + "…"


def _proof_rows(url: Url, proofs: list[dict], with_experiment: bool = True,
                compare: bool = False) -> str:
  """Rows of a proofs table (``compare``: with a checkbox of the compare form)."""
  return "".join(
      f"<tr data-proof='{e(p['id'])}' data-state='{e(p['state'])}'>"
      + (f"<td><input type='checkbox' name='proof' value='{e(p['id'])}'></td>" if compare
         else "")
      + (f"<td>{experiment_link(url, p['experiment'])}</td>" if with_experiment else "")
      + f"<td><a href='{e(url('proof_page', proof_id=p['id']))}'><code>{e(p['id'][:16])}…"
      f"</code></a></td><td class='run-name'>{e(p.get('run_name') or '')}</td>"
      f"<td>{page_runs.tags_html(json.loads(p.get('tags') or '[]'))}</td>"
      f"<td class='num'>{p['steps']}</td>"
      f"<td>{_badge(p['state'])}</td><td class='failure'>{e(failure_summary(p['failure']))}</td>"
      f"<td class='nowrap'>{_time(p['created_at'])}</td>"
      f"<td class='nowrap duration'>{page_runs.timing(p)}</td></tr>" for p in proofs)


_PROOF_HEADS = ("<th>transcript</th><th>run name</th><th>tags</th><th>steps</th><th>state</th>"
                "<th>failure</th><th>started</th><th>duration</th>")


def _pager(url: Url, first: bool, following: str | None, total: int,
           only: ProofFilter = ProofFilter()) -> str:
  kept = page_runs.filter_query(only)
  newest = url("index") + (f"?{kept[1:]}" if kept else "")
  links = [] if first else [f"<a rel='first' href='{e(newest)}'>← newest</a>"]
  links.append(f"{total} proofs{' match' if only else ''}, {PAGE_SIZE} a page")
  if following is not None:
    links.append(f"<a rel='next' href='{e(url('index'))}?after={e(following)}{e(kept)}'>"
                 "older →</a>")
  return f"<p class='pager'>{' · '.join(links)}</p>"


def index(url: Url, experiments: list[dict], counts: dict[int, int], proofs: list[dict],
          first: bool, following: str | None, total: int, only: ProofFilter = ProofFilter(),
          states: tuple = ()) -> str:
  """Experiments (each links to its page) and a page of proofs, newest first (``following``:
  the cursor of the next page, ``store.page_proofs``), those ``only`` lets through
  (``states``: the filter's choices)."""
  exp_rows = "".join(
      f"<tr data-experiment='{e(x['full_name'])}'><td>{experiment_link(url, x['full_name'])}</td>"
      f"<td class='num'>{counts.get(x['id'], 0)}</td></tr>" for x in experiments)
  experiments_html = (
      f"<table id='experiments'><tr><th>experiment</th><th>proofs</th></tr>{exp_rows}</table>"
      if experiments else "<p class='empty'>No experiments yet. A run creates one with "
      "<code>dvbench.Client(URL).experiment(\"owner/name\").proof(...)</code>.</p>")
  proofs_html = (
      f"<table id='proofs'><tr><th>experiment</th>{_PROOF_HEADS}</tr>"
      f"{_proof_rows(url, proofs)}</table>{_pager(url, first, following, total, only)}"
      if proofs else "<p class='empty' id='no-proofs'>No proofs match the filter.</p>" if only
      else "<p class='empty'>No proofs on this page.</p>" if total else
      "<p class='empty'>No proofs yet.</p>")
  return page(url, "DVBench", f"""
<p>Proofs are verified by server-side replay of the checks DVBench chose; only
{_badge('verified')} proofs count.</p>{_STATES}
<h2>Experiments</h2>{experiments_html}
<h2>Proofs</h2>{page_runs.filter_form(url('index'), only, states)}{proofs_html}""")


def _attempts_html(attempts: dict | None) -> str:
  """An owner's attempts (``attempts.describe``), or nothing."""
  if not attempts:
    return ""
  return f"<p id='attempts'>Attempts: {e(attempts['summary'])}.</p>"


def experiment(url: Url, full_name: str, proofs: list[dict], latest_metrics: dict,
               measurements: list[dict], attempts: dict | None = None,
               runs: list[dict] = (), only: ProofFilter = ProofFilter(),
               states: tuple = (), zoom: str = "") -> str:
  """An experiment: its latest proof's state and metrics, its proofs (those ``only`` lets
  through, with a compare form), the curves of ``runs`` ({"proof", "curves"}) overlaid, its
  measurements and its owner's attempts across all of the owner's experiments."""
  owner, name = full_name.split("/", 1)
  here = url("experiment_page", owner=owner, name=name)
  if proofs:
    latest = proofs[0]
    values = "".join(
        f"<tr data-metric='{e(n)}'><th>{e(n)}</th><td class='num'>{e(_metric_text(v))}</td></tr>"
        for n, v in latest_metrics.items())
    latest_html = f"""<table id="latest">
<tr><th>latest proof</th><td><a href='{e(url('proof_page', proof_id=latest['id']))}'><code>
{e(latest['id'][:16])}…</code></a> {_badge(latest['state'])}</td></tr>
<tr><th>steps</th><td>{latest['steps']}</td></tr>
<tr><th>updated</th><td>{_time(latest['updated_at'])}</td></tr>
{f"<tr><th colspan='2'>metrics committed by step {latest['steps'] - 1}</th></tr>" if values
 else ""}{values}</table>""" + (
        "" if latest_metrics else "<p class='empty'>The latest proof has committed no step "
        "metrics yet.</p>")
    proofs_html = (
        f"<form id='compare-form' method='get' action='{e(url('compare'))}'>"
        f"<table id='proofs'><tr><th>compare</th>{_PROOF_HEADS}</tr>"
        f"{_proof_rows(url, proofs, with_experiment=False, compare=True)}</table>"
        f"<button type='submit'>compare the checked runs (2 to {page_runs.MAX_COMPARED})"
        f"</button></form><h2>Metrics of {len(runs)} runs</h2>"
        f"<p class='muted'>The newest {page_runs.MAX_COMPARED} runs listed above, overlaid; "
        "hover a curve for its run and last value.</p>" + zoom + page_runs.overlay(runs))
  elif only:
    latest_html = ""
    proofs_html = "<p class='empty' id='no-proofs'>No proofs match the filter.</p>"
  else:
    latest_html = ""
    proofs_html = (f"<p class='empty'>No proofs yet. A run sends one with "
                   f"<code>dvbench.Client(URL).experiment(\"{e(full_name)}\").proof(backend="
                   "\"jax\")</code>.</p>")
  measured = "".join(
      f"<tr data-measurement='{e(m['id'])}' data-state='{e(m['state'])}'><td>{e(m['metric'])}</td>"
      f"<td class='num'>{m['value']:.6g}</td><td>{_badge(m['state'])}</td>"
      f"<td><a href='{e(url('proof_page', proof_id=m['proof_id']))}'>proof</a></td></tr>"
      for m in measurements)
  measured_html = (f"<table id='measurements'><tr><th>metric</th><th>value</th><th>state</th>"
                   f"<th></th></tr>{measured}</table>" if measurements else
                   "<p class='empty'>No measurements yet.</p>")
  return page(url, f"Experiment {full_name}", f"""{latest_html}{_attempts_html(attempts)}
<h2>Proofs</h2>{page_runs.filter_form(here, only, states)}{proofs_html}
<h2>Measurements</h2>{measured_html}""")


def _metric_text(value) -> str:
  """A committed metric value (JSON form) for a table cell."""
  if isinstance(value, float):
    return f"{value:.6g}"
  if isinstance(value, str) and len(value) == 64 and not value.startswith(("nan", "inf", "-")):
    return f"digest {value[:16]}…"
  return str(value)


def not_found(url: Url, message: str) -> str:
  return page(url, "Not found", f"<p class='empty' id='not-found'>{e(message)}</p>"
               f"<p><a href='{e(url('index'))}'>All experiments and proofs</a></p>")


def _bars(rows: list[dict]) -> str:
  """A horizontal bar chart of the ranked entries' values."""
  if not rows:
    return ""
  top = max(abs(r["value"]) for r in rows) or 1.0
  height, bar = 26 * len(rows) + 10, []
  for i, r in enumerate(rows):
    width = 300 * abs(r["value"]) / top
    name = r["experiment"] if len(r["experiment"]) <= 48 else r["experiment"][:47] + "…"
    bar.append(
        f"<text x='0' y='{26 * i + 22}' font-size='12'>{e(name)}<title>{e(r['experiment'])}"
        f"</title></text>"
        f"<rect x='320' y='{26 * i + 8}' width='{width:.1f}' height='18' fill='#1a7f37'>"
        f"<title>{r['value']:.6g}</title></rect>"
        f"<text x='{326 + width:.1f}' y='{26 * i + 22}' font-size='12'>{r['value']:.4g}</text>")
  return (f"<svg class='values' width='700' height='{height}' role='img' "
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
      f"<td class='name'>{experiment_link(url, m['experiment'])}</td><td>{e(m['metric'])}</td>"
      f"<td class='num'>{m['value']:.6g}</td><td>{_badge(m['state'])}</td>"
      f"<td class='num'>{m['sampled']} / {m['batches']}</td>"
      f"<td><a href='{e(url('proof_page', proof_id=m['proof_id']))}'>proof</a>"
      f"{'<br><span class=muted>' + e(m['failure']) + '</span>' if m['failure'] else ''}"
      f"</td></tr>" for m in measurements)
  return page(url, "Leaderboard", f"""
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
            ("escape_probability", "escape (1 − p; over the owner's attempts)"),
            ("start_attested", "start"),
            ("program_pinned", "program"), ("contamination", "contamination"),
            ("outside_training_set", "training set"), ("attempts", "owner's attempts"),
            ("proof", "proof"))


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
              f"registered training set'>outside: {outside}</span>") + (
      f"<br><span class='data-order'>data: {e(r['data'])}</span>")
  unranked = "" if r["ranked"] else (
      "<br><span class=muted>unranked: " + e("; ".join(r["unranked_because"])) + "</span>")
  state = _badge(r["state"]) + (
      f"<br><span class=muted>{e(r['failure'])}</span>" if r["failure"] else "") + unranked
  challenger = "DVBench" if r["challenger"] == "dvbench" else e(r["challenger"])
  return (f"<tr data-experiment='{e(r['experiment'])}' data-state='{e(r['state'])}' "
          f"data-ranked='{str(r['ranked']).lower()}' data-strict='{str(r['strict']).lower()}' "
          f"data-contamination='{r['contamination']}' data-outside='{outside}' "
          f"data-data='{e(r['data'])}'>"
          f"<td class='num'>{r['rank'] or ''}</td><td class='name'>"
          f"{experiment_link(url, r['experiment'])}</td>"
          f"<td class='num'>{value}</td><td>{state}</td><td>{challenger}</td>"
          f"<td class='num'>{r['checks_replayed']}</td>"
          f"<td class='num'>{r['update_check_probability']:g}</td>"
          f"<td class='num'>{_escape_cell(r['escape_probability'], r['attempts'])}</td>"
          f"<td>{_start_cell(url, r)}</td>"
          f"<td>{'pinned' if r['program_pinned'] else 'not pinned'}{programs}</td><td>{dirty}</td>"
          f"<td>{training}</td>{_attempts_cell(r['attempts'])}"
          f"<td><a href='{e(url('proof_page', proof_id=r['proof_id']))}'><code>"
          f"{e(r['proof_id'][:12])}…</code></a></td></tr>")


def _start_cell(url: Url, r: dict) -> str:
  """Where an entry's run started: from the key, a base checkpoint (and whose final params
  it is), or unattested."""
  if not r["start_attested"]:
    return "unattested"
  if r["base_checkpoint"] is None:
    return "attested"
  first = r["base_of"]
  of = "" if first is None else (
      f"<br><span class=muted>the final params of <a href='"
      f"{e(url('proof_page', proof_id=first['id']))}'>{e(first['experiment'])}</a></span>")
  return (f"<span title='declared by the prover, not trained here'>base checkpoint "
          f"<code>{e(r['base_checkpoint'][:12])}…</code></span>{of}")


def _pin_row(name: str, value) -> str:
  """A definition row for one start or probe pin (``pins.FIELDS``)."""
  shown = "not pinned" if value is None else (
      f"{value:g}" if isinstance(value, float) else f"<code>{e(value)}</code>")
  return f"<tr><th>{e(name.replace('_', ' '))}</th><td>{shown}</td></tr>"


def _escape_cell(per_attempt: float, attempts: dict | None) -> str:
  """The chance one faked segment escaped: per attempt and over the owner's attempts."""
  if not attempts or attempts.get("escape_probability_over_attempts") is None:
    return f"{per_attempt:.3g}"
  over = attempts["escape_probability_over_attempts"]
  return f"{per_attempt:.3g}<br><span class=muted>{over:.3g} over {attempts['slots']}</span>"


def _attempts_cell(attempts: dict | None) -> str:
  """The owner's proof slots, what became of them in the title (``attempts.describe``)."""
  if not attempts:
    return "<td>—</td>"
  return (f"<td class='num attempts' title='{e(attempts['summary'])}'>{attempts['slots']}"
          f"</td>")


def _training_set(pin: dict | None) -> str:
  if pin is None:
    return "not pinned (any rows)"
  return (f"{pin['size']} rows, Merkle root <code>{e(pin['root'][:16])}…</code>; probed rows "
          "must be proven members")


def benchmark(url: Url, bench: dict, entries: list[dict], sort: str, sorts) -> str:
  """A benchmark's definition and its leaderboard (``leaderboard.leaderboard_entries``);
  the headers of the columns in ``sorts`` link to the page sorted by them."""
  owner, name = bench["name"].split("/")
  here = url("benchmark_page", owner=owner, name=name)
  heads = "".join(
      f"<th data-column='{key}'>"
      + (f"<a href='{e(here)}?sort={key}'>{e(title)}</a>{' ▾' if key == sort else ''}"
         if key in sorts else e(title)) + "</th>" for key, title in _COLUMNS)
  pins = bench["allowed_programs"]
  return page(url, f"Benchmark {bench['name']}", f"""
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
<tr><th>training set</th><td>{_training_set(bench['training_set'])}</td></tr>
{''.join(_pin_row(name, bench[name]) for name in pins_lib.FIELDS)}
<tr><th>left open by the recipe</th><td id="left-open">{'<br>'.join(
    e(text) for text in bench['left_open']) or 'nothing'}</td></tr></table>
<p>Ranked: scored by the server, not a copy (one entry per proof and per checkpoint: a
checkpoint equal to the final params of a proof that closed earlier is that proof's), the proof
passes <code>zkdv verify --strict</code> (server challenges, exact replays, an attested start, a
program whose update reads the batch, probes), no probed training example is in the evaluation
set, where a training set is registered every probed row is proven (Merkle) to be in it, and
the start and probe ratio meet the pins above (a start from a base checkpoint only where the
benchmark pins that checkpoint). Equal values share a rank. Any other entry is shown with what it lacks and not ranked.</p>
{_bars([r for r in entries if r['ranked']])}
<table class="leaderboard" data-benchmark="{e(bench['name'])}"><tr>{heads}</tr>
{''.join(_entry(url, r) for r in entries)}</table>""")


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


def _config_html(url: Url, proof_id: str, config: dict) -> str:
  def pairs(items) -> str:
    return ", ".join(f"{e(k)} {e(v)}" for k, v in items) or "—"

  rows = [("proof name", e(config["name"]) or "—"),
          ("platform", f"{e(config['platform'])} ({e(', '.join(config['device_kinds']))}; "
                       f"{config['processes']} process{'es' if config['processes'] > 1 else ''})"),
          ("versions", pairs(config["versions"])), ("proof config", pairs(config["config"])),
          ("sampling policy", pairs(config["policy"]))]
  for p in config["programs"]:
    blob = (f" <a href='{e(url('proof_blob', proof_id=proof_id, digest=p['program_id']))}' "
            f"download>download program</a>" if p["program_id"] else "")
    rows.append((f"program {p['number']}", f"<code>{e(p['function'])}</code>, {e(p['mode'])} "
                 f"replay, {p['parameters']:,} parameters in {p['state_leaves']} state leaves"
                 f"{blob}<br>optimizer state: {e(', '.join(p['optimizer_state']) or '—')}"
                 f"<br>batch: {e('; '.join(p['batch']) or '—')}"
                 f"<br>static arguments: {pairs(p['static_arguments'])}"
                 f"<br>compiler options: {pairs(p['compiler_options'])}"
                 f"<br>platforms: {e(', '.join(p['platforms']))}; devices: {p['devices'] or 1}"
                 f"<br>metrics: {e(', '.join(p['metrics']) or '—')}"))
  declared = "".join(f"<tr data-key='{e(k)}'><th>{e(k)}</th><td>{e(v)}</td></tr>"
                     for k, v in config["declared"])
  declared_html = (
      f"<table id='declared'>{declared}</table>" if declared else
      "<p class='empty' id='no-declared'>None declared: pass <code>run_config={...}</code> to "
      "<code>experiment.proof</code>.</p>")
  return ("<div class='columns'><section><h3>Declared by the prover</h3><p class='muted'>"
          "Its run config, shown as declared and not verified.</p>" + declared_html
          + "</section><section><h3>Verified program</h3><p class='muted'>What the server "
          "replays: the exported program and the run's records.</p><table id='config'>"
          + "".join(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in rows)
          + "</table></section></div>")


def _metrics_html(url: Url, proof_id: str, curves: dict, marks: dict, digests: list[str],
                  steps: int, drawn: tuple[int, int], zoom: str, challenged: int) -> str:
  """The metric curves of the ``drawn`` steps with their ``marks`` (``challenged``: the
  update-challenged steps of the whole run)."""
  json_link = (f"<p><a href='{e(url('proof_metrics', proof_id=proof_id))}'>metrics as JSON</a>"
               f" · <a href='{e(url('proof_metrics_csv', proof_id=proof_id))}' download>"
               "metrics as CSV</a></p>")
  if not curves:
    if steps and drawn[1] < drawn[0]:
      return (f"{zoom}<p class='empty' id='no-metrics'>No step in the zoomed range: the run "
              f"has steps 0 to {steps - 1}.</p>")
    if not steps:
      reason = "no step has been stored."
    elif digests:
      reason = (f"the steps commit no scalar, only arrays by digest ({e(', '.join(digests))})."
                " Return scalars (a loss, an accuracy) beside the state to draw them.")
    else:
      reason = ("the steps return only the state. Return a loss or other values beside it "
                "(<code>return state.apply_gradients(grads=grads), {\"loss\": loss}</code>) "
                "and each step commits them.")
    return (f"<p class='empty' id='no-metrics'>No metrics yet: {reason}</p>"
            + (json_link if steps else ""))
  note = ("" if marks else "<p class='empty' id='no-marks'>"
          + (f"No step drawn here is challenged ({challenged} of the run's steps are)."
             if challenged else "No step is challenged yet, so no point is marked as "
             "replayed.") + "</p>")
  hashed = (f"<p id='digest-metrics'>Committed by digest (not scalars): "
            f"{e(', '.join(digests))}.</p>" if digests else "")
  if drawn != (0, steps - 1):
    note += (f"<p class='muted' id='drawn'>Drawn: steps {drawn[0]} to {drawn[1]} of {steps}; "
             "the JSON and CSV below hold every step.</p>")
  return (zoom + note + "".join(charts.metric_chart(n, points, marks) for n, points in curves.items())
          + hashed + json_link)


CHECKS_PAGE = 100  # rows of the proof page's checks table


def _probed(p: dict, probed_rows: int | None) -> str:
  """The proof page's count of probed rows; ``None`` until the proof's worker indexed them.

  >>> _probed({"state": "receiving"}, None)
  'counted when the server verifies the proof'
  """
  if probed_rows is not None:
    return str(probed_rows)
  if p["state"] in ("receiving", "closed", "verifying"):
    return "counted when the server verifies the proof"
  return "not counted: the server counts them for proofs it verified"


def proof(url: Url, p: dict, summary: dict, ticks: list[dict], replayed: dict,
          probed_rows: int | None, config: dict, curves: dict, marks: dict, digests: list[str],
          has_receipt: bool, drawn: tuple[int, int], checks_after: str | None,
          checks_next: str | None, table: list[dict], zoom: str = "") -> str:
  """The proof page; ``summary`` is ``labels.challenge_summary`` of the proof, ``ticks``
  its ``Store.check_ticks``, ``replayed`` ``labels.replayed_checks``, ``curves``
  ``run_view.scalar_curves``, ``marks`` ``run_view.step_marks`` of the drawn steps;
  ``table``: the page of checks listed after ``checks_after`` (``store.page_checks``),
  ``checks_next`` the cursor of the next one; ``drawn``: the first and last step drawn,
  under the ``zoom`` form."""
  here = url("proof_page", proof_id=p["id"])
  pager = ([f"<a rel='first' href='{e(here)}#checks'>first checks</a>"] if checks_after else [])
  if checks_next is not None:
    pager.append(f"<a rel='next' href='{e(here)}?checks_after={e(checks_next)}#checks'>"
                 "next checks →</a>")
  rows = "".join(
      f"<tr data-state='{e(c['status'])}'><td class='num'>{c['step']}</td><td>{e(c['kind'])}</td>"
      f"<td>{e(c['mode'])}</td><td>{_badge(c['status'])}</td>"
      f"<td class='num'>{c['max_abs_error']:.3g}</td><td class='num'>{c['max_ulp_error']}</td></tr>"
      for c in table)
  checks_html = (
      f"{charts.checks_chart(p['steps'], ticks)}<table id='checks'><tr><th>step</th>"
      f"<th>kind</th><th>mode</th><th>status</th><th>max abs error</th><th>max ulp</th></tr>"
      f"{rows}</table><p class='pager'>{replayed['checks']} checks, {CHECKS_PAGE} a page "
      f"{' · '.join(pager)}</p>" if replayed["checks"] else
      "<p class='empty' id='no-checks'>No checks replayed yet: the server's workers replay "
      "the checks it chose once the proof is closed"
      + (f" ({challenged} steps challenged so far)."
         if (challenged := summary["server_challenges"]["update"]) else ".") + "</p>")
  downloads = [f"<a href='{e(url('proof_transcript', proof_id=p['id']))}' download>transcript "
               "(records.cborl)</a>",
               f"<a href='{e(url('proof', proof_id=p['id']))}'>proof JSON</a>"]
  if has_receipt:
    downloads.append(f"<a href='{e(url('proof_receipt', proof_id=p['id']))}' download>"
                     "signed receipt</a>")
  return page(url, f"Proof {p['id'][:16]}…", f"""
<table id="summary">
<tr><th>experiment</th><td>{experiment_link(url, p['experiment'])}</td></tr>
<tr><th>run name</th><td id="run-name">{e(config['run_name']) or '—'}</td></tr>
<tr><th>tags</th><td id="tags">{page_runs.tags_html(config['tags']) or '—'}</td></tr>
<tr><th>transcript id</th><td><code>{e(p['id'])}</code></td></tr>
<tr><th>state</th><td>{_badge(p['state'])} <span id="label">{e(summary['label'])}</span></td></tr>
{_challenge_rows(summary)}
<tr><th>started</th><td>{_time(p['created_at'])}</td></tr>
<tr><th>ended</th><td>{_time(p['ended_at']) if p.get('ended_at') else 'still receiving'}</td></tr>
<tr><th>duration</th><td id="duration">{page_runs.timing(p)}</td></tr>
<tr><th>steps</th><td>{p['steps']}</td></tr><tr><th>records</th><td>{p['records']}</td></tr>
<tr><th>final params</th><td><code>{e(p['final_params'] or '—')}</code></td></tr>
<tr><th>distinct batch rows opened as probes</th><td id='probed-rows'>{_probed(p, probed_rows)}</td></tr>
<tr><th>data</th><td id="data">{e(summary['data'])}{'' if summary['dataset'] is None else
 f" over dataset <code>{e(summary['dataset'][:16])}…</code>"}</td></tr>
<tr><th>server-replayed checks</th><td>{replayed['checks_verified']} verified
 of {replayed['checks']}</td></tr>
<tr><th>downloads</th><td id="downloads">{' · '.join(downloads)}</td></tr></table>
{_attempts_html(summary.get('attempts'))}
<h2>Metrics over steps</h2>{_metrics_html(url, p['id'], curves, marks, digests, p['steps'],
                                          drawn, zoom, summary['server_challenges']['update'])}
<h2>Configuration</h2>{_config_html(url, p['id'], config)}
<h2 id="checks">Checks over steps</h2>{checks_html}""")
