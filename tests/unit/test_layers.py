"""The dependency direction of docs/architecture.md, checked on every module of the three packages.

Imports are read from the source (every `import` statement, also those inside functions), so a lazy
import cannot hide an edge; every module is also imported for real, so a broken import fails here.

    pure, starts nothing   schema, errors, config, sharding (layouts, shard declarations, the sync layout),
                           model shapes, placement, resharding specs and plans, micro-batch balancing: no
                           torch at all
    pure                   + algorithms, data, batch, parity, moe (routes, expert balancing): torch allowed,
                           never torch.distributed, ray or vllm
    torch side             model, parallel trainer, weight_sync executors: never ray or vllm, and
                           the two never import each other's torch code (specs and plans are shared)
    roles                  actors: ray and vllm live here
    top                    the driver and the CLI: the only rlhf modules that import actors
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlhf", "actors", "weight_sync")
# A file grows until it holds two concepts, then splits along the seam between them, not at a count of lines;
# past this many it almost surely holds two (a smell alarm, not the rule that decides a split)
MAX_LINES = 800

NO_TORCH = ("rlhf.schema", "rlhf.errors", "rlhf.config", "rlhf.sharding", "rlhf.model.shapes",
            "rlhf.placement", "rlhf.micro_batches",
            "rlhf.sim", "weight_sync.spec", "weight_sync.plan")
PURE = NO_TORCH + ("rlhf.algorithms", "rlhf.data", "rlhf.batch", "rlhf.parity", "rlhf.moe")
TOP = ("rlhf.driver", "rlhf.cli")  # may import actors
ROLE_LAYER = ("actors",) + TOP  # may import ray and vllm
TORCH_SIDES = (("rlhf.model", "rlhf.parallel"), ("weight_sync",))  # neither imports the other's torch code
SHARED_BY_SIDES = ("rlhf.model.shapes", "rlhf.sharding",
                   "weight_sync.spec", "weight_sync.plan", "weight_sync.pieces", "weight_sync.store")


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(module: str, path: Path) -> set[str]:
    """Every module `module` imports, internal ones resolved to the module (not the name) imported."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _internal(targets) -> set[str]:
    return {t for t in targets if t in MODULES}


def _closure(module: str) -> set[str]:
    """`module` and every internal module it reaches."""
    seen, todo = {module}, [module]
    while todo:
        for t in _internal(GRAPH[todo.pop()]):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def _external(modules) -> set[str]:
    return {t for m in modules for t in GRAPH[m] if t not in MODULES}


def _unit(module: str) -> str:
    """Sub-package (rlhf.config, rlhf.placement, ...), or the module itself for rlhf's own modules; the
    other two packages are one unit each."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "rlhf" else parts[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_imports():
    for module in MODULES:
        importlib.import_module(module)


def test_every_import_of_ours_names_a_module_that_exists():
    """Also inside functions, where importing the module above does not reach."""
    bad = {m: sorted(t for t in targets if t.split(".")[0] in PACKAGES and t not in MODULES)
           for m, targets in GRAPH.items()}
    assert not {m: t for m, t in bad.items() if t}


@pytest.mark.parametrize("module", [m for m in MODULES if _within(m, PURE)])
def test_the_pure_layer_needs_no_ray_vllm_or_torch_distributed(module):
    reached = _closure(module)
    bad = sorted(t for t in _external(reached) if _within(t, ("ray", "vllm", "torch.distributed")))
    assert not bad, f"{module} reaches {bad} through {sorted(reached - {module})}"
    assert not [m for m in reached if _within(m, ("actors",))], f"{module} reaches the actors"
    if _within(module, NO_TORCH):
        torch = sorted(t for t in _external(reached) if _within(t, ("torch",)))
        assert not torch, f"{module} (starts nothing: `rlhf plan`, config checks) reaches {torch}"


def test_below_the_driver_rlhf_never_imports_actors():
    bad = {m: sorted(t for t in GRAPH[m] if _within(t, ("actors",)))
           for m in MODULES if m.startswith("rlhf") and not _within(m, TOP)}
    assert not {m: t for m, t in bad.items() if t}


def test_only_actors_and_the_driver_touch_ray_and_vllm():
    bad = {m: sorted(t for t in GRAPH[m] if _within(t, ("ray", "vllm")))
           for m in MODULES if not _within(m, ROLE_LAYER)}
    assert not {m: t for m, t in bad.items() if t}


# the run's components and the rollout sources are built by the run and driven by the loop: they reach
# neither (a new source or component plugs in without the loop or the run changing to know it)
DRIVER_PARTS = ("rlhf.driver.record", "rlhf.driver.expert_balance", "rlhf.driver.faults", "rlhf.driver.sources",
                "rlhf.driver.stale_sync")


@pytest.mark.parametrize("module", DRIVER_PARTS)
def test_the_runs_components_and_the_rollout_sources_reach_neither_the_run_nor_the_loop(module):
    assert module in MODULES
    assert not sorted(t for t in _closure(module) if t in ("rlhf.driver.run", "rlhf.driver.loop"))


def test_the_two_torch_sides_do_not_import_each_other():
    for side, other in (TORCH_SIDES, TORCH_SIDES[::-1]):
        for m in MODULES:
            if _within(m, side):
                bad = sorted(t for t in _internal(GRAPH[m]) if _within(t, other) and not _within(t, SHARED_BY_SIDES))
                assert not bad, f"{m} imports {bad}"


def test_no_cycle_between_files():
    assert _cycles({m: _internal(t) for m, t in GRAPH.items()}) == []


def test_no_cycle_between_sub_packages():
    units: dict[str, set[str]] = {}
    for m, targets in GRAPH.items():
        units.setdefault(_unit(m), set()).update(_unit(t) for t in _internal(targets) if _unit(t) != _unit(m))
    assert _cycles(units) == []


def test_no_library_file_over_the_smell_alarm():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these along a seam a reader would recognise: {long}"


def test_the_checks_see_what_they_check():
    """The graph is read right: known edges are there, so the rules above cannot pass by reading nothing."""
    assert "actors.roles" in _closure("rlhf.driver.loop")
    assert "weight_sync.plan" in GRAPH["rlhf.placement.transfer"]
    assert "rlhf.schema" in _closure("rlhf.placement")
    assert {"ray", "vllm"} <= {t.split(".")[0] for t in _external(_closure("rlhf.driver.loop"))}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
