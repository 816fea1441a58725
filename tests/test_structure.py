"""The package's shape: no import cycle among rollout's modules (lazy imports inside functions included), one
policy registry that holds every policy class, and a policy package that imports no vLLM."""

import ast
import inspect
from pathlib import Path

import rollout.policy
from rollout.policy import POLICIES, Policy

ROOT = Path(rollout.policy.__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        # A package's own __init__ runs first on any import of its submodules: it is not an edge of the cycle.
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def test_no_module_of_rollout_imports_itself_through_others():
    graph = imports()
    assert "rollout.policy.base" in graph and "rollout.vllm.scheduler" in graph
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name, path):
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path, name, target]))
            if target not in state:
                visit(target, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_policy_base_imports_no_policy_and_no_module_imports_vllm_in_the_policy_package():
    graph = imports()
    assert not {t for t in graph["rollout.policy.base"] if t not in ("rollout.policy.config",
                                                                      "rollout.policy.length_stats")}
    for path in (ROOT / "policy").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] == "vllm"], path


def test_one_registry_holds_every_policy_class_by_its_name():
    classes = {cls for module in (rollout.policy.policies, rollout.policy.forecast, rollout.policy.oracle)
               for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, Policy) and cls is not Policy and cls.__module__ == module.__name__}
    assert classes == set(POLICIES.values())
    assert all(POLICIES[cls.name] is cls for cls in classes)
    assert {"static", "memory", "memory-clt", "sla", "forecast", "oracle"} <= set(POLICIES)


def test_the_package_is_licensed_under_apache_2():
    """The license the installed package declares, and its text at the repository's root, shipped with it."""
    from importlib.metadata import distribution

    meta = distribution("rollout").metadata
    assert meta["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in meta.get_all("License-File")
    text = (ROOT.parent / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
