"""ONNX-level mutation fuzzing (issue #16 item 3): the example models with one random defect --
an attribute flipped, an input dropped, a dtype or dim changed, a cycle, a dangling name, a
truncated protobuf, an absurd opset -- and, from seed ``ZOO_SEED0`` on, the same defects in
torch.onnx exports of the model zoo (tests/models/zoo).  Loading, compiling and running may succeed or raise an
ApolloError subclass; anything else is a finding.  One seed = one mutation, reproducible."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx

import apollo_py as ap

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import make_models as mm  # noqa: E402

MODELS = ("make_mlp", "make_conv_block", "make_attention", "make_layernorm_gelu", "make_softmax_chain")
#: torch.onnx exports (tests/models/zoo; dynamo and TorchScript, with Gather/Concat/Gemm index
#: plumbing, int64 ids, LSTM/GRU): mutated from seed ZOO_SEED0 on
ZOO_MODELS = ("dlrm_small.dynamo.onnx", "dlrm_small.torchscript.onnx", "lstm_gru_small.torchscript.onnx")
ZOO_SEED0 = 10**7
ZOO_DIR = Path(__file__).resolve().parent / "models" / "zoo"
MUTATIONS = ("flip_attribute", "drop_input", "change_dtype", "change_dim", "cycle", "dangling",
             "truncate", "opset", "rename_output", "duplicate_output")
_BASE: dict = {}


def _base(name):
    if name not in _BASE:
        if name.endswith(".onnx"):
            from soak_lib import zoo_feeds
            _BASE[name] = ((ZOO_DIR / name).read_bytes(), zoo_feeds(name, ZOO_DIR))
        else:
            m = getattr(mm, name)()
            _BASE[name] = (m.SerializeToString(), mm.example_inputs(m))
    return _BASE[name]


def mutate(seed: int) -> tuple[str, bytes | onnx.ModelProto, dict]:
    """(description, mutated model, feeds) for ``seed``."""
    rng = np.random.default_rng(seed)
    models = ZOO_MODELS if seed >= ZOO_SEED0 else MODELS
    name = models[seed % len(models)]
    raw, feeds = _base(name)
    kind = MUTATIONS[(seed // len(models)) % len(MUTATIONS)]
    m = onnx.ModelProto()
    m.ParseFromString(raw)
    nodes = m.graph.node
    k = int(rng.integers(0, len(nodes)))
    node = nodes[k]
    what = f"{name} seed {seed}: {kind}"
    if kind == "flip_attribute":
        attrs = [a for a in node.attribute if a.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS,
                                                         onnx.AttributeProto.FLOAT)]
        if attrs:
            a = attrs[int(rng.integers(0, len(attrs)))]
            if a.type == onnx.AttributeProto.INT:
                a.i = int(rng.choice([-5, -1, 0, 2, 7, 10**9]))
            elif a.type == onnx.AttributeProto.INTS:
                a.ints[:] = [int(v) for v in rng.integers(-3, 6, size=int(rng.integers(0, 5)))]
            else:
                a.f = float(rng.choice([-1.0, 0.0, np.inf, np.nan]))
            what += f" {node.op_type}.{a.name}"
        else:
            node.attribute.add().CopyFrom(onnx.helper.make_attribute("bogus", 3))
    elif kind == "drop_input" and len(node.input):
        del node.input[int(rng.integers(0, len(node.input)))]
    elif kind == "change_dtype":
        vi = m.graph.input[int(rng.integers(0, len(m.graph.input)))]
        vi.type.tensor_type.elem_type = int(rng.choice([2, 6, 7, 8, 9, 10, 11, 16, 100]))
    elif kind == "change_dim":
        vi = m.graph.input[int(rng.integers(0, len(m.graph.input)))]
        dims = vi.type.tensor_type.shape.dim
        if len(dims):
            d = dims[int(rng.integers(0, len(dims)))]
            d.dim_value = int(rng.choice([0, 1, 3, 10**7]))
    elif kind == "cycle" and len(nodes) > 1:
        later = nodes[int(rng.integers(k, len(nodes)))]
        if len(node.input):
            node.input[0] = later.output[0]
    elif kind == "dangling" and len(node.input):
        node.input[int(rng.integers(0, len(node.input)))] = "no_such_value"
    elif kind == "truncate":
        return what, raw[:int(rng.integers(1, len(raw)))], feeds
    elif kind == "opset":
        m.opset_import[0].version = int(rng.choice([0, 1, 5, 99, 10**6]))
    elif kind == "rename_output":
        node.output[0] = m.graph.output[0].name if rng.random() < 0.5 else node.input[0] if len(node.input) else "x"
    elif kind == "duplicate_output":
        nodes.add().CopyFrom(node)
    return what, m, feeds


def _names(model) -> set[str]:
    """What an error about ``model`` may name: its nodes (name, op type), values and inputs."""
    if not isinstance(model, onnx.ModelProto):
        return set()
    g = model.graph
    out = {n.name for n in g.node} | {n.op_type for n in g.node}
    out |= {v for n in g.node for v in (*n.input, *n.output)}
    out |= {v.name for v in (*g.input, *g.output, *g.initializer)}
    return {n for n in out if n}


#: what an error about a model-level defect (truncated bytes, absurd opset) names instead
_MODEL_LEVEL = ("opset", "protobuf", "ModelProto", "ONNX model", "parse")


def unnamed(message: str, model, kind: str = "") -> bool:
    """True when ``message`` names no node (name or op type), value or input of ``model`` as a
    whole word -- nor, for the model-level defects ``truncate`` and ``opset``, the opset or the
    model's bytes."""
    import re
    for n in _names(model):
        if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", message):
            return False
    return not (kind in ("truncate", "opset") and any(w in message for w in _MODEL_LEVEL))


def check_mutation(seed: int) -> str | None:
    """None when the mutated model loads, compiles and runs, or raises an ApolloError whose
    message names the node or input (:func:`unnamed`); else a one-line description."""
    what, model, feeds = mutate(seed)
    try:
        f = ap.jit(model, options=ap.Options(machine="conservative", max_memory=2**30))
        f.run(**{k: v for k, v in feeds.items() if k in f.input_names})
    except ap.ApolloError as e:
        if unnamed(str(e), model, what.split(": ")[-1].split()[0]):
            return f"{what}: {type(e).__name__} names no node or input: {str(e).splitlines()[0][:200]}"
        return None
    except Exception as e:  # noqa: BLE001 - the finding
        return f"{what}: raw {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return None
