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

A ``disable_for`` signature is the pattern signature (:mod:`.signature`) of the micro-graph the
merge would produce.  Every problem — malformed TOML, an unknown key, class or rule id, a
duplicate id, a wrong version — raises :class:`~apollo_py.errors.RuleError` naming the file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..errors import RuleError
from ..ops.classify import CLASSES

TABLE_VERSION = 1
DEFAULT_RULES_PATH = os.path.join(os.path.dirname(__file__), "rules.toml")

_RULE_KEYS = {"id", "producer", "consumer", "result", "producer_opaque_ops", "description"}
_OVERLAY_KEYS = {"version", "disable", "disable_for", "rule", "description"}
_DISABLE_FOR_KEYS = {"rule", "signature", "reason"}


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
    if not isinstance(items, list) or not items or not all(isinstance(v, str) for v in items):
        raise RuleError(f"{where}: {key!r} must be a class name or a non-empty list of them, got {value!r}")
    for v in items:
        if v not in CLASSES:
            raise RuleError(f"{where}: unknown class {v!r} in {key!r}; classes are {list(CLASSES)}")
    return frozenset(items)


def _parse_rule(entry: Any, where: str, extra_keys: frozenset[str] = frozenset()) -> Rule:
    if not isinstance(entry, dict):
        raise RuleError(f"{where}: a rule must be a table, got {entry!r}")
    unknown = set(entry) - _RULE_KEYS - extra_keys
    if unknown:
        raise RuleError(f"{where}: unknown key(s) {sorted(unknown)}; accepted: {sorted(_RULE_KEYS | extra_keys)}")
    for k in ("id", "producer", "consumer", "result"):
        if k not in entry:
            raise RuleError(f"{where}: missing key {k!r}")
    rid = entry["id"]
    if not isinstance(rid, str) or not rid:
        raise RuleError(f"{where}: rule id must be a non-empty string, got {rid!r}")
    where = f"{where} (rule {rid!r})"
    result = entry["result"]
    if not isinstance(result, str) or result not in CLASSES:
        raise RuleError(f"{where}: unknown result class {result!r}; classes are {list(CLASSES)}")
    ops = entry.get("producer_opaque_ops")
    if ops is not None:
        if not isinstance(ops, list) or not ops or not all(isinstance(o, str) for o in ops):
            raise RuleError(f"{where}: producer_opaque_ops must be a non-empty list of op names")
        from ..ops.registry import has_op
        for o in ops:
            if not has_op(o):
                raise RuleError(f"{where}: producer_opaque_ops names unknown primitive {o!r}")
        ops = frozenset(ops)
    desc = entry.get("description", "")
    if not isinstance(desc, str):
        raise RuleError(f"{where}: description must be a string")
    return Rule(rid, _classes(entry["producer"], "producer", where), _classes(entry["consumer"], "consumer", where),
                result, ops, frozenset(), desc)


def _check_version(doc: dict, path: str) -> int:
    v = doc.get("version")
    if v is None:
        raise RuleError(f"rule file {path!r}: missing `version = {TABLE_VERSION}`")
    if v != TABLE_VERSION:
        raise RuleError(f"rule file {path!r}: version {v!r} is not supported (this apollo_py reads version "
                        f"{TABLE_VERSION})")
    return v


def _rule_list(doc: dict, path: str) -> list:
    entries = doc.get("rule", [])
    if not isinstance(entries, list):
        raise RuleError(f"rule file {path!r}: `rule` must be an array of tables ([[rule]])")
    return entries


@lru_cache(maxsize=8)
def _load_base(path: str, mtime: float) -> RuleTable:
    doc = _read_toml(path)
    unknown = set(doc) - {"version", "rule"}
    if unknown:
        raise RuleError(f"rule file {path!r}: unknown top-level key(s) {sorted(unknown)}")
    version = _check_version(doc, path)
    rules = [_parse_rule(e, f"{path}: rule #{k + 1}") for k, e in enumerate(_rule_list(doc, path))]
    _check_unique(rules, path)
    return RuleTable(version, tuple(rules), (path,))


def _check_unique(rules: list[Rule], path: str) -> None:
    seen = set()
    for r in rules:
        if r.id in seen:
            raise RuleError(f"rule file {path!r}: rule id {r.id!r} is defined twice")
        seen.add(r.id)


def apply_overlay(table: RuleTable, path: str) -> RuleTable:
    """``table`` with the user overlay at ``path`` applied (see the module docstring)."""
    doc = _read_toml(path)
    unknown = set(doc) - _OVERLAY_KEYS
    if unknown:
        raise RuleError(f"overlay {path!r}: unknown top-level key(s) {sorted(unknown)}; accepted: "
                        f"{sorted(_OVERLAY_KEYS)}")
    _check_version(doc, path)
    rules = list(table.rules)
    for k, entry in enumerate(_rule_list(doc, path)):
        rule = _parse_rule(entry, f"overlay {path!r}: rule #{k + 1}", frozenset({"after"}))
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
    if not isinstance(disable, list) or not all(isinstance(d, str) for d in disable):
        raise RuleError(f"overlay {path!r}: `disable` must be a list of rule ids")
    ids = [r.id for r in rules]
    for d in disable:
        if d not in ids:
            raise RuleError(f"overlay {path!r}: cannot disable unknown rule {d!r}; rules are {ids}")
    rules = [r for r in rules if r.id not in disable]
    dfor = doc.get("disable_for", [])
    if not isinstance(dfor, list):
        raise RuleError(f"overlay {path!r}: `disable_for` must be an array of tables ([[disable_for]])")
    for k, entry in enumerate(dfor):
        where = f"overlay {path!r}: disable_for #{k + 1}"
        if not isinstance(entry, dict):
            raise RuleError(f"{where}: must be a table")
        bad = set(entry) - _DISABLE_FOR_KEYS
        if bad:
            raise RuleError(f"{where}: unknown key(s) {sorted(bad)}; accepted: {sorted(_DISABLE_FOR_KEYS)}")
        rid, sig = entry.get("rule"), entry.get("signature")
        if not isinstance(rid, str) or not isinstance(sig, str) or not sig:
            raise RuleError(f"{where}: needs `rule` (a rule id) and `signature` (a non-empty string)")
        if rid not in ids:
            raise RuleError(f"{where}: unknown rule {rid!r}; rules are {ids}")
        rules = [replace(r, disabled_signatures=r.disabled_signatures | {sig}) if r.id == rid else r
                 for r in rules]
    return RuleTable(table.version, tuple(rules), table.sources + (path,))


def load_rules(overlay: str | None = None, base: str = DEFAULT_RULES_PATH) -> RuleTable:
    """The rule table from ``base`` (the shipped ``rules.toml``) with ``overlay`` applied."""
    try:
        mtime = os.path.getmtime(base)
    except OSError:
        raise RuleError(f"rule file {base!r} does not exist") from None
    table = _load_base(base, mtime)
    return apply_overlay(table, overlay) if overlay else table
