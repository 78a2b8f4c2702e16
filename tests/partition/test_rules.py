"""The rule table as data: shipped rules.toml and user overlays (disable, disable_for, add)."""
import pytest
from partition_graphs import seed_example2, softmax_graph

from apollo_py import Options, RuleError
from apollo_py.partition import load_rules, partition
from apollo_py.partition.rules import DEFAULT_RULES_PATH, TABLE_VERSION


def summary(graph, overlay=None):
    return [(m.kind, list(m.rules), list(m.ops)) for m in partition(graph, Options(rules_overlay=overlay))]


def write(tmp_path, text, name="overlay.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_shipped_table():
    t = load_rules()
    assert t.version == TABLE_VERSION == 1
    assert t.ids() == ["1", "2", "3", "3b", "4", "5", "6"]
    r6 = t.get("6")
    assert r6.producer == {"opaque"} and r6.consumer == {"elementwise", "broadcast"} and r6.result == "opaque"
    assert r6.producer_opaque_ops == {"matmul", "conv"}
    r3b = t.get("3b")
    assert (set(r3b.producer), set(r3b.consumer), r3b.result) == ({"broadcast"}, {"broadcast"}, "broadcast")
    assert "3b" in open(DEFAULT_RULES_PATH).read()


def test_disable_rule(tmp_path):
    path = write(tmp_path, 'version = 1\ndisable = ["4"]\n')
    assert "4" not in load_rules(path).ids()
    assert summary(seed_example2(), path) == [
        ("elementwise", ["1"], ["exp", "neg"]), ("reduction", [], ["reduce_sum"]), ("elementwise", [], ["sqrt"])]


def test_disable_rule_for_signature(tmp_path):
    sig = partition(softmax_graph(), Options())[1].signature
    path = write(tmp_path, f'version = 1\n[[disable_for]]\nrule = "5"\nsignature = "{sig}"\n'
                           'reason = "schedule budget exceeded"\n')
    assert summary(softmax_graph(), path) == [
        ("reduction", [], ["reduce_max"]), ("broadcast", ["3"], ["sub", "exp"]),
        ("reduction", [], ["reduce_sum"]), ("broadcast", [], ["div"])]
    # other patterns still use rule 5
    assert summary(seed_example2(), path)[0] == ("reduction", ["1", "4"], ["exp", "neg", "reduce_sum"])


def test_add_rule(tmp_path):
    path = write(tmp_path, 'version = 1\n[[rule]]\nid = "7"\nproducer = "reduction"\n'
                           'consumer = "elementwise"\nresult = "reduction"\nafter = "5"\n')
    assert load_rules(path).ids() == ["1", "2", "3", "3b", "4", "5", "7", "6"]
    assert summary(seed_example2(), path) == [("reduction", ["1", "4", "7"], ["exp", "neg", "reduce_sum", "sqrt"])]


@pytest.mark.parametrize("text,match", [
    ("version = 1\ndisable = [\"42\"]\n", "unknown rule '42'"),
    ("version = 1\n[[rule]]\nid = \"9\"\nproducer = \"elementwize\"\nconsumer = \"elementwise\"\n"
     "result = \"elementwise\"\n", "unknown class 'elementwize'"),
    ("version = 1\n[[rule]]\nid = \"9\"\nproducer = \"opaque\"\nconsumer = \"elementwise\"\n"
     "result = \"magic\"\n", "unknown result class 'magic'"),
    ("version = 1\n[[rule]]\nid = \"1\"\nproducer = \"opaque\"\nconsumer = \"opaque\"\nresult = \"opaque\"\n",
     "already exists"),
    ("version = 1\n[[rule]]\nid = \"9\"\nproducer = \"opaque\"\n", "missing key 'consumer'"),
    ("version = 1\n[[disable_for]]\nrule = \"77\"\nsignature = \"x\"\n", "unknown rule '77'"),
    ("version = 1\nenable = [\"1\"]\n", "unknown top-level key"),
    ("version = 2\n", "version 2 is not supported"),
    ("disable = []\n", "missing `version"),
    ("version = 1\ndisable = [\n", "not valid TOML"),
    ("version = 1\n[[rule]]\nid = \"9\"\nproducer = \"opaque\"\nconsumer = \"elementwise\"\nresult = \"opaque\"\n"
     "producer_opaque_ops = [\"matmool\"]\n", "unknown primitive 'matmool'"),
    ("version = 1\n[[rule]]\nid = \"9\"\nproducer = \"opaque\"\nconsumer = \"elementwise\"\nresult = \"opaque\"\n"
     "after = \"99\"\n", "unknown rule '99'"),
    # shapes the JSON schema (rules.OVERLAY_SCHEMA) rejects, named by entry and key
    ("version = 1\ndisable = \"3\"\n", "disable: '3' is not of type 'array'"),
    ("version = 1\n[[disable_for]]\nrule = \"4\"\n", "disable_for #1: missing key 'signature'"),
    ("version = 1\n[[rule]]\nid = \"9\"\nproducer = 3\nconsumer = \"opaque\"\nresult = \"opaque\"\n",
     "rule #1: producer: 3 must be a class name"),
    ("version = 1\n[[rule]]\nid = \"9\"\nproducer = \"opaque\"\nconsumer = \"opaque\"\nresult = \"opaque\"\n"
     "colour = \"red\"\n", r"rule #1: unknown key\(s\) \['colour'\]"),
    ("version = 1\n[[rule]]\nid = \"\"\nproducer = \"opaque\"\nconsumer = \"opaque\"\nresult = \"opaque\"\n",
     "rule #1: id: '' should be non-empty"),
])
def test_malformed_overlay(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(RuleError, match=match) as e:
        load_rules(path)
    assert path in str(e.value)


def test_missing_overlay_file(tmp_path):
    with pytest.raises(RuleError, match="does not exist"):
        partition(softmax_graph(), Options(rules_overlay=str(tmp_path / "nope.toml")))


def test_malformed_base_table(tmp_path):
    path = write(tmp_path, 'version = 1\n[[rule]]\nid = "1"\nproducer = "elementwise"\nconsumer = "elementwise"\n'
                           'result = "elementwise"\n[[rule]]\nid = "1"\nproducer = "broadcast"\n'
                           'consumer = "elementwise"\nresult = "broadcast"\n', "base.toml")
    with pytest.raises(RuleError, match="defined twice"):
        load_rules(base=path)
