"""Typing (issue 14 item 8): py.typed, the compiled modules' stubs, inspect.signature,
and `mypy --strict` on examples/ against the readerlib under test.

The stubs are generated (tools/gen_stubs.py); here they are checked against the
compiled objects themselves, so a signature change that is not regenerated fails.
"""
import ast
import glob
import importlib
import inspect
import os
import subprocess
import sys
import sysconfig

import pytest

import readerlib as rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.dirname(os.path.abspath(rl.__file__))
EXT = sysconfig.get_config_var("EXT_SUFFIX")


def compiled_modules():
    """(module name, .pyi path) of every compiled module of the readerlib under test."""
    out = []
    for so in sorted(glob.glob(os.path.join(PKG, "**", "*" + EXT), recursive=True)):
        rel = os.path.relpath(so, os.path.dirname(PKG))[:-len(EXT)]
        out.append((rel.replace(os.sep, "."), so[:-len(EXT)] + ".pyi"))
    return out


def test_py_typed_and_a_stub_per_compiled_module():
    assert os.path.isfile(os.path.join(PKG, "py.typed"))
    mods = compiled_modules()
    assert len(mods) >= 15, mods
    missing = [m for m, pyi in mods if not os.path.isfile(pyi)]
    assert not missing, f"no .pyi for {missing} (python tools/gen_stubs.py)"


def _stub_params(node):
    """[(name, kind, has_default)] of a stub's `def` (self/cls dropped)."""
    a = node.args
    P = inspect.Parameter
    out = []
    pos = a.posonlyargs + a.args
    nodef = len(pos) - len(a.defaults)
    for i, arg in enumerate(pos):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        out.append((arg.arg, kind, i >= nodef))
    if a.vararg:
        out.append((a.vararg.arg, P.VAR_POSITIONAL, False))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, P.KEYWORD_ONLY, d is not None))
    if a.kwarg:
        out.append((a.kwarg.arg, P.VAR_KEYWORD, False))
    if out and out[0][0] in ("self", "cls"):
        out = out[1:]
    return out


def _real_params(sig):
    ps = [(p.name, p.kind, p.default is not p.empty) for p in sig.parameters.values()]
    if ps and ps[0][0] in ("self", "cls"):
        ps = ps[1:]
    return ps


def _checks():
    """(what, stub params, runtime signature) for every def the stubs declare
    whose runtime object reports a signature."""
    for modname, pyi in compiled_modules():
        if not os.path.isfile(pyi):
            continue
        mod = importlib.import_module(modname)
        tree = ast.parse(open(pyi).read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                yield f"{modname}.{node.name}", _stub_params(node), inspect.signature(getattr(mod, node.name))
            elif isinstance(node, ast.ClassDef):
                cls = getattr(mod, node.name)
                for item in node.body:
                    if not isinstance(item, ast.FunctionDef) or any(
                            isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                        continue
                    what = f"{modname}.{node.name}.{item.name}"
                    if item.name == "__init__":
                        # Cython's embedded line, written from the real __init__ (what
                        # inspect.signature(cls) reads for readers and writers)
                        from readerlib._signature import signature_from_doc
                        yield what, _stub_params(item), signature_from_doc(cls)
                        continue
                    real = cls.__dict__.get(item.name)
                    assert real is not None, f"{what} is in the stub, not in the class"
                    try:
                        sig = inspect.signature(real)
                    except (TypeError, ValueError):
                        continue                     # a slot wrapper (__iter__, __len__ ...)
                    yield what, _stub_params(item), sig


def test_stub_signatures_match_the_compiled_objects():
    n = 0
    bad = []
    for what, stub, sig in _checks():
        n += 1
        if stub != _real_params(sig):
            bad.append(f"{what}: stub {stub} != runtime {sig}")
    assert n >= 100, n
    assert not bad, "stubs out of date (python tools/gen_stubs.py):\n" + "\n".join(bad)


def test_stubs_declare_every_public_name():
    for modname, pyi in compiled_modules():
        mod = importlib.import_module(modname)
        names = getattr(mod, "__all__", None)
        if names is None:
            continue
        tree = ast.parse(open(pyi).read())
        declared = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        declared |= {t.id for n in tree.body if isinstance(n, ast.AnnAssign) for t in [n.target]}
        missing = set(names) - declared
        assert not missing, f"{pyi}: {sorted(missing)} not declared"


ABSTRACT = {"ReaderBase", "FileReader", "DecoratedReader"}     # not built directly


def test_inspect_signature_on_public_classes_and_functions():
    seen = 0
    for name in rl.__all__:
        obj = getattr(rl, name)
        if isinstance(obj, type) and (name in ABSTRACT or issubclass(obj, Warning)):
            continue
        if not callable(obj):
            continue
        inspect.signature(obj)                       # raises ValueError when it does not work
        seen += 1
    assert seen >= 20                               # the callables of the ~27 public names
    assert list(inspect.signature(rl.ArrayReader).parameters) == ["arrays", "schema", "chunk_records"]
    assert str(inspect.signature(rl.ShuffleReader)) == "(reader, buffer_size, seed=None)"
    assert list(inspect.signature(rl.RecordIOWriter).parameters)[:2] == ["path", "schema"]
    assert "num_threads" in inspect.signature(rl.ArrayReader.map).parameters
    from readerlib.transform import RecordTransform, TransformReader
    assert str(inspect.signature(RecordTransform)) == "(output_schema=None)"
    assert list(inspect.signature(TransformReader).parameters)[:2] == ["reader", "transform"]


def test_a_python_subclass_keeps_its_own_signature():
    class MyReader(rl.PythonReader):
        def __init__(self, n, *, scale=1.0):
            super().__init__(lambda: iter(()), rl.Schema([rl.Field("x", "float32")]))

    assert str(inspect.signature(MyReader)) == "(n, *, scale=1.0)"


def test_class_signature_from_doc():
    from readerlib._signature import signature_from_doc

    class A:
        """A(x, y=2, *args, z=(1, 2), w=np.float32, **kw)

        Text."""

    assert str(signature_from_doc(A)) == "(x, y=2, *args, z=(1, 2), w=np.float32, **kw)"

    class B:
        """No signature line."""

    assert signature_from_doc(B) is None


def test_mypy_strict_on_the_examples(tmp_path):
    pytest.importorskip("mypy")           # the test extra installs it (pyproject.toml)
    parent = os.path.dirname(PKG)
    env = dict(os.environ)
    env.pop("MYPYPATH", None)
    site = {os.path.realpath(p) for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    if os.path.realpath(parent) not in site:
        env["MYPYPATH"] = parent          # an in-place build; an installed one mypy finds itself
    examples = os.path.join(ROOT, "examples")
    cmd = [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
           "--cache-dir", str(tmp_path / "cache"), "--python-executable", sys.executable, examples]
    p = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert "Success" in p.stdout
    # the examples do use readerlib's types: a wrong call is caught
    bad = tmp_path / "bad.py"
    bad.write_text("import readerlib as rl\n"
                   "from readerlib.readers._batch import BatchReader\n"
                   "r: BatchReader = rl.ArrayReader([1, 2]).shuffle(4)\n"
                   "rl.ArrayReader([1]).batch('8')\n")
    p = subprocess.run(cmd[:-1] + [str(bad)], cwd=str(tmp_path), env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 1, p.stdout
    assert 'incompatible type "str"; expected "int"' in p.stdout, p.stdout
    assert '"ShuffleReader", variable has type "BatchReader"' in p.stdout, p.stdout
