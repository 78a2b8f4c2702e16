"""The aggregation rule table (DESIGN §4, Table 1) as data: ``rules.toml`` plus a user overlay.

The base table ships in ``apollo_py/partition/rules.toml``.  A user overlay (TOML, path in
``Options.rules_overlay``; written by ``apollo-py feedback apply`` or by hand) may:

    version = 1
    disable = ["3b"]                      # turn rules off
    [[disable_for]]                       # turn a rule off for one pattern signature
    rule = "4"
    signature = "mul:ew($0,$1) reduce_sum:red(0)"
    reason = "schedule budget exceeded in bert"
    [[rule]]                              # add a rule (appended, or placed after rule `after`)
    id = "7"
    producer = "reduction"
    consumer = "elementwise"
    result = "reduction"
    after = "5"
    [[split]]                             # layer 1: split this pattern up front (no isl attempt)
    signature = "exp:ew($0) tanh:ew(0) ..."
    reason = "schedule_budget_exceeded 3x (budget 50 isl ops)"
    date = "2026-11-25T00:10:00Z"
    evidence = { events = 3, mean_ms = 1.2, models = ["bert"] }
    [[no_stitch]]                         # layer 2: do not try this stitch (layer 1 refused it)
    signature = "reduce_max:red(0) sub:ew(...) ..."
    [[no_parallel]]                       # layer 3: never run these kernels as one launch
    signature = "fused_ab12_0+fused_cd34_0"

``revision`` (an integer) numbers the overlays written by ``apollo-py feedback apply``; a
``split`` signature is the pattern signature layer 1 logged (its node list, which may be a part
of a micro-graph): layer 1 splits a node list with that signature in two without calling isl (a
single node is scheduled without the operations budget), so the refusal is not paid again.
A ``disable_for`` signature is the pattern signature (:mod:`.signature`) of the micro-graph the
merge would produce.  Every problem — malformed TOML, an unknown key, class or rule id, a
duplicate id, a wrong version — raises :class:`~apollo_py.errors.RuleError` naming the file.
The shape of both files (keys, types, the version) is a JSON Schema (:data:`BASE_SCHEMA`,
:data:`OVERLAY_SCHEMA`, checked with ``jsonschema``); what the schema cannot know (class names,
rule ids, primitive names, duplicates) is checked here.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Iterable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..errors import RuleError
from ..ops.classify import CLASSES

TABLE_VERSION = 1
DEFAULT_RULES_PATH = os.path.join(os.path.dirname(__file__), "rules.toml")

_STRINGS = {"type": "array", "items": {"type": "string"}}
_CLASS_NAMES = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}]}


def _rule_schema(extra: dict) -> dict:
    return {"type": "object", "required": ["id", "producer", "consumer", "result"],
            "additionalProperties": False,
            "properties": {"id": {"type": "string", "minLength": 1}, "producer": _CLASS_NAMES,
                           "consumer": _CLASS_NAMES, "result": {"type": "string"},
                           "producer_opaque_ops": {**_STRINGS, "minItems": 1},
                           "description": {"type": "string"}, **extra}}


#: the shipped table (``rules.toml``)
BASE_SCHEMA = {"type": "object", "required": ["version"], "additionalProperties": False,
               "properties": {"version": {"const": TABLE_VERSION},
                              "rule": {"type": "array", "items": _rule_schema({})}}}
#: a user overlay: rules may carry ``after``; ``disable``, ``disable_for`` (see the module docs)
OVERLAY_SCHEMA = {
    "type": "object", "required": ["version"], "additionalProperties": False,
    "properties": {
        "version": {"const": TABLE_VERSION}, "description": {},
        "revision": {"type": "integer", "minimum": 0},
        "rule": {"type": "array", "items": _rule_schema({"after": {"type": "string"}})},
        "disable": _STRINGS,
        "disable_for": {"type": "array", "items": {
            "type": "object", "required": ["rule", "signature"], "additionalProperties": False,
            "properties": {"rule": {"type": "string"}, "signature": {"type": "string", "minLength": 1},
                           "reason": {}, "date": {}, "evidence": {}}}},
        **{name: {"type": "array", "items": {
            "type": "object", "required": ["signature"], "additionalProperties": False,
            "properties": {"signature": {"type": "string", "minLength": 1}, "event": {"type": "string"},
                           "reason": {}, "date": {}, "evidence": {}}}}
           for name in ("split", "no_stitch", "no_parallel")}}}


def _check_schema(doc: Any, schema: dict, where: str) -> None:
    """RuleError naming ``where`` and the offending entry for the first schema violation."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match
    err = best_match(Draft202012Validator(schema).iter_errors(doc))
    if err is None:
        return
    path = list(err.absolute_path)
    loc = "".join(f" #{p + 1}" if isinstance(p, int) else f": {p}" for p in path)
    top = not path
    if err.validator == "required":
        key = next(k for k in err.validator_value if k not in err.instance)
        what = f"missing `version = {TABLE_VERSION}`" if top and key == "version" else f"missing key {key!r}"
    elif err.validator == "additionalProperties":
        known = sorted(err.schema["properties"])
        what = (f"unknown {'top-level ' if top else ''}key(s) {sorted(set(err.instance) - set(known))}; "
                f"accepted: {known}")
    elif err.validator == "const" and path == ["version"]:
        loc, what = "", f"version {err.instance!r} is not supported (this apollo_py reads version {TABLE_VERSION})"
    elif err.validator == "anyOf":
        what = f"{err.instance!r} must be a class name or a non-empty list of them"
    else:
        what = err.message
    raise RuleError(f"{where}{loc}: {what}")


@dataclass(frozen=True)
class Rule:
    """One aggregation rule: merge a ``producer``-class micro-graph into a ``consumer``-class one.

    ``producer_opaque_ops``, when set, requires the producer's opaque primitives to be among
    these ops (rule 6: only matmul/conv take epilogues).  ``disabled_signatures`` lists merged
    pattern signatures for which the rule is turned off by the overlay.
    """

    id: str
    producer: frozenset[str]
    consumer: frozenset[str]
    result: str
    producer_opaque_ops: frozenset[str] | None = None
    disabled_signatures: frozenset[str] = frozenset()
    description: str = ""

    def __str__(self) -> str:
        p = "|".join(sorted(self.producer))
        c = "|".join(sorted(self.consumer))
        cond = f" if producer ops in {sorted(self.producer_opaque_ops)}" if self.producer_opaque_ops else ""
        return f"rule {self.id}: {p} -> {c} = {self.result}{cond}"


@dataclass(frozen=True)
class RuleTable:
    """The rules in priority order, with the table version and the files they came from."""

    version: int
    rules: tuple[Rule, ...]
    sources: tuple[str, ...] = ()

    def ids(self) -> list[str]:
        return [r.id for r in self.rules]

    def get(self, rule_id: str) -> Rule:
        for r in self.rules:
            if r.id == rule_id:
                return r
        raise RuleError(f"no rule with id {rule_id!r}; rules are {self.ids()}")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise RuleError(f"rule file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise RuleError(f"rule file {path!r} is not valid TOML: {e}") from None
    except OSError as e:
        raise RuleError(f"rule file {path!r} cannot be read: {e}") from None


def _classes(value: Any, key: str, where: str) -> frozenset[str]:
    items = [value] if isinstance(value, str) else value
    for v in items:
        if v not in CLASSES:
            raise RuleError(f"{where}: unknown class {v!r} in {key!r}; classes are {list(CLASSES)}")
    return frozenset(items)


def _parse_rule(entry: dict, where: str) -> Rule:
    """A schema-checked rule table as a :class:`Rule` (class and op names checked here)."""
    rid = entry["id"]
    where = f"{where} (rule {rid!r})"
    result = entry["result"]
    if result not in CLASSES:
        raise RuleError(f"{where}: unknown result class {result!r}; classes are {list(CLASSES)}")
    ops = entry.get("producer_opaque_ops")
    if ops is not None:
        from ..ops.registry import has_op
        for o in ops:
            if not has_op(o):
                raise RuleError(f"{where}: producer_opaque_ops names unknown primitive {o!r}")
        ops = frozenset(ops)
    desc = entry.get("description", "")
    return Rule(rid, _classes(entry["producer"], "producer", where), _classes(entry["consumer"], "consumer", where),
                result, ops, frozenset(), desc)


@lru_cache(maxsize=8)
def _load_base(path: str, mtime: float) -> RuleTable:
    doc = _read_toml(path)
    _check_schema(doc, BASE_SCHEMA, f"rule file {path!r}")
    rules = [_parse_rule(e, f"{path}: rule #{k + 1}") for k, e in enumerate(doc.get("rule", []))]
    _check_unique(rules, path)
    return RuleTable(doc["version"], tuple(rules), (path,))


def _check_unique(rules: list[Rule], path: str) -> None:
    seen = set()
    for r in rules:
        if r.id in seen:
            raise RuleError(f"rule file {path!r}: rule id {r.id!r} is defined twice")
        seen.add(r.id)


def apply_overlay(table: RuleTable, path: str) -> RuleTable:
    """``table`` with the user overlay at ``path`` applied (see the module docstring)."""
    doc = _read_toml(path)
    _check_schema(doc, OVERLAY_SCHEMA, f"overlay {path!r}")
    rules = list(table.rules)
    for k, entry in enumerate(doc.get("rule", [])):
        rule = _parse_rule(entry, f"overlay {path!r}: rule #{k + 1}")
        if rule.id in {r.id for r in rules}:
            raise RuleError(f"overlay {path!r}: added rule id {rule.id!r} already exists")
        after = entry.get("after")
        if after is None:
            rules.append(rule)
        else:
            pos = [r.id for r in rules]
            if after not in pos:
                raise RuleError(f"overlay {path!r}: rule {rule.id!r} is placed after unknown rule {after!r}")
            rules.insert(pos.index(after) + 1, rule)
    disable = doc.get("disable", [])
    ids = [r.id for r in rules]
    for d in disable:
        if d not in ids:
            raise RuleError(f"overlay {path!r}: cannot disable unknown rule {d!r}; rules are {ids}")
    rules = [r for r in rules if r.id not in disable]
    for k, entry in enumerate(doc.get("disable_for", [])):
        where = f"overlay {path!r}: disable_for #{k + 1}"
        rid, sig = entry["rule"], entry["signature"]
        if rid not in ids:
            raise RuleError(f"{where}: unknown rule {rid!r}; rules are {ids}")
        rules = [replace(r, disabled_signatures=r.disabled_signatures | {sig}) if r.id == rid else r
                 for r in rules]
    return RuleTable(table.version, tuple(rules), table.sources + (path,))


@lru_cache(maxsize=16)
def _entries(path: str, stamp: tuple, table: str) -> frozenset[str]:
    doc = _read_toml(path)
    _check_schema(doc, OVERLAY_SCHEMA, f"overlay {path!r}")
    return frozenset(e["signature"] for e in doc.get(table, []))


def overlay_signatures(overlay: str | None, table: str) -> frozenset[str]:
    """The signatures of the overlay's ``[[table]]`` entries (``split``, ``no_stitch``,
    ``no_parallel``; none without an overlay); re-read when the file's mtime or size changes,
    so an overlay rewritten by ``feedback apply`` counts."""
    if not overlay:
        return frozenset()
    try:
        st = os.stat(overlay)
    except OSError:
        raise RuleError(f"rule file {overlay!r} does not exist") from None
    return _entries(overlay, (st.st_mtime_ns, st.st_size), table)


def split_signatures(overlay: str | None) -> frozenset[str]:
    """The ``[[split]]`` signatures of the overlay at ``overlay`` (see :func:`overlay_signatures`)."""
    return overlay_signatures(overlay, "split")


_SIG_OP = re.compile(r"(?:^|\s)([A-Za-z_][\w.]*):")


def signature_ops(signature: str) -> Counter:
    """The multiset of primitive names in a pattern signature (``op:class(args)`` terms)."""
    return Counter(_SIG_OP.findall(signature))


def relevant_splits(ops: Iterable[str], overlay: str | None) -> tuple[str, ...]:
    """The overlay's split signatures that could name a part of a node list with primitives
    ``ops`` (their primitives are a sub-multiset of ``ops``), sorted.  Cache keys of layer-1
    results hold these, so an overlay entry recompiles only the pieces it can change."""
    splits = split_signatures(overlay)
    if not splits:
        return ()
    have = Counter(ops)
    return tuple(sorted(s for s in splits if not (signature_ops(s) - have)))


def load_rules(overlay: str | None = None, base: str = DEFAULT_RULES_PATH) -> RuleTable:
    """The rule table from ``base`` (the shipped ``rules.toml``) with ``overlay`` applied."""
    try:
        mtime = os.path.getmtime(base)
    except OSError:
        raise RuleError(f"rule file {base!r} does not exist") from None
    table = _load_base(base, mtime)
    return apply_overlay(table, overlay) if overlay else table
