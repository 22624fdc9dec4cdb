"""JSON schemas the structured-output tests share (engine and HTTP): nested objects, arrays, enums, required
fields, bounded so that an answer ends within a few hundred tokens of the embedded model."""
from __future__ import annotations

import itertools
import json

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "address", "tags"],
          "properties": {
              "name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "role": {"enum": ["admin", "user", "guest"]},
              "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                          "properties": {"city": {"type": "string", "maxLength": 10},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
              "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}}}
FLAGS = {"type": "object", "additionalProperties": False, "required": ["ok", "color"],
         "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}}}
FLAG_DOCS = [json.dumps({"ok": ok, "color": c}, separators=(",", ":")).encode()
             for ok, c in itertools.product([True, False], ["red", "green"])]
