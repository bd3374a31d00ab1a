"""The package order of docs/architecture.md, read from the source: no module of tidal imports a
package above its own, no two packages import each other, and no import cycle joins files.

Every import counts: module level, inside functions and under `if TYPE_CHECKING`, relative ones
resolved. `from pkg import name` is an import of the module `pkg.name` when there is one, else of
`pkg`; importing a submodule is not counted as importing its parent package's `__init__` (Python
runs the parent first for any import below it, so that edge would be everywhere). The checker
is run on a small package with planted violations too, so that a checker that sees nothing
cannot pass.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TIDAL = Path(__file__).resolve().parent.parent / "tidal"

# Lowest first. A package may import its own layer's packages and those below; the `tidal`
# package itself (tidal/__init__.py: cache_root) is in the lowest layer.
LAYERS = [
    {"tidal", "types", "algorithms", "net", "importing", "images", "durable"},
    {"config"},
    {"models", "sandbox"},
    {"engines", "trainer", "envs", "rewards", "weightsync", "monitor"},
    {"runtime", "plan"},
    {"cli", "recipes", "launch"},
]


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path, modules: set[str], top: str) -> set[str]:
    """The modules of the package named `top` that `module` (in file `path`) imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def known(name: str) -> str | None:  # the longest prefix of `name` that is a module
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [known(a.name) for a in node.names if a.name.split(".")[0] == top]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != top:
                continue
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else known(source) for a in node.names]
        else:
            continue
        found.update(t for t in targets if t and t != module)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(package: str, layers: list[set[str]]) -> int | None:
    return next((i for i, names in enumerate(layers) if package in names), None)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def problems(root: Path, layers: list[set[str]]) -> list[str]:
    """Every breach of the order under `root`, as sentences; empty when there is none."""
    files = module_files(root)
    top = root.name
    edges = {m: imports_of(m, p, set(files), top) for m, p in files.items()}
    out = []
    package_edges: dict[str, set[str]] = defaultdict(set)
    for a, targets in sorted(edges.items()):
        la = layer_of(package_of(a), layers)
        if la is None:
            out.append(f"{a}: package `{package_of(a)}` has no place in the order (add it to LAYERS and the docs)")
            continue
        for b in sorted(targets):
            lb = layer_of(package_of(b), layers)
            if lb is not None and lb > la:
                out.append(f"{a} imports {b}: `{package_of(b)}` is above `{package_of(a)}`")
            if package_of(a) != package_of(b):
                package_edges[package_of(a)].add(package_of(b))
    for a, bs in sorted(package_edges.items()):
        out.extend(f"packages `{a}` and `{b}` import each other" for b in sorted(bs) if a < b and a in package_edges[b])
    out.extend("import cycle: " + " <-> ".join(c) for c in cycles(edges))
    return out


def test_tidal_keeps_the_package_order_with_no_import_cycle():
    found = problems(TIDAL, LAYERS)
    assert not found, "\n".join(found)


def test_the_checker_finds_climbs_package_pairs_and_cycles(tmp_path):
    """A positive control: a package with one breach of each kind, planted at module level,
    inside a function, and through a relative import."""
    pkg = tmp_path / "tidal"
    files = {
        "__init__.py": "",
        "types.py": "",
        "config.py": "def f():\n    from tidal.runtime import loop\n",  # a climb, inside a function
        "runtime/__init__.py": "",
        "runtime/loop.py": "from tidal import types\nfrom . import helper\n",
        "runtime/helper.py": "from .loop import x\n",  # a cycle with loop.py, relative
        "envs/__init__.py": "from tidal.rewards import score\n",
        "rewards/__init__.py": "",
        "envs/base.py": "",
        "rewards/score.py": "import tidal.envs.base\n",  # envs and rewards import each other
        "newpkg/__init__.py": "",  # a package with no layer
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    found = problems(pkg, LAYERS)
    assert found == [
        "tidal.config imports tidal.runtime.loop: `runtime` is above `config`",
        "tidal.newpkg: package `newpkg` has no place in the order (add it to LAYERS and the docs)",
        "packages `envs` and `rewards` import each other",
        "import cycle: tidal.runtime.helper <-> tidal.runtime.loop",
    ], found


def third_party_imports(path: Path, top: str) -> set[str]:
    """The dotted names under the package `top` (a third-party one) that a file imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        out.update(n for n in names if n.split(".")[0] == top)
    return out


def test_ray_is_imported_in_the_runtime_and_the_ray_reward_pool_only():
    """docs/architecture.md: Ray is the runtime's (placement, handles, workers, weight sync) and
    the Ray backend of the reward pool's; Ray's private modules only in placement's loopback switch."""
    users = {str(p.relative_to(TIDAL.parent)): third_party_imports(p, "ray") for p in TIDAL.rglob("*.py")}
    users = {p: names for p, names in users.items() if names}
    assert users, "no module imports ray: the check reads nothing"
    outside = sorted(p for p in users if not p.startswith("tidal/runtime/") and p != "tidal/rewards/pool_ray.py")
    assert not outside, f"ray imported outside tidal/runtime/ and tidal/rewards/pool_ray.py: {outside}"
    private = sorted(p for p, names in users.items() if any("._" in n or n.startswith("ray._") for n in names))
    assert private == ["tidal/runtime/placement.py"], private


def test_the_architecture_page_places_every_package():
    """docs/architecture.md's table of packages names each package of LAYERS, in its layer."""
    doc = (TIDAL.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit() and cells[1].startswith("`tidal/"):
            rows[cells[1].strip("`").removeprefix("tidal/").removesuffix("/").removesuffix(".py")] = int(cells[0])
    want = {name: i + 1 for i, names in enumerate(LAYERS) for name in names if name != "tidal"}
    assert rows == want
