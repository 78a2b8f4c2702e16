"""Graph IR: tensor types, immutable nodes and graphs, the builder and the verifier."""
from .graph import Attrs, ConstArray, Graph, Node
from .types import DTYPES, TensorType
from .verify import verify
from .builder import GraphBuilder, Value

__all__ = ["Attrs", "ConstArray", "DTYPES", "Graph", "GraphBuilder", "Node", "TensorType", "Value", "verify"]
