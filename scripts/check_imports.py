#!/usr/bin/env python3
"""Checks the import graph of zkdv/ and dvbench/, imports inside functions included.

It fails (exit 1, one line per problem) on:
- a cycle between modules (a function-level import that closes one counts: it only
  hides the cycle until the function runs);
- a client module (``dvbench/`` outside ``dvbench/server/``, except the ``dvbench``
  command, which starts the server) importing anything from ``dvbench/server/``;
- ``jax._src`` imported anywhere but the compatibility modules (``zkdv/jax/_compat.py``,
  and ``zkdv/interpreters/_compat.py`` for the update finder): JAX's private API.

An import of ``a.b.c`` is an edge to the module ``a.b.c`` only, not to the packages
``a`` and ``a.b`` that Python also initializes: a package's ``__init__`` that
re-exports its modules would otherwise be a cycle with each of them.

Example::

  $ python scripts/check_imports.py
  import graph: 96 modules, 329 edges: no cycle, no client->server import, no private JAX
  outside _compat
"""

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("zkdv", "dvbench")
SERVER = "dvbench.server"
# dvbench modules that may import the server: the command that runs it.
SERVER_COMMANDS = frozenset({"dvbench.cli"})
PRIVATE_JAX = "jax._src"
# The compatibility modules: zkdv/jax/_compat.py, and the update finder's own (it sits below
# zkdv.jax, whose __init__ it cannot import: see zkdv/interpreters/_compat.py).
PRIVATE_JAX_HOMES = frozenset({"zkdv.jax._compat", "zkdv.interpreters._compat"})


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
  """{module name: file} of every module of the packages."""
  return {module_name(p): p for package in PACKAGES
          for p in sorted((ROOT / package).rglob("*.py"))}


def imported_modules(path: pathlib.Path, name: str, known: dict) -> list[tuple[str, int]]:
  """(dotted name, line) of every import in the file, at any depth: ``import a.b`` gives
  ``a.b``; ``from a import b`` gives ``a.b`` where that is one of our modules, else ``a``
  (a name defined in a's module or ``__init__``)."""
  is_package = path.name == "__init__.py"
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found += [(alias.name, node.lineno) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        package = name.split(".") if is_package else name.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
      for alias in node.names:
        full = f"{base}.{alias.name}"
        found.append((full if full in known else base, node.lineno))
  return found


def graph(known: dict) -> tuple[dict[str, set[str]], list[str]]:
  """({module: our modules it imports}, problems other than cycles)."""
  edges, problems = {m: set() for m in known}, []
  for name, path in known.items():
    client = name.startswith("dvbench") and not name.startswith(SERVER)
    for dotted, line in imported_modules(path, name, known):
      where = f"{path.relative_to(ROOT)}:{line}"
      if (dotted == PRIVATE_JAX or dotted.startswith(PRIVATE_JAX + ".")) and (
          name not in PRIVATE_JAX_HOMES):
        problems.append(f"{where}: imports {dotted} (private JAX belongs in "
                        "zkdv/jax/_compat.py)")
      if dotted not in known or dotted == name:
        continue
      edges[name].add(dotted)
      if client and name not in SERVER_COMMANDS and (dotted == SERVER
                                                      or dotted.startswith(SERVER + ".")):
        problems.append(f"{where}: client module {name} imports {dotted} (move what both "
                        "need out of dvbench/server/)")
  return edges, problems


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  sys.setrecursionlimit(10000)
  for v in sorted(edges):
    if v not in index:
      visit(v)
  return found


def main() -> int:
  known = modules()
  edges, problems = graph(known)
  for component in cycles(edges):
    inside = [f"{a} -> {b}" for a in component for b in sorted(edges[a]) if b in component]
    problems.append(f"import cycle among {', '.join(component)}: {'; '.join(inside)}")
  for problem in problems:
    print(problem)
  total = sum(len(e) for e in edges.values())
  if problems:
    print(f"import graph: {len(known)} modules, {total} edges: {len(problems)} problems")
    return 1
  print(f"import graph: {len(known)} modules, {total} edges: no cycle, no client->server "
        "import, no private JAX outside _compat")
  return 0


if __name__ == "__main__":
  sys.exit(main())
