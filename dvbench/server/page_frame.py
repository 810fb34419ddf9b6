"""The frame of every server-rendered page: navigation, title, stylesheet, and links that
several pages draw (``page`` and ``page_runs`` both build on it).

Example::

  html = page(url, "Compare 2 runs", body)  # body: HTML, escaped by the caller
"""

import html
from collections.abc import Callable

e = html.escape
Url = Callable[..., str]  # url(name, **params): the app's named routes


def page(url: Url, title: str, body: str) -> str:
  """A whole page: the navigation, ``title`` and ``body`` (HTML, escaped by the caller)."""
  return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)} · DVBench</title>
<link rel="stylesheet" href="{e(url('static', path='/style.css'))}"></head><body>
<nav><a href="{e(url('index'))}">Experiments and proofs</a><a href="{e(url('leaderboard'))}">Leaderboard</a></nav>
<h1>{e(title)}</h1>
{body}
</body></html>"""


def experiment_link(url: Url, full_name: str) -> str:
  owner, name = full_name.split("/", 1)
  return (f"<a class='experiment' href='{e(url('experiment_page', owner=owner, name=name))}'>"
          f"{e(full_name)}</a>")
