"""Server-rendered HTML: experiments and their proofs' verification state."""

import datetime
import html

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #1b1f24; }
table { border-collapse: collapse; margin-bottom: 2rem; }
th, td { border-bottom: 1px solid #d0d7de; padding: .35rem .8rem; text-align: left; }
th { background: #f6f8fa; }
.state { font-weight: 600; border-radius: 1rem; padding: .1rem .6rem; }
.verified { background: #dafbe1; color: #1a7f37; }
.invalid { background: #ffebe9; color: #cf222e; }
.receiving, .closed, .verifying { background: #fff8c5; color: #7d4e00; }
code { font-size: .85em; }
"""


def _time(t: float) -> str:
  return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def index(experiments: list[dict], proofs: list[dict]) -> str:
  e = html.escape
  rows = []
  for p in proofs:
    rows.append(
        f"<tr data-proof='{e(p['id'])}'><td>{e(p['experiment'])}</td>"
        f"<td><code>{e(p['id'][:16])}…</code></td><td>{p['steps']}</td><td>{p['records']}</td>"
        f"<td><span class='state {e(p['state'])}'>{e(p['state'])}</span></td>"
        f"<td>{e(p['failure'] or '')}</td><td>{_time(p['updated_at'])}</td></tr>")
  exp_rows = "".join(
      f"<tr><td>{e(x['full_name'])}</td>"
      f"<td>{sum(p['experiment'] == x['full_name'] for p in proofs)}</td></tr>"
      for x in experiments)
  return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>DVBench</title>
<style>{_STYLE}</style></head><body>
<h1>DVBench</h1>
<p>Proofs are verified by server-side replay of their sampled checks; only
<span class="state verified">verified</span> proofs count.</p>
<h2>Experiments</h2>
<table id="experiments"><tr><th>experiment</th><th>proofs</th></tr>{exp_rows}</table>
<h2>Proofs</h2>
<table id="proofs"><tr><th>experiment</th><th>transcript</th><th>steps</th><th>records</th>
<th>state</th><th>failure</th><th>updated</th></tr>{''.join(rows)}</table>
</body></html>"""
