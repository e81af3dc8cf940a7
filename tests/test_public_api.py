"""The public API (readerlib/__init__.py): about twenty names, docs that use only
public paths, and Python subclasses of the compiled readers that either work in
a chain or are refused when the class is made."""
import glob
import os
import re

import numpy as np
import pytest

import readerlib as rl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PUBLIC = {
    "Field", "Schema", "LoDTensor", "SparseTensor", "Batch", "Instance",
    "ReaderBase", "ArrayReader", "RandomDataGenerator", "PythonReader",
    "RecordIOReader", "RecordIOWriter", "TFRecordReader", "TFRecordWriter",
    "open_files", "register_file_reader",
    "DataLossError", "RecordSchemaError", "RecordIOError", "TFRecordError",
    "InvalidArgumentError", "FailedPreconditionError",
    "set_num_threads", "get_num_threads", "get_include",
    "batch_reindex", "batch_reindex_grad", "ctc_greedy_decoder", "rnnt_greedy_decode",
}


def test_the_public_names():
    assert set(rl.__all__) == PUBLIC and len(rl.__all__) == len(PUBLIC)
    for name in rl.__all__:
        obj = getattr(rl, name)
        assert (obj.__doc__ or "").strip(), f"readerlib.{name} has no docstring"


def test_rnnt_models_only_under_readerlib_rnnt():
    import readerlib.rnnt as rnnt
    for name in ("RNNTModel", "LSTMPredictor", "StatelessPredictor", "Joint", "Hypothesis"):
        assert hasattr(rnnt, name)
        assert not hasattr(rl, name), name


def test_decorators_come_from_the_fluent_methods_and_old_names_still_import():
    r = rl.ArrayReader(np.arange(10))
    chain = r.shuffle(4, seed=0).batch(3).multi_pass(2)
    assert [type(x).__name__ for x in chain._walk()] == \
        ["MultiPassReader", "BatchReader", "ShuffleReader", "ArrayReader"]
    assert isinstance(chain, rl.ReaderBase) and "BatchReader" not in rl.__all__
    from readerlib.readers._batch import BatchReader
    assert rl.BatchReader is BatchReader                      # old flat name, kept importable
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        rl.Nope


_PRIVATE_PATH = re.compile(r"\breaderlib(?:\.\w+)*\._\w+")
_RL_NAME = re.compile(r"\brl\.([A-Za-z_]\w*)")


@pytest.mark.parametrize("doc", sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
                         + [os.path.join(ROOT, "README.md")], ids=os.path.basename)
def test_docs_code_uses_only_public_paths(doc):
    text = open(doc).read()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    private = _PRIVATE_PATH.findall(code)
    assert not private, f"{os.path.basename(doc)} imports private paths: {sorted(set(private))}"
    names = set(_RL_NAME.findall(code)) - PUBLIC - {"__version__"}
    assert not names, f"{os.path.basename(doc)} uses readerlib names outside the API: {sorted(names)}"


# ---- Python subclasses of the compiled readers -------------------------------------

@pytest.mark.parametrize("base", [rl.ReaderBase, rl.RecordIOReader])
def test_a_python_reader_class_is_refused_with_a_pointer_to_python_reader(base):
    with pytest.raises(TypeError, match=r"cannot be a readerlib reader.*PythonReader"):
        class Mine(base):
            def read_next(self):
                return (np.zeros(1),)


@pytest.mark.parametrize("base_name", ["FileReader", "DecoratedReader"])
def test_the_abstract_compiled_bases_cannot_be_completed_in_python(base_name):
    from readerlib.readers import _base
    with pytest.raises(TypeError, match=rf"subclasses {base_name}.*PythonReader"):
        type("Mine", (getattr(_base, base_name),), {})


def test_overriding_how_a_concrete_reader_yields_is_refused():
    with pytest.raises(TypeError, match=r"overrides __iter__, read_next.*PythonReader"):
        class Doubled(rl.ArrayReader):
            def read_next(self):
                item = super().read_next()
                return None if item is None else (item[0] * 2,)

            def __iter__(self):
                return self
    # also through an intermediate Python class
    class Named(rl.ArrayReader):
        pass
    with pytest.raises(TypeError, match="overrides reset"):
        class Again(Named):
            def reset(self):
                pass


def test_a_python_subclass_that_adds_methods_works_in_a_chain():
    class Labelled(rl.ArrayReader):
        def label(self):
            return "numbers"

    r = Labelled(np.arange(7))
    assert r.label() == "numbers"
    got = np.concatenate([b[0].data for b in r.shuffle(3, seed=1).batch(2)])
    assert sorted(got.tolist()) == list(range(7))


def test_rnnt_is_imported_on_first_use():
    # a fresh interpreter (conftest's PYTHONPATH): import readerlib leaves readerlib.rnnt
    # out until readerlib.rnnt_greedy_decode is touched; then it is the module's function
    import subprocess
    import sys
    code = ("import sys, readerlib as rl\n"
            "assert 'readerlib.rnnt' not in sys.modules, 'rnnt imported eagerly'\n"
            "assert 'rnnt_greedy_decode' in dir(rl)\n"
            "f = rl.rnnt_greedy_decode\n"
            "import readerlib.rnnt\n"
            "assert f is readerlib.rnnt.rnnt_greedy_decode\n"
            "ns = {}\n"
            "exec('from readerlib import *', ns)\n"
            "assert ns['rnnt_greedy_decode'] is f\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
