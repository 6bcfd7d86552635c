"""What a JSON schema must be before the grammar engine compiles it: shallow enough to read, and
satisfiable by some finite document.

Two checks that llguidance does not make itself (``runner.grammar`` runs them first):

- **Depth.** A schema nested more than ``MAX_DEPTH`` objects and arrays deep is refused before
  anything walks it. Python's ``json`` and our own walks would raise ``RecursionError`` near 1,000
  levels; llguidance's parser stops at 128 levels of its own document, which wraps the schema in
  three more (measured: 100 levels of ``items`` compile, 130 do not).
- **A way out of every recursion.** ``{"$ref": "#"}``, two definitions that refer to each other,
  or an object whose *required* property is the object itself admit no finite document. llguidance
  compiles them: the first kind masks every token but EOS once the optional leading space is
  written (a request then "succeeds" with ``" "``); the second lets a model open ``{"a": {"a": ...``
  until its token budget runs out. Both are refused here, naming the reference that never ends.

The second check is the least fixpoint of "this subschema has a finite instance" over the
schema's subschemas, ``$ref`` edges included: an and/or graph (``allOf``, required properties and
the items an array must hold are *and*; ``anyOf``, ``oneOf`` and the allowed types are *or*)
solved in time linear in its size. It errs only towards "satisfiable": a keyword it does not model
(``patternProperties`` with a regex Python reads differently, ``minProperties``, constraints that
contradict each other) counts as satisfiable and is left to llguidance, which refuses the
contradictions it knows (``Unsatisfiable schema: ...``) when it compiles.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any, Optional

# levels of JSON objects and arrays a schema may nest (the root object is level 1)
MAX_DEPTH = 100
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def check_depth(schema: Any) -> None:
    """``ValueError`` if ``schema`` nests more than ``MAX_DEPTH`` levels (found without recursion)."""
    if nesting_depth(schema, MAX_DEPTH) > MAX_DEPTH:
        raise ValueError(f"the schema nests more than {MAX_DEPTH} levels of objects and arrays (at most "
                         f"{MAX_DEPTH})")


def check_satisfiable(schema: Any) -> None:
    """``ValueError`` if no finite document satisfies ``schema`` for want of a way out of a recursion."""
    endless = endless_reference(schema)
    if endless is not None:
        raise ValueError(f"no finite JSON document satisfies the schema: {endless!r} refers back to itself "
                         "with no way out (every document it allows would have to contain another)")


def nesting_depth(value: Any, stop: int) -> int:
    """Levels of dicts and lists in ``value`` (0 for a scalar), counted without recursion; the
    count stops once it passes ``stop`` (a value nested deeper is not walked to its bottom)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > stop:
            return deepest
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


class _Graph:
    """An and/or graph: node i holds when all (AND) or any (OR) of its children hold."""

    def __init__(self):
        self.is_and: list[bool] = []
        self.children: list[list[int]] = []

    def node(self, is_and: bool, children=()) -> int:
        self.is_and.append(is_and)
        self.children.append(list(children))
        return len(self.is_and) - 1

    def holds(self) -> list[bool]:
        """The least fixpoint: what holds without assuming anything on a cycle."""
        n = len(self.is_and)
        parents: list[list[int]] = [[] for _ in range(n)]
        for i, kids in enumerate(self.children):
            for k in kids:
                parents[k].append(i)
        missing = [len(kids) if self.is_and[i] else 1 for i, kids in enumerate(self.children)]
        holds = [False] * n
        ready = [i for i in range(n) if self.is_and[i] and not self.children[i]]
        while ready:
            i = ready.pop()
            if holds[i]:
                continue
            holds[i] = True
            for p in parents[i]:
                missing[p] -= 1
                if missing[p] == 0 and not holds[p]:
                    ready.append(p)
        return holds


def endless_reference(schema: Any) -> Optional[str]:
    """If the schema as a whole admits no finite instance, a ``$ref`` whose target admits none
    (``"#"`` if none does); None when some finite document satisfies it (or it is not a schema
    this models)."""
    if not isinstance(schema, dict):
        return None
    return _Finiteness(schema).endless()


class _Finiteness:
    """The graph of which subschemas admit a finite instance (``_Graph``): a node per subschema,
    each holding when its own part and every ``$ref``/``allOf`` part and one of each
    ``anyOf``/``oneOf`` hold."""

    def __init__(self, schema: dict):
        self.schema, self.graph = schema, _Graph()
        self.TRUE, self.FALSE = self.graph.node(True), self.graph.node(False)
        self.nodes: dict[int, int] = {}  # id(subschema dict) -> its node
        self.refs: list[tuple[str, int]] = []  # (the $ref as written, its target's node)
        self.pending: list[tuple[dict, int]] = []  # subschemas whose node exists but whose children are not yet made

    def endless(self) -> Optional[str]:
        root = self.node_of(self.schema)
        while self.pending:
            sub, index = self.pending.pop()
            parts = [self.own_part(sub)]
            ref = sub.get("$ref")
            if isinstance(ref, str):
                target = self.node_of(self.resolve(ref))
                self.refs.append((ref, target))
                parts.append(target)
            if isinstance(sub.get("allOf"), list):
                parts.extend(self.node_of(s) for s in sub["allOf"])
            for key in ("anyOf", "oneOf"):
                if isinstance(sub.get(key), list):
                    parts.append(self.graph.node(False, [self.node_of(s) for s in sub[key]]))
            self.graph.children[index] = parts
        holds = self.graph.holds()
        if holds[root]:
            return None
        return next((ref for ref, target in self.refs if not holds[target]), "#")

    def node_of(self, sub: Any) -> int:
        if sub is True or sub == {}:
            return self.TRUE
        if sub is False:
            return self.FALSE
        if not isinstance(sub, dict):
            return self.TRUE  # not a schema: llguidance will say so
        if id(sub) not in self.nodes:
            self.nodes[id(sub)] = self.graph.node(True)
            self.pending.append((sub, self.nodes[id(sub)]))
        return self.nodes[id(sub)]

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            return True  # another document's: not ours to follow (llguidance refuses it)
        target = self.schema
        for part in urllib.parse.unquote(ref[1:]).split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                return True  # unresolvable here: llguidance reports a dangling $ref itself
        return target

    def own_part(self, sub: dict) -> int:
        """The instance itself: a literal, or one of its allowed types with what that type must hold."""
        if "const" in sub or "enum" in sub:
            return self.TRUE  # a literal value is finite (whether it fits the rest is llguidance's check)
        types = sub.get("type", list(_TYPES))
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else list(_TYPES)
        options = []
        for kind in types:
            if kind == "object":
                required = sub.get("required")
                required = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
                options.append(self.graph.node(True, [self.property_schema(sub, name) for name in required]))
            elif kind == "array":
                options.append(self.graph.node(True, self.needed_items(sub)))
            else:
                options.append(self.TRUE)
        return self.graph.node(False, options)

    def property_schema(self, sub: dict, name: str) -> int:
        properties = sub.get("properties")
        if isinstance(properties, dict) and name in properties:
            return self.node_of(properties[name])
        patterns = sub.get("patternProperties")
        if isinstance(patterns, dict) and patterns:
            matching = []
            for pattern, value in patterns.items():
                try:
                    found = re.search(pattern, name)
                except (re.error, TypeError):
                    return self.TRUE  # a regex Python reads otherwise: not modelled
                if found:
                    matching.append(self.node_of(value))
            if matching:
                return self.graph.node(True, matching)
        return self.node_of(sub.get("additionalProperties", True))

    def needed_items(self, sub: dict) -> list[int]:
        least = sub.get("minItems", 0)
        if not isinstance(least, int) or isinstance(least, bool) or least <= 0:
            return []
        prefix = sub.get("prefixItems")
        rest = sub.get("items", True)
        if isinstance(rest, list):  # draft 4's tuple form
            prefix, rest = rest, sub.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        needed = [self.node_of(item) for item in prefix[:least]]
        if least > len(prefix):
            needed.append(self.node_of(rest))
        return needed


# ---- objects closed unless the schema opens them ----------------------------------------------------
# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "additionalItems",
        "unevaluatedItems", "unevaluatedProperties", "propertyNames")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPENING = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """``schema`` (a copy) with every object that does not say which keys beyond its properties it
    allows closed to them (``"additionalProperties": false``), as vLLM's default grammar backend
    (xgrammar) compiles a schema: JSON-schema's own default is open, so a model may append keys of
    its own until its token budget runs out, and the schemas libraries send (pydantic's
    ``model_json_schema()``: instructor, LangChain) say nothing. An object opens with
    ``"additionalProperties": true`` (or a schema), ``patternProperties`` or
    ``unevaluatedProperties``. An ``allOf`` and its members are left as they are: each member lists
    only its share of the keys the whole allows. Walked without recursion (the depth is checked
    later)."""
    root = _copied(schema)
    stack = [(root, False)]
    while stack:
        node, in_all_of = stack.pop()
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
            kind is None and "properties" in node)
        if is_object and not in_all_of and not any(k in node for k in (*_OPENING, "allOf")):
            node["additionalProperties"] = False
        for key in _ONE:
            stack.append((node.get(key), False))
        for key in _LIST:
            if isinstance(node.get(key), list):
                stack.extend((member, False) for member in node[key])
        if isinstance(node.get("allOf"), list):
            stack.extend((member, True) for member in node["allOf"])
        for key in _MAP:
            if isinstance(node.get(key), dict):
                stack.extend((member, False) for member in node[key].values())
    return root


def _copied(value: Any) -> Any:
    """A deep copy of JSON (dicts, lists, scalars), made without recursion."""
    def shell(v):
        return {} if isinstance(v, dict) else [] if isinstance(v, list) else v

    root = shell(value)
    stack = [(value, root)]
    while stack:
        source, target = stack.pop()
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, v in items:
            copy = shell(v)
            if isinstance(target, dict):
                target[key] = copy
            else:
                target.append(copy)
            if copy is not v:
                stack.append((v, copy))
    return root
