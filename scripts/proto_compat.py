"""The compatibility rule for the app-facing proto: no change may break a client built on the baseline.

    python scripts/proto_compat.py            # check proto/ against the baseline (tests/test_proto_compat.py)
    python scripts/proto_compat.py --update   # make proto-baseline: record proto/ as the new baseline

The baseline, ``proto/baseline/pubsub_sidecar.v1.txtpb``, is the descriptor set (text format, so a
review shows the change) that ``protoc`` makes from ``proto/``. It is compared element by element by
full name; what existing clients rely on may not change:

- files: none removed; file options (go_package, java_package, ...) unchanged (they name generated code);
- services and methods: none removed or renamed; a method keeps its request and response types and
  its streaming on each side;
- messages and enums: none removed or renamed (a rename is a removal);
- fields, by number: none removed; each keeps its name and JSON name (JSON clients such as grpcurl
  and proto-loader's objects use them), its type, its label (repeated or not), its oneof and its
  presence (``optional``); a field that moved to another number is reported as renumbered;
- enum values, by number: none removed or renamed.

Anything may be added: fields with new numbers, messages, enums, values, methods, services. An
addition leaves the baseline behind: the check then asks for ``make proto-baseline`` so that the new
element is protected from then on. ``--update`` refuses a breaking baseline unless
``--accept-breaking`` says the break is deliberate (a new major version of the API).
"""

from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gen_proto import PROTO_FILES, PROTO_ROOT, REPO_ROOT, well_known_protos
from google.protobuf import descriptor_pb2, text_format
from grpc_tools import protoc

BASELINE = PROTO_ROOT / "baseline" / "pubsub_sidecar.v1.txtpb"

_HEADER = (
    "# The app-facing API as clients know it: written by `make proto-baseline` (scripts/proto_compat.py),\n"
    "# never by hand. tests/test_proto_compat.py fails when proto/ breaks a client built on it.\n"
)

_FieldProto = descriptor_pb2.FieldDescriptorProto
_TYPE_NAMES = {number: name.removeprefix("TYPE_").lower() for name, number in _FieldProto.Type.items()}
_LABEL_NAMES = {number: name.removeprefix("LABEL_").lower() for name, number in _FieldProto.Label.items()}


def current(proto_root: Path = PROTO_ROOT) -> descriptor_pb2.FileDescriptorSet:
    """The descriptor set protoc makes from ``proto_root`` now (no source info: comments may change freely)."""
    with tempfile.TemporaryDirectory(prefix="proto_compat_") as tmp:
        out = Path(tmp) / "current.binpb"
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"--proto_path={proto_root}",
                f"--proto_path={well_known_protos()}",
                f"--descriptor_set_out={out}",
                *(str(proto_root / proto) for proto in PROTO_FILES),
            ]
        )
        if status != 0:
            raise SystemExit(f"proto_compat: protoc failed with status {status} for {', '.join(PROTO_FILES)}")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def to_text(descriptors: descriptor_pb2.FileDescriptorSet) -> str:
    return text_format.MessageToString(descriptors)


def load(path: Path = BASELINE) -> descriptor_pb2.FileDescriptorSet:
    return text_format.Parse(path.read_text(), descriptor_pb2.FileDescriptorSet())


# ---- the rule ----------------------------------------------------------------------------------


def _messages(
    prefix: str, messages: list[descriptor_pb2.DescriptorProto]
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto]]:
    for message in messages:
        name = f"{prefix}.{message.name}"
        yield name, message
        yield from _messages(name, list(message.nested_type))


def _enums(
    prefix: str, enums: list[descriptor_pb2.EnumDescriptorProto], messages: list[descriptor_pb2.DescriptorProto]
) -> Iterator[tuple[str, descriptor_pb2.EnumDescriptorProto]]:
    for enum in enums:
        yield f"{prefix}.{enum.name}", enum
    for message in messages:
        yield from _enums(f"{prefix}.{message.name}", list(message.enum_type), list(message.nested_type))


class _Index:
    """Everything a client can name, by full name."""

    def __init__(self, descriptors: descriptor_pb2.FileDescriptorSet) -> None:
        self.files = {f.name: f for f in descriptors.file}
        self.messages: dict[str, descriptor_pb2.DescriptorProto] = {}
        self.enums: dict[str, descriptor_pb2.EnumDescriptorProto] = {}
        self.services: dict[str, descriptor_pb2.ServiceDescriptorProto] = {}
        for file in descriptors.file:
            prefix = f".{file.package}" if file.package else ""
            self.messages.update(_messages(prefix, list(file.message_type)))
            self.enums.update(_enums(prefix, list(file.enum_type), list(file.message_type)))
            self.services.update((f"{prefix}.{s.name}", s) for s in file.service)


def _field_type(field: _FieldProto) -> str:
    return field.type_name.lstrip(".") if field.type_name else _TYPE_NAMES[field.type]


def _oneof(message: descriptor_pb2.DescriptorProto, field: _FieldProto) -> str | None:
    if not field.HasField("oneof_index") or field.proto3_optional:
        return None  # proto3 `optional` sits in a synthetic oneof: that is presence, checked apart
    return message.oneof_decl[field.oneof_index].name


def _field_changes(name: str, old: descriptor_pb2.DescriptorProto, new: descriptor_pb2.DescriptorProto) -> list[str]:
    problems: list[str] = []
    new_by_number = {f.number: f for f in new.field}
    new_by_name = {f.name: f for f in new.field}
    for was in old.field:
        where = f"{name.lstrip('.')}.{was.name} ({was.number})"
        now = new_by_number.get(was.number)
        if now is None:
            moved = new_by_name.get(was.name)
            if moved is not None:
                problems.append(f"{where}: field renumbered {was.number} -> {moved.number}")
            else:
                problems.append(f"{where}: field removed")
            continue
        if now.name != was.name:
            problems.append(f"{where}: field renamed to {now.name!r}")
        elif now.json_name != was.json_name:
            problems.append(f"{where}: JSON name changed {was.json_name!r} -> {now.json_name!r}")
        if _field_type(now) != _field_type(was):
            problems.append(f"{where}: field retyped {_field_type(was)} -> {_field_type(now)}")
        if now.label != was.label:
            problems.append(f"{where}: label changed {_LABEL_NAMES[was.label]} -> {_LABEL_NAMES[now.label]}")
        if _oneof(new, now) != _oneof(old, was):
            problems.append(f"{where}: oneof changed {_oneof(old, was)} -> {_oneof(new, now)}")
        if now.proto3_optional != was.proto3_optional:
            problems.append(f"{where}: presence changed (optional {was.proto3_optional} -> {now.proto3_optional})")
    return problems


def _method_changes(
    name: str, old: descriptor_pb2.ServiceDescriptorProto, new: descriptor_pb2.ServiceDescriptorProto
) -> list[str]:
    problems: list[str] = []
    new_methods = {m.name: m for m in new.method}
    for was in old.method:
        where = f"{name.lstrip('.')}/{was.name}"
        now = new_methods.get(was.name)
        if now is None:
            problems.append(f"{where}: method removed or renamed")
            continue
        for side, old_type, new_type in (
            ("request", was.input_type, now.input_type),
            ("response", was.output_type, now.output_type),
        ):
            if old_type != new_type:
                problems.append(f"{where}: {side} type changed {old_type.lstrip('.')} -> {new_type.lstrip('.')}")
        for side, old_streaming, new_streaming in (
            ("client", was.client_streaming, now.client_streaming),
            ("server", was.server_streaming, now.server_streaming),
        ):
            if old_streaming != new_streaming:
                problems.append(f"{where}: {side} streaming changed {old_streaming} -> {new_streaming}")
    return problems


def _enum_changes(
    name: str, old: descriptor_pb2.EnumDescriptorProto, new: descriptor_pb2.EnumDescriptorProto
) -> list[str]:
    problems: list[str] = []
    new_by_number = {v.number: v for v in new.value}
    for was in old.value:
        now = new_by_number.get(was.number)
        where = f"{name.lstrip('.')}.{was.name} ({was.number})"
        if now is None:
            problems.append(f"{where}: enum value removed")
        elif now.name != was.name:
            problems.append(f"{where}: enum value renamed to {now.name!r}")
    return problems


def breaking_changes(old: descriptor_pb2.FileDescriptorSet, new: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Every change from ``old`` to ``new`` that breaks a client built on ``old``, one line each."""
    before, after = _Index(old), _Index(new)
    problems: list[str] = []
    for name, file in before.files.items():
        now = after.files.get(name)
        if now is None:
            problems.append(f"{name}: file removed or moved")
        elif now.options != file.options:
            problems.append(f"{name}: file options changed (they name the generated code of other languages)")
    for name, service in before.services.items():
        if name not in after.services:
            problems.append(f"{name.lstrip('.')}: service removed or renamed")
        else:
            problems.extend(_method_changes(name, service, after.services[name]))
    for name, message in before.messages.items():
        if name not in after.messages:
            problems.append(f"{name.lstrip('.')}: message removed or renamed")
        else:
            problems.extend(_field_changes(name, message, after.messages[name]))
    for name, enum in before.enums.items():
        if name not in after.enums:
            problems.append(f"{name.lstrip('.')}: enum removed or renamed")
        else:
            problems.extend(_enum_changes(name, enum, after.enums[name]))
    return problems


# ---- check and update --------------------------------------------------------------------------


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def check(baseline: Path = BASELINE, descriptors: descriptor_pb2.FileDescriptorSet | None = None) -> list[str]:
    """Problems of ``descriptors`` (default: proto/ now) against ``baseline``; empty when all is well.

    Breaking changes come first; a compatible but unrecorded change gives one problem asking for
    ``make proto-baseline``, with the start of the diff.
    """
    now = descriptors if descriptors is not None else current()
    if not baseline.exists():
        return [f"{_shown(baseline)}: missing; run `make proto-baseline`"]
    old = load(baseline)
    problems = [f"breaking: {problem}" for problem in breaking_changes(old, now)]
    if problems:
        return problems
    if now != old:
        diff = "".join(
            difflib.unified_diff(
                to_text(old).splitlines(keepends=True),
                to_text(now).splitlines(keepends=True),
                fromfile="baseline",
                tofile="proto/",
                n=2,
            )
        )
        problems.append(
            "proto/ has compatible changes the baseline does not record yet; run `make proto-baseline` "
            f"and commit {_shown(baseline)}\n{diff[:3000]}"
        )
    return problems


class BreakingBaseline(Exception):
    """``update`` was asked to record a breaking change without ``accept_breaking``."""


def update(
    baseline: Path = BASELINE,
    descriptors: descriptor_pb2.FileDescriptorSet | None = None,
    *,
    accept_breaking: bool = False,
) -> None:
    """Write ``descriptors`` (default: proto/ now) as the baseline; refuses a breaking change unless accepted."""
    now = descriptors if descriptors is not None else current()
    if baseline.exists() and not accept_breaking:
        problems = breaking_changes(load(baseline), now)
        if problems:
            raise BreakingBaseline("\n".join(problems))
    baseline.parent.mkdir(parents=True, exist_ok=True)
    baseline.write_text(_HEADER + to_text(now))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="record proto/ as the new baseline")
    parser.add_argument(
        "--accept-breaking",
        action="store_true",
        help="with --update: record it even though it breaks existing clients (a new major API version)",
    )
    args = parser.parse_args(argv)
    if args.update:
        try:
            update(accept_breaking=args.accept_breaking)
        except BreakingBaseline as exc:
            print(f"proto_compat: refusing to record a breaking change:\n{exc}", file=sys.stderr)
            print("proto_compat: keep the old elements (deprecate them), or pass --accept-breaking", file=sys.stderr)
            return 1
        print(f"wrote {BASELINE.relative_to(REPO_ROOT)}")
        return 0
    problems = check()
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
    print(f"proto/ is compatible with {BASELINE.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
