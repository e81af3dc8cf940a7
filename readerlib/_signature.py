"""`inspect.signature` for readerlib's compiled classes.

Cython (binding=True, embedsignature=True, setup.py) gives every compiled
function and method a real signature, but `inspect.signature(SomeCdefClass)`
still fails: a cdef class's `__init__` is a slot wrapper, and the signature
Cython embeds at the top of the class docstring ("ArrayReader(arrays,
schema=None, ...)") lacks the "--" marker CPython would read as
`__text_signature__`.  A base class assigns `__signature__ =
ClassSignature()`; inspect looks that attribute up first, and this
descriptor parses the class's own embedded line (for each subclass, its own).
"""
import ast
import inspect

__all__ = ["ClassSignature", "signature_from_doc"]


class _Default:
    """A default value that is not a literal, shown as its source text."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def _default(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _Default(ast.unparse(node))


def signature_from_doc(cls):
    """The `inspect.Signature` of `cls(...)` from the first line of its own
    docstring ("Name(params)"), or None when it has none."""
    doc = cls.__dict__.get("__doc__") if isinstance(cls, type) else None
    if not doc:
        return None
    name = cls.__name__
    first = doc.lstrip().split("\n", 1)[0].strip()
    if not first.startswith(name + "(") or not first.endswith(")"):
        return None
    try:
        fn = ast.parse(f"def _f{first[len(name):]}: pass").body[0]
    except SyntaxError:
        return None
    a = fn.args
    P = inspect.Parameter
    params = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        if i == 0 and arg.arg == "self":
            continue
        kind = P.POSITIONAL_ONLY if arg in a.posonlyargs else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=P.empty if d is None else _default(d)))
    if a.vararg is not None:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if d is None else _default(d)))
    if a.kwarg is not None:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


class ClassSignature:
    """`__signature__` of a compiled class, for `inspect.signature(cls)`."""

    def __get__(self, obj, cls):
        if obj is not None:
            raise AttributeError("__signature__")      # instances are not called
        sig = signature_from_doc(cls)
        if sig is None:
            raise AttributeError("__signature__")      # inspect falls back to its own ways
        return sig
