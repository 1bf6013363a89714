"""JSON schemas for the structured-output tests and benchmark: nested objects, arrays,
enums, bounded numbers, required and optional properties, ``additionalProperties: false``.
Strings and arrays are bounded so every output completes within a small ``max_tokens``."""
from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 16}
_SHORT = {"type": "string", "maxLength": 12}


def _obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS: dict[str, dict] = {
    "person": _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "flag": _obj({"ok": {"type": "boolean"}}),
    "color_enum": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "score_bounded": _obj({"score": {"type": "integer", "minimum": 1, "maximum": 10},
                           "label": {"enum": ["low", "mid", "high"]}}),
    "tags_array": _obj({"tags": {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3}}),
    "numbers_array": _obj({"values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "maxItems": 4}}),
    "nested_address": _obj({"city": _NAME, "address": _obj({"street": _NAME, "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}})}),
    "optional_fields": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": _SHORT},
                            required=["id"]),
    "status_const": _obj({"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0, "maximum": 9}}),
    "nullable": _obj({"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 50}}),
    "any_of": _obj({"item": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
    "array_of_objects": _obj({"people": {"type": "array", "maxItems": 2, "items": _obj({
        "name": _NAME, "adult": {"type": "boolean"}})}}),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": {"type": "integer", "minimum": 0, "maximum": 5}})})}),
    "date_pattern": _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    "weather": _obj({"city": _NAME, "unit": {"enum": ["celsius", "fahrenheit"]},
                     "temperature": {"type": "integer", "minimum": -50, "maximum": 50}}),
    "ratio_number": _obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}, ),
    "top_level_array": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3},
    "refs": {"$defs": {"point": _obj({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "y": {"type": "integer", "minimum": 0, "maximum": 9}})},
             **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    "product": _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                     "price": {"type": "integer", "minimum": 1, "maximum": 500},
                     "in_stock": {"type": "boolean"}}),
    "yes_no_reason": _obj({"answer": {"enum": ["yes", "no"]}, "reason": _SHORT}),
    "matrix": _obj({"rows": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    "event": _obj({"title": _NAME, "attendees": {"type": "integer", "minimum": 0, "maximum": 100},
                   "online": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                           "maxItems": 2}}, required=["title", "online"]),
}
