"""The import graph of zkdv/ and dvbench/ (``scripts/check_imports.py``): no cycle, also
through imports inside functions; the client imports nothing from dvbench/server/; private
JAX only in the compatibility modules."""

import pathlib
import subprocess
import sys
import tempfile

from absl.testing import absltest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_imports.py"


def check(root: pathlib.Path) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(root / "scripts" / "check_imports.py")],
                        capture_output=True, text=True, timeout=60, check=False)


class ImportGraphTest(absltest.TestCase):

  def test_the_repository_passes(self):
    done = check(ROOT)
    self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
    self.assertIn("no cycle", done.stdout)

  def test_each_rule_fails_a_tree_that_breaks_it(self):
    root = pathlib.Path(tempfile.mkdtemp())
    files = {
        "scripts/check_imports.py": SCRIPT.read_text(),
        "zkdv/__init__.py": "",
        "zkdv/a.py": "from zkdv import b\n",
        "zkdv/b.py": "def later():\n  from zkdv import a  # closes a cycle inside a function\n",
        "zkdv/jax/__init__.py": "",
        "zkdv/jax/_compat.py": "from jax._src import core\n",  # allowed here
        "zkdv/jax/stablehlo.py": "def f():\n  import jax._src.interpreters.mlir\n",
        "dvbench/__init__.py": "",
        "dvbench/client.py": "from dvbench.server import scoring\n",
        "dvbench/cli.py": "def serve():\n  from dvbench.server import app\n",  # the command
        "dvbench/server/__init__.py": "",
        "dvbench/server/app.py": "",
        "dvbench/server/scoring.py": "",
    }
    for name, text in files.items():
      (root / name).parent.mkdir(parents=True, exist_ok=True)
      (root / name).write_text(text)
    done = check(root)
    self.assertEqual(done.returncode, 1, done.stdout)
    problems = done.stdout.splitlines()[:-1]
    self.assertLen(problems, 3, done.stdout)
    self.assertIn("import cycle among zkdv.a, zkdv.b: zkdv.a -> zkdv.b; zkdv.b -> zkdv.a",
                  done.stdout)
    self.assertIn("zkdv/jax/stablehlo.py:2: imports jax._src.interpreters.mlir", done.stdout)
    self.assertIn("dvbench/client.py:1: client module dvbench.client imports "
                  "dvbench.server.scoring", done.stdout)


if __name__ == "__main__":
  absltest.main()
