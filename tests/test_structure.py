"""The code's shape, enforced: no import cycles, dependencies that point down the layers,
models/ independent of train/ (it imports nothing from it), and no backend library imported on
the training path outside train/strategy/ (the import rule).

Reads every module under train/ and models/ with `ast` (nothing is imported) and builds the
graph of their imports of each other, in-function imports included (an import deferred into a
function is still a dependency: hiding a cycle that way is what this test forbids).
"""

from __future__ import annotations

import ast
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("train", "models")

# Layers, top to bottom; a module imports its own layer or lower ones, never higher. A module
# belongs to the layer of its longest matching prefix: models.config (the run file's model
# section) and models.errors (the user-error classes) sit at the bottom with train.config and
# train.errors, which import them, while the rest of models/ is a component.
LAYERS = [
    ("entry points", ("zerotrain.train.main", "zerotrain.train.cli")),
    ("commands", ("zerotrain.train.commands",)),
    ("training", ("zerotrain.train.training", "zerotrain.train.args")),
    ("planner", ("zerotrain.train.plan",)),
    ("strategy", ("zerotrain.train.strategy",)),
    ("components", ("zerotrain.train.checkpoint", "zerotrain.train.observe", "zerotrain.train.launch", "zerotrain.train.data", "zerotrain.train.optim",
                    "zerotrain.models")),
    ("config", ("zerotrain.train.config", "zerotrain.train.strategy.ds_config", "zerotrain.train.strategy.internals", "zerotrain.train.strategy.registry", "zerotrain.train.strategy.precision", "zerotrain.train.errors", "zerotrain.train.paths",
                "zerotrain.train.cli_args", "zerotrain.models.config", "zerotrain.models.errors", "zerotrain.train.testhooks", "zerotrain.train.process_group")),
]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            name = "zerotrain." + ".".join(path.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    assert "import" not in mods.pop("zerotrain.train").read_text()  # train/__init__.py: a docstring, no layer
    return mods


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules `path` imports: import statements, and any string naming a known module (an
    `importlib.import_module("train.x")`, a `sys.modules.get("train.x")`, a dispatch table's
    entry): a dependency hidden in a string is still a dependency."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
            out.add(node.value)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from train import x` imports train.x
    return {m for m in out if m in known}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(path, set(mods)) - {name} for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_models_import_nothing_from_train():
    """Models build nn.Modules from their own config section (models/config.py) and raise their own
    error classes (models/errors.py); data, launch, training and checkpoints are train/'s."""
    graph = _graph()
    bad = {f"{m} imports {d}" for m, deps in graph.items() if m.split(".")[1] == "models"
           for d in deps if d.split(".")[1] == "train"}
    assert not bad, sorted(bad)


def test_library_code_does_not_import_the_commands():
    """train/main.py and train/cli.py are entry points: nothing below them imports them."""
    graph = _graph()
    entry = {"zerotrain.train.main", "zerotrain.train.cli"}
    bad = {f"{m} imports {d}" for m, deps in graph.items() if m not in entry for d in deps & entry}
    assert not bad, sorted(bad)


def _layer(module: str) -> int:
    found = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
             if module == p or module.startswith(p + ".")]
    if not found:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {__file__}")
    return max(found)[1]  # the longest prefix: models.config is "config", models.gpt "components"


def test_dependencies_point_down_the_layers():
    graph = _graph()
    bad = [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]})"
           for m, deps in sorted(graph.items()) for d in sorted(deps) if _layer(d) < _layer(m)]
    assert not bad, bad


def test_test_modules_share_helpers_not_each_other():
    """Shared test code lives in tests/helpers.py (functions) and tests/conftest.py (fixtures):
    a test module importing another one runs that module's imports and hides where a helper is."""
    bad = []
    for path in sorted((REPO / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            bad += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not bad, bad


def test_only_zerotrain_import_unpickles():
    """Unpickling is confined to `zerotrain import` (issue 16): train/checkpoint/safe_unpickle.py is the
    only module that imports pickle or calls torch.load (besides models/vision.py's
    weights_only=True read of torchvision weights), and only the import command and its reader
    import it, so training and resuming cannot reach it."""
    mods = _modules()
    users = set()
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(a.name in ("pickle", "dill", "cloudpickle") for a in node.names):
                users.add(name)
            elif isinstance(node, ast.ImportFrom) and node.module in ("pickle", "dill", "cloudpickle"):
                users.add(name)
            elif isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name) \
                    and node.value.id == "torch":
                users.add(name)
    assert users == {"zerotrain.train.checkpoint.safe_unpickle", "zerotrain.models.vision"}, sorted(users)
    graph = _graph()
    importers = {m for m, deps in graph.items() if "zerotrain.train.checkpoint.safe_unpickle" in deps}
    assert importers == {"zerotrain.train.checkpoint.importer"}, importers
    assert {m for m, deps in graph.items() if "zerotrain.train.checkpoint.importer" in deps} == {"zerotrain.train.commands.import_ckpt"}


MAX_FUNCTION_LINES = 80


def test_every_production_function_fits_on_a_screen():
    """No function in train/ or models/ is over MAX_FUNCTION_LINES lines (decorators excluded,
    nested functions counted in their parent): a long function is a set of named steps waiting
    to be written (DEVELOPERS.md, Layout)."""
    long = []
    for name, path in sorted(_modules().items()):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_the_layering_sees_imports_hidden_in_strings(tmp_path):
    """`sys.modules.get("zerotrain.train.launch.distributed")` in a bottom-layer module was an upward
    dependency the layering could not see."""
    f = tmp_path / "m.py"
    f.write_text('import sys, importlib\nsys.modules.get("zerotrain.train.launch.distributed")\n'
                 'importlib.import_module("zerotrain.train.plan.estimate")\n')
    assert _imports(f, {"zerotrain.train.launch.distributed", "zerotrain.train.plan.estimate", "zerotrain.train.cli"}) == {
        "zerotrain.train.launch.distributed", "zerotrain.train.plan.estimate"}


# Asking which backend or ZeRO stage runs is train/strategy/'s job (one object per backend owns what
# differs). Outside it at most MAX_BACKEND_TESTS such tests remain, each with a "backend-test:"
# comment on its line saying why it cannot ask the strategy.
BACKEND_TEST = re.compile(r"is_deepspeed|is_zero3|zero_stage|\bstage\s*(==|!=|>=|<=|<|>|in\b)|backend\s*(==|!=)")
MAX_BACKEND_TESTS = 5


def _backend_tests(path: Path) -> list[tuple[int, str, bool]]:
    """(line, code, has a "backend-test:" comment) for each line whose code, strings and comments
    removed, tests the backend or the ZeRO stage."""
    code, why = {}, set()
    with open(path, "rb") as f:
        for tok in tokenize.tokenize(f.readline):
            if tok.type == tokenize.COMMENT and "backend-test:" in tok.string:
                why.add(tok.start[0])
            elif tok.type not in (tokenize.COMMENT, tokenize.STRING, tokenize.ENCODING):
                code[tok.start[0]] = code.get(tok.start[0], "") + " " + tok.string
    return [(n, text.strip(), n in why) for n, text in sorted(code.items()) if BACKEND_TEST.search(text)]


def test_only_the_strategy_package_asks_which_backend_runs():
    found = []
    for name, path in sorted(_modules().items()):
        if name.startswith("zerotrain.train.strategy"):
            continue
        found += [(f"{path.relative_to(REPO)}:{n}", text, ok) for n, text, ok in _backend_tests(path)]
    undocumented = [f"{where}: {text}" for where, text, ok in found if not ok]
    assert not undocumented, f"say why with a 'backend-test:' comment, or ask the Strategy: {undocumented}"
    assert len(found) <= MAX_BACKEND_TESTS, [f"{where}: {text}" for where, text, _ in found]


def test_the_backend_test_count_sees_code_not_text(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('x = "is_deepspeed"  # is_zero3\nif ds.stage == 3:  # backend-test: a reason\n    pass\n'
                 'y = ds.is_deepspeed\n')
    assert [(n, ok) for n, _, ok in _backend_tests(f)] == [(2, True), (4, False)]


# The training path outside train/strategy/ imports no backend library and not the strategy's
# private-attribute module: a backend is its strategy (its registry entry, its hooks), so adding one
# touches train/strategy/ only. Imports inside functions count, and so do importlib.import_module /
# __import__ calls naming one and lookups in sys.modules (reading a module someone else loaded).
# Tools about DeepSpeed itself (the importer of its checkpoints, the
# op prebuild command: train/commands/, not on the training path) may.
BACKEND_MODULES = ("deepspeed", "torch.distributed.fsdp", "zerotrain.train.strategy.internals")
TRAINING_PATH = ("zerotrain.train.training", "zerotrain.train.plan", "zerotrain.train.observe", "zerotrain.train.launch",
                 "zerotrain.train.optim", "zerotrain.train.data", "zerotrain.train.checkpoint", "zerotrain.models")
MAY_IMPORT_BACKENDS = {"zerotrain.train.checkpoint.importer"}  # reads DeepSpeed's own checkpoints


def _is_sys_modules(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _named_module(node) -> str | None:
    """The module a node imports by name without an import statement: importlib.import_module("m"),
    __import__("m"), sys.modules["m"], sys.modules.get("m"), "m" in sys.modules."""
    def text(n):
        return n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None
    if isinstance(node, ast.Call) and node.args:
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if func in ("import_module", "__import__") or (func == "get" and _is_sys_modules(node.func.value)):
            return text(node.args[0])
    if isinstance(node, ast.Subscript) and _is_sys_modules(node.value):
        return text(node.slice)
    if isinstance(node, ast.Compare) and any(_is_sys_modules(c) for c in node.comparators):
        return text(node.left)
    return None


def _backend_imports(path: Path) -> list[str]:
    """`line: module` for each import (statement, call or sys.modules lookup) of a
    BACKEND_MODULES module, or of one inside it, in `path`."""
    def forbidden(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in BACKEND_MODULES)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # `from torch.distributed import fsdp`
        elif _named_module(node):
            names = [_named_module(node)]
        hits = [n for n in names if forbidden(n)]
        if hits:
            found.append(f"{node.lineno}: {hits[0]}")
    return found


def test_the_training_path_outside_the_strategy_imports_no_backend():
    bad = {name: found for name, path in sorted(_modules().items())
           if name.startswith(TRAINING_PATH) and name not in MAY_IMPORT_BACKENDS and (found := _backend_imports(path))}
    assert not bad, f"ask the Strategy (or a hook it gives), never the backend's library: {bad}"


def test_the_import_rule_fails_on_a_planted_import(tmp_path):
    """A copy of a train/training module with `import deepspeed` planted in one of its functions,
    and the other forms the rule sees, each fails it; the module as it is passes."""
    source = (REPO / "train" / "training" / "assembly.py").read_text()
    assert _backend_imports(REPO / "train" / "training" / "assembly.py") == []
    plants = {"def build_model(": "    import deepspeed\n",
              "def prepare(": "    from torch.distributed.fsdp import fully_shard\n",
              "def build_model(cfg": "    import importlib; importlib.import_module('deepspeed.utils')\n",
              "def prepare(rt": "    from zerotrain.train.strategy import internals\n",
              "def build_model(cfg: RunConfig": "    import sys; sys.modules['deepspeed.comm.comm'].cdb\n",
              "def prepare(rt: Runtime": "    import sys; 'deepspeed.comm.comm' in sys.modules\n"}
    for anchor, line in plants.items():
        start = source.index(anchor)
        body = source.index('"""', source.index('"""', start) + 3) + 3   # after the docstring
        planted = tmp_path / "assembly.py"
        planted.write_text(source[:body] + "\n" + line + source[body:])
        assert len(_backend_imports(planted)) == 1, line


# What every backend shares is one record each (ds_config.py DSSetup: a run's resolved file;
# option.py Option: the planner's reading), with what one backend alone knows in its own settings
# record (`settings`, defined in the backend's module: registry.Settings). So the shared records'
# modules name no backend: no field of one backend, no comparison with a backend's name or block.
SHARED_RECORDS = {"train/strategy/ds_config.py": ("DSSetup", {"path", "backend", "precision", "settings",
                                                              "precision_why", "resolved"}),
                  "train/strategy/option.py": ("Option", {"label", "path", "backend", "precision", "settings", "notes"})}
BACKEND_NAMES = {"ddp", "deepspeed", "fsdp2", "zero_optimization", "fsdp"}   # the registry's names and blocks


def _record_fields(tree: ast.Module, cls: str) -> set[str]:
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _backend_comparisons(tree: ast.Module) -> list[str]:
    """`line: name` for each comparison with a backend's name or block (`backend == "ddp"`,
    `"zero_optimization" in ds`)."""
    return [f"{node.lineno}: {c.value}" for node in ast.walk(tree) if isinstance(node, ast.Compare)
            for c in [node.left, *node.comparators]
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in BACKEND_NAMES]


def test_the_shared_strategy_records_name_no_backend():
    for rel, (cls, fields) in SHARED_RECORDS.items():
        tree = ast.parse((REPO / rel).read_text(), rel)
        assert _record_fields(tree, cls) == fields, (rel, cls)
        assert _backend_comparisons(tree) == [], rel


def test_the_backend_comparison_rule_sees_names_and_blocks():
    tree = ast.parse('if ds.backend == "deepspeed":\n    pass\nx = "ddp" in ds\ny = ds.backend == other\n')
    assert _backend_comparisons(tree) == ["1: deepspeed", "3: ddp"]
