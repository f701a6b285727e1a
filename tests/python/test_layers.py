"""The host crate's layers (host/README.md): each module imports only its own layer and the
ones below it, and no two modules import each other, directly or round a circle (a parent
module and its children aside). Read from the sources, so a new import that breaks either
rule fails here with the modules named."""
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "host", "src")

# Lowest first; the binary's own files (main.rs and what only it uses) sit on top.
LAYERS = [
    {"error", "tensor", "inference", "cancellation", "limits", "proto", "names", "private_dir",
     "tenancy", "classification", "content_hash", "response_order"},
    {"repository"},
    {"runtime"},
    {"scheduling"},
    {"frontends"},
    {"main", "command_line", "log_lines", "trace_export", "stage_cli", "subcommands"},
]


def modules():
    """Module path (a tuple) -> its source, tests left out."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if not name.endswith(".rs"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
            if parts[-1] in ("mod", "lib"):
                parts = parts[:-1]
            source = open(path, encoding="utf-8").read()
            source = re.sub(r"#\[cfg\(test\)\]\s*mod tests \{.*", "", source, flags=re.S)
            source = re.sub(r"//[^\n]*", "", source)
            found[tuple(parts)] = source
    return found


def expand(text):
    """The paths a `use` tree names: `a::{b, c::{d, e}}` -> a::b, a::c::d, a::c::e."""
    match = re.match(r"^([^{]*)\{(.*)\}$", text)
    if not match:
        return [text.split(" as ")[0]]
    prefix, inner = match.groups()
    items, depth, current = [], 0, ""
    for c in inner:
        depth += (c == "{") - (c == "}")
        if c == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += c
    items.append(current)
    return [prefix + path for item in items if item for path in expand(item)]


def resolve(mods, module, path, binary):
    """The module a path leads into (the longest prefix that is a module), or None."""
    segments = path.split("::")
    base = list(module)
    if segments[0] in ("crate", "wasmtron" if binary else "crate"):
        base, segments = [], segments[1:]
    elif segments[0] == "self":
        segments = segments[1:]
    elif segments[0] == "super":
        while segments and segments[0] == "super":
            base, segments = base[:-1], segments[1:]
    else:
        return None
    for i in range(len(segments), -1, -1):
        candidate = tuple(base + segments[:i])
        if candidate in mods and candidate:
            return candidate
    return None


def imports(with_ancestors=False):
    """Module -> the modules it imports, parents and children aside (its ancestors kept when
    `with_ancestors`)."""
    mods = modules()
    graph = {}
    for module, source in mods.items():
        binary = module[:1] in (("main",), ("command_line",), ("log_lines",), ("trace_export",),
                                ("stage_cli",), ("subcommands",))
        paths = []
        for use in re.finditer(r"\buse\s+([^;]+);", source):
            paths += expand(re.sub(r"\s+", "", use.group(1)))
        # Paths written out in code; a `use` tree's stem (`crate::a::{`) is not an import of it.
        paths += [
            m.group(1)
            for m in re.finditer(r"\b((?:crate|super|wasmtron)(?:::[A-Za-z_]\w*)+)", source)
            if not source.startswith("::{", m.end())
        ]
        targets = {resolve(mods, module, p, binary) for p in paths}
        graph[module] = {
            t for t in targets
            if t and t != module and module != t[:len(module)]
            and (with_ancestors or t != module[:len(t)])
        }
    return graph


def layer(module):
    return next(i for i, names in enumerate(LAYERS) if module[0] in names)


def test_every_module_has_a_layer():
    assert [m for m in modules() if m and not any(m[0] in names for names in LAYERS)] == []


def test_no_module_imports_a_higher_layer():
    upward = sorted(
        f"{'::'.join(m)} ({layer(m) + 1}) imports {'::'.join(t)} ({layer(t) + 1})"
        for m, targets in imports().items() if m
        for t in targets if layer(t) > layer(m)
    )
    assert upward == []


# A particular backend's modules. The layers above reach a model's backend only through the
# runtime's contract (runtime/backend.rs, model_config.rs, capabilities/) and its dispatcher
# (runtime/mod.rs).
BACKENDS = {"generation", "onnx", "python", "wasm", "conversion"}


def test_scheduling_and_frontends_name_no_backend_internals():
    """Only the contract: a module of scheduling/ or frontends/ that imports a particular
    backend's module fails here."""
    found = sorted(
        f"{'::'.join(m)} imports {'::'.join(t)}"
        for m, targets in imports().items() if m and m[0] in ("scheduling", "frontends")
        for t in targets if t[:1] == ("runtime",) and len(t) > 1 and t[1] in BACKENDS
    )
    assert found == []


def test_nothing_in_the_runtime_imports_its_dispatcher():
    """runtime/mod.rs only dispatches (a table of backends) and re-exports the contract for
    the layers above; a module inside runtime/ takes the contract from runtime/backend.rs and
    its siblings, never from its parent runtime/mod.rs (no import runs back up), and the
    contract's modules name no backend."""
    graph = imports(with_ancestors=True)
    upward = sorted(
        "::".join(m) for m, targets in graph.items()
        if m[:1] == ("runtime",) and len(m) > 1 and ("runtime",) in targets
    )
    assert upward == []
    contract = [("runtime", "backend"), ("runtime", "model_config"), ("runtime", "capabilities"),
                ("runtime", "sandbox")]
    naming = sorted(
        f"{'::'.join(m)} imports {'::'.join(t)}" for m, targets in graph.items()
        if any(m[:len(c)] == c for c in contract)
        for t in targets if t[:1] == ("runtime",) and len(t) > 1 and t[1] in BACKENDS
    )
    assert naming == []


# One backend importing another: only the generation backend, which runs its decoder with
# ONNX Runtime and shares the ONNX backend's environment.
BACKENDS_SHARING = {"generation imports onnx"}


def test_no_backend_imports_another():
    """Guest code's common host is runtime/sandbox, shared plumbing runtime/ itself: a backend
    that imports another backend's module fails here."""
    found = {
        f"{m[1]} imports {t[1]}"
        for m, targets in imports().items() if m[:1] == ("runtime",) and len(m) > 1
        and m[1] in BACKENDS
        for t in targets if t[:1] == ("runtime",) and len(t) > 1 and t[1] in BACKENDS
        and t[1] != m[1]
    }
    assert found == BACKENDS_SHARING


def circles(graph):
    """The groups of modules that import each other round a circle (Tarjan's components)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                component.append("::".join(w))
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert circles(imports()) == []


def test_the_checks_see_what_they_look_for(monkeypatch):
    fake = {
        ("scheduling", "a"): "use crate::scheduling::b::X;",
        ("scheduling", "b"): "use super::c::{Y, z::W};",
        ("scheduling", "c"): "fn f() { super::a::go() }",
        ("runtime",): "use crate::frontends::http;",
        ("frontends",): "",
        ("scheduling",): "",
    }
    monkeypatch.setattr(__import__(__name__), "modules", lambda: fake)
    graph = imports()
    assert circles(graph) == [["scheduling::a", "scheduling::b", "scheduling::c"]]
    fake[("runtime", "onnx")] = ""
    fake[("scheduling", "d")] = "use crate::runtime::onnx::Session;"
    assert ("runtime", "onnx") in imports()[("scheduling", "d")]
    # A child importing its parent is seen when ancestors are asked for, and only then.
    fake[("runtime", "onnx", "instance")] = "use super::super::ModelInstance;"
    assert ("runtime",) not in imports()[("runtime", "onnx", "instance")]
    assert ("runtime",) in imports(with_ancestors=True)[("runtime", "onnx", "instance")]
    assert ("frontends",) in graph[("runtime",)] and layer(("frontends",)) > layer(("runtime",))


def test_no_source_file_is_over_800_lines():
    """A file past ~600 lines mixing concerns is a sign to split; past 800 this fails, naming
    the files (a folder with mod.rs and its parts, or tests in tests.rs, is the way out)."""
    long = []
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".rs"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    lines = sum(1 for _ in f)
                if lines > 800:
                    long.append(f"{os.path.relpath(path, ROOT)}: {lines}")
    assert long == []
