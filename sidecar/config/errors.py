"""Config-file errors as one line: reading the YAML, and pydantic errors in the file's own terms.

Rules:

- Every problem becomes a ``ConfigError`` whose ``str()`` is one line:
  ``<file>: <field path>: <reason>``, the path written as in the file
  (``subscriptions[0].ordering.key``), with `` (line N)`` when the YAML position is known.
- Only the first problem is shown in full, followed by ``[+N more]``: one line that the user can
  act on beats a wall of follow-on errors.
- pydantic puts the tag of a tagged union into its error paths (``ordering.sequence.key``): the tag
  is dropped here and used to say "required in sequence mode" or "belongs to watermark mode".
- YAML duplicate keys are an error (PyYAML silently keeps the last one, hiding half a section).
- A file is bounded (``MAX_YAML_VALUES``) twice, each with its own message: its values as written
  ("the file is too big"), refused while reading, and the same document once its aliases are
  expanded ("an alias bomb?"). A file over neither bound is validated, so a duplicate subscription
  name in a big file is reported as that.

``sidecar.config.model`` owns the models; this module only reads them (field names and aliases).
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel


class ConfigError(Exception):
    """A config file the user must fix. ``str()`` is one line: ``<file>: <field path>: <reason>``."""

    def __init__(self, file: str, path: str, reason: str) -> None:
        self.file = file
        self.path = path
        self.reason = " ".join(reason.split())  # one line, whatever the reason's source
        super().__init__(f"{file}: {path}: {self.reason}" if path else f"{file}: {self.reason}")


Lines = Mapping[tuple[Any, ...], int]
"""1-based line of each mapping key or list item, by its path in the document."""


def read_yaml_file(path: str | Path) -> tuple[Any, dict[tuple[Any, ...], int]]:
    """The parsed document (None when empty) and its ``Lines``; raises ConfigError."""
    file = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(file, "", f"cannot read the file: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(file, "", f"not UTF-8 text (byte {exc.start})") from None
    return _parse_yaml(file, text)


MAX_YAML_DEPTH = 64
"""Nesting a config file may have. Ours is 6 levels deep; composing and reading the document
recurse per level, so 100,000 levels would end in RecursionError instead of a clear line."""

MAX_YAML_VALUES = 100_000
"""Values (scalars, lists, mappings) the document may hold, as written and once its aliases are
expanded. A subscription takes about 20 (a fully spelled-out one about 50), so a few thousand
subscriptions fit; a 1.6 KB "billion laughs" alias bomb expands to 10^9 and would take minutes and
all memory before failing, and a file written out past the bound takes seconds per 100,000 values
to read (pure-Python YAML) before it could be refused for anything else."""

VALUES_PER_SUBSCRIPTION = 20
"""About how many YAML values one subscription entry takes (name, subscription, ordering): only for
the message that refuses a file over ``MAX_YAML_VALUES``."""


class _TooManyValues(Exception):
    """The document as written holds more than ``MAX_YAML_VALUES`` values (at ``line``)."""

    def __init__(self, line: int) -> None:
        super().__init__(line)
        self.line = line


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses nesting deeper than ``MAX_YAML_DEPTH`` and more than
    ``MAX_YAML_VALUES`` values as written while composing, and counts the values it composed."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self.written_values = 0
        """Nodes composed: every value as written (an alias counts once, where it is written)."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        self.written_values += 1
        try:
            if self.written_values > MAX_YAML_VALUES:
                raise _TooManyValues(self.peek_event().start_mark.line + 1)  # type: ignore[no-untyped-call]
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]  # untyped in types-PyYAML
                raise yaml.MarkedYAMLError(problem=f"nested more than {MAX_YAML_DEPTH} levels deep", problem_mark=mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _parse_yaml(file: str, text: str) -> tuple[Any, dict[tuple[Any, ...], int]]:
    """The document plus the 1-based line of every mapping key (by path), for error messages.

    Duplicate keys are an error: PyYAML would silently keep the last one, hiding half a section.
    Depth, the values as written and their expansion through aliases are bounded before anything
    walks the document path by path; each bound has its own message (a big file is not an alias bomb).
    """
    loader: _BoundedLoader | None = None
    try:
        # The reader checks the characters here (a NUL byte, other control characters).
        loader = _BoundedLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None, {}
        if _expanded_values(node, {}, set()) > MAX_YAML_VALUES:
            # As written it is within the bound (the loader counted it): the aliases are what expand it.
            raise ConfigError(
                file,
                "",
                f"its {loader.written_values:,} values as written expand to more than {MAX_YAML_VALUES:,} "
                "through YAML aliases (an alias bomb?); use fewer aliases",
            )
        lines: dict[tuple[Any, ...], int] = {}
        _index_node(file, node, (), lines)
        try:
            return loader.construct_document(node), lines
        except yaml.YAMLError:
            raise
        except Exception as exc:  # PyYAML's constructors raise ValueError & co. on bad tagged values
            raise ConfigError(file, "", f"invalid YAML value: {exc}") from None
    except _TooManyValues as exc:
        raise ConfigError(
            file,
            "",
            f"the file is too big: it holds more than {MAX_YAML_VALUES:,} YAML values (line {exc.line:,} reached), "
            f"the most a config may hold (a subscription takes about {VALUES_PER_SUBSCRIPTION}); split the "
            "subscriptions over several sidecars",
        ) from None
    except yaml.reader.ReaderError as exc:
        line, column = _line_column(text, exc.position)
        what = "a NUL byte" if exc.character in (0, "\x00") else f"character #x{_code(exc.character):04x}"
        raise ConfigError(
            file, f"line {line}, column {column}", f"invalid YAML: {what} is not allowed in a YAML file"
        ) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = " ".join(part for part in (exc.context, exc.problem) if part)
        raise ConfigError(file, where, f"invalid YAML: {what}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(file, "", f"invalid YAML: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()


def _expanded_values(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values ``node`` stands for with every alias expanded (shared nodes counted once
    per use, computed once each); a node that contains itself is refused."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise yaml.MarkedYAMLError(problem="an alias refers to a node that contains it", problem_mark=node.start_mark)
    open_nodes.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            total += _expanded_values(item, sizes, open_nodes)
    elif isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            total += _expanded_values(key_node, sizes, open_nodes) + _expanded_values(value_node, sizes, open_nodes)
    open_nodes.discard(key)
    # Saturate: the caller only compares with the limit, and 9^9-sized sums stay cheap this way.
    sizes[key] = min(total, MAX_YAML_VALUES + 1)
    return sizes[key]


def _line_column(text: str, position: int) -> tuple[int, int]:
    before = text[:position]
    return before.count("\n") + 1, position - (before.rfind("\n") + 1) + 1


def _code(character: Any) -> int:
    return ord(character) if isinstance(character, str) else int(character)


def _index_node(file: str, node: yaml.Node, path: tuple[Any, ...], lines: dict[tuple[Any, ...], int]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen and key != "<<":
                location = format_loc((*path, key)) or key
                raise ConfigError(file, location, f"duplicate key (line {line}; first on line {seen[key]})")
            seen[key] = line
            lines[(*path, key)] = line
            _index_node(file, value_node, (*path, key), lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[(*path, index)] = item.start_mark.line + 1
            _index_node(file, item, (*path, index), lines)


def line_of(loc: tuple[Any, ...], lines: Lines) -> int | None:
    """The line of ``loc``, or of its nearest ancestor present in the file (a missing field)."""
    for end in range(len(loc), 0, -1):
        line = lines.get(tuple(loc[:end]))
        if line is not None:
            return line
    return None


# ---- pydantic errors -> one line -------------------------------------------------------------


def describe(
    error: Mapping[str, Any], root: type[BaseModel], variants: Mapping[str, type[BaseModel]], project_env: str
) -> tuple[tuple[Any, ...], str]:
    """(field path, reason) of one pydantic error, in the file's own terms."""
    loc, mode = _strip_mode_tag(tuple(part for part in error["loc"] if not _is_schema_label(part)), variants)
    modes = ", ".join(variants)
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if "at" in ctx:  # our validators point below the field they check
        loc = (*loc, *ctx["at"])
    field = loc[-1] if loc else None
    if kind == "missing":
        if loc == ("project",):
            return loc, f"required: set project: or the {project_env} environment variable"
        return loc, f"required in {mode} mode" if mode and len(loc) == 4 else "required"
    if kind == "extra_forbidden":
        return loc, _unknown_field_reason(loc, mode, root, variants)
    if kind == "union_tag_invalid":
        return (*loc, "mode"), f"must be one of {modes}, got {ctx.get('tag')!r}"
    if kind == "union_tag_not_found":
        return (*loc, "mode"), f"required (one of {modes})"
    if kind == "value_error":
        return loc, str(ctx.get("error", error["msg"]))
    if kind == "literal_error":
        return loc, f"must be {ctx.get('expected')}, got {_short(value)}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return loc, _bound_reason(kind, ctx, field)
    if kind == "invalid_key":
        return loc, "field names must be strings"
    if kind == "too_short":
        return loc, "must not be empty"
    if kind in _TYPE_NAMES:
        return loc, f"expected {_TYPE_NAMES[kind]}, got {type_name(value)} {_short(value)}"
    return loc, str(error["msg"])


_TYPE_NAMES = {
    "string_type": "a string",
    "int_type": "an integer",
    "bool_type": "true or false",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
}


def _bound_reason(kind: str, ctx: Mapping[str, Any], field: Any) -> str:
    bound = next(iter(ctx.values()), None)
    is_duration = isinstance(field, str) and field in _DURATION_FIELDS
    shown = f"{bound}ms" if is_duration else bound
    if kind == "greater_than":
        return "must be longer than 0s" if is_duration and bound == 0 else f"must be greater than {shown}"
    if kind == "greater_than_equal":
        return f"must be at least {shown}"
    if kind == "less_than":
        return f"must be less than {shown}"
    return f"must be at most {shown}"


_DURATION_FIELDS = frozenset(
    {"ttl", "ack_deadline", "initial", "maximum", "gap_timeout", "allowed_skew", "poll_interval", "safety_margin"}
    | {"max_metric_delay"}
)


def _is_schema_label(part: Any) -> bool:
    """pydantic names some inner schemas in ``loc`` (``function-after[...]``, ``int``); not fields."""
    return isinstance(part, str) and "[" in part


def _strip_mode_tag(loc: tuple[Any, ...], modes: Mapping[str, Any]) -> tuple[tuple[Any, ...], str | None]:
    """pydantic puts the tag of a tagged union into ``loc``: ``ordering.sequence.key`` means field
    ``key`` of the sequence variant. Drop the tag so paths match the file, and return the mode."""
    for i in range(len(loc) - 1):
        if loc[i] == "ordering" and loc[i + 1] in modes:
            return (*loc[: i + 1], *loc[i + 2 :]), str(loc[i + 1])
    return loc, None


def _unknown_field_reason(
    loc: tuple[Any, ...], mode: str | None, root: type[BaseModel], variants: Mapping[str, type[BaseModel]]
) -> str:
    field = loc[-1]
    model = _model_at(loc[:-1], mode, root, variants)
    if model is None:
        return "unknown field"
    allowed = sorted(info.alias or name for name, info in model.model_fields.items())
    if mode is not None and model in variants.values():
        owners = [m for m, cls in variants.items() if m != mode and _has_field(cls, field)]
        if owners:
            belongs = " or ".join(owners)
            return f"not allowed in {mode} mode (it belongs to {belongs} mode); allowed: {', '.join(allowed)}"
    return f"unknown field; allowed: {', '.join(allowed)}"


def _has_field(model: type[BaseModel], name: Any) -> bool:
    return any((info.alias or field) == name for field, info in model.model_fields.items())


def _model_at(
    loc: tuple[Any, ...], mode: str | None, root: type[BaseModel], variants: Mapping[str, type[BaseModel]]
) -> type[BaseModel] | None:
    """The model class that the (tag-free) path points into, or None if it cannot be told."""
    annotation: Any = root
    for part in loc:
        if isinstance(part, int):
            args = typing.get_args(annotation)
            annotation = args[0] if args else None
            continue
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        match = [info for name, info in annotation.model_fields.items() if (info.alias or name) == part]
        if not match:
            return None
        annotation = _unwrap(match[0].annotation, mode, variants)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _unwrap(annotation: Any, mode: str | None, variants: Mapping[str, type[BaseModel]]) -> Any:
    """``X | None`` -> X; the ordering union -> the variant of ``mode``; lists stay lists."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return annotation
    if len(args) == 1 and typing.get_origin(annotation) is not Annotated:
        return args[0]
    if args and all(isinstance(a, type) and a in variants.values() for a in args):
        return variants.get(mode or "")
    if typing.get_origin(annotation) is Annotated:
        return _unwrap(args[0], mode, variants)
    return annotation


def format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def type_name(value: Any) -> str:
    names = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
