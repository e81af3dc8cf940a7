"""readerlib.graph: a TensorFlow-1-style dataflow graph whose ops include
Paddle's reader-creating ops and ReadOp and readerlib's kernels.

Use as ``import readerlib.graph as rg``::

    g = rg.Graph()
    with g.as_default():
        r = rg.create_batch_reader(rg.create_recordio_reader("train.rio"), 32)
        feats, labels = rg.read(r)
    with rg.Session(graph=g) as sess:
        while True:
            try:
                f, l = sess.run([feats, labels])
            except rg.OutOfRangeError:
                break

See docs/graph.md.  The top-level ``readerlib`` namespace stays the eager
data loader.
"""
from .. import errors
from ..errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    OpError,
    OutOfRangeError,
    UnimplementedError,
    UnknownError,
)
from .dtypes import TensorShape, as_dtype, resource, string
from .registry import KernelContext, OpType, get_op_type, register_op, registered_op_types
from .ops import (
    DeviceSpec,
    Graph,
    GraphKeys,
    InaccessibleTensorError,
    Operation,
    Tensor,
    colocate_with,
    container,
    control_dependencies,
    device,
    get_default_graph,
    name_scope,
    reset_default_graph,
)
from .array_ops import add, add_n, apply_op, constant, convert_to_tensor, identity, no_op, ones_like, placeholder
from .session import Session, get_default_session

__all__ = [
    "Graph", "Operation", "Tensor", "Session", "GraphKeys", "TensorShape", "DeviceSpec",
    "get_default_graph", "reset_default_graph", "get_default_session",
    "name_scope", "control_dependencies", "device", "colocate_with", "container",
    "constant", "placeholder", "identity", "add", "add_n", "no_op", "ones_like",
    "convert_to_tensor", "apply_op",
    "OpType", "KernelContext", "register_op", "get_op_type", "registered_op_types",
    "as_dtype", "resource", "string",
    "errors", "OpError", "OutOfRangeError", "InvalidArgumentError", "FailedPreconditionError",
    "NotFoundError", "DataLossError", "UnimplementedError", "UnknownError",
    "InaccessibleTensorError",
]
__all__ += ["GraphDef", "NodeDef", "import_graph_def"]


def __getattr__(name):
    # GraphDef support needs protobuf (the `graph` extra); the rest of the layer does not.
    if name in ("GraphDef", "NodeDef", "import_graph_def", "graph_def"):
        import importlib
        module = importlib.import_module(__name__ + ".graph_def")
        return module if name == "graph_def" else getattr(module, name)
    raise AttributeError(f"module 'readerlib.graph' has no attribute {name!r}")
from .kernel_ops import (  # noqa: E402
    batch_reindex,
    batch_reindex_grad,
    ctc_greedy_decoder,
    rnnt_greedy_decode,
    row_count,
)

__all__ += ["batch_reindex", "batch_reindex_grad", "ctc_greedy_decoder", "rnnt_greedy_decode",
            "row_count"]
from .reader_ops import (  # noqa: E402
    ReaderVariable,
    create_batch_reader,
    create_multi_pass_reader,
    create_prefetch_reader,
    create_recordio_reader,
    create_shuffle_reader,
    create_tfrecord_reader,
    read,
    reset_reader,
)

__all__ += ["create_recordio_reader", "create_tfrecord_reader", "create_shuffle_reader",
            "create_batch_reader", "create_multi_pass_reader", "create_prefetch_reader",
            "read", "reset_reader", "ReaderVariable"]
from .gradients import NotDifferentiable, RegisterGradient, gradients  # noqa: E402

__all__ += ["gradients", "RegisterGradient", "NotDifferentiable"]
