"""The README and docs/: every relative link leads to a file, every #anchor to a heading."""

import pathlib
import re

from absl.testing import absltest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(markdown: str) -> set[str]:
  """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to '-'.

  >>> anchors("## Several devices and several processes")
  {'several-devices-and-several-processes'}
  """
  headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def pages() -> list[pathlib.Path]:
  return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


class DocsTest(absltest.TestCase):

  def test_every_relative_link_resolves(self):
    checked = 0
    for page in pages():
      for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
          continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        with self.subTest(page=page.name, link=target):
          self.assertTrue(file.exists(), f"{page.name}: {target} leads nowhere")
          if anchor:
            self.assertIn(anchor, anchors(file.read_text()), f"{page.name}: {target}")
        checked += 1
    self.assertGreater(checked, 5)

  def test_the_readme_sends_each_topic_to_its_page(self):
    readme = (ROOT / "README.md").read_text()
    for page in ("docs/protocol.md", "docs/operating.md", "docs/benchmarks.md",
                 "docs/jax.md", "docs/verify.md"):
      self.assertIn(f"]({page})", readme)
    self.assertLess(len(readme), 12_000)  # a quick start, not the reference


if __name__ == "__main__":
  absltest.main()
