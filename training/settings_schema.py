"""The training settings as plain data, cached on the user's machine so `fab train` checks a config fast.

training/validate.py needs, for every setting of training/args.py (its dataclasses subclass TRL's
SFTConfig and ModelConfig): the shape of its type, how to describe it in a message, its allowed
`choices` and its default. Reading those from the dataclasses imports TRL, transformers and torch:
seconds on a laptop, each `fab train`. So they are read once into a JSON-able schema and kept in
$XDG_CACHE_HOME/slurm-gpu/ (default ~/.cache/slurm-gpu/), in a file named after a key made of the
installed versions of the libraries that define the fields and a hash of the modules that build
and read the schema. Another version, an edited args.py, or a file that does not have the schema's
shape (stale, truncated, edited) is not used: the schema is read from the dataclasses again (the
old way, always correct) and the file replaced atomically, so two runs at once never read half a file.

A type's shape (`form`) follows training/validate.py's `_fits` branch for branch:
{"kind": "union", "of": [forms]}, "none", {"kind": "literal", "values": [...]}, "bool", "int",
"float", "str", {"kind": "enum", "values": [...], "names": [...]},
{"kind": "list", "item": form or None}, "mapping", "any" (left to the parser).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import os
import sys
import tempfile
import types
import typing
from importlib import metadata
from pathlib import Path

FORMAT = 1
# The libraries whose dataclasses (SFTConfig < TrainingArguments, ModelConfig) or type hints make the settings.
LIBRARIES = ("trl", "transformers", "peft", "accelerate", "torch")
# The modules whose code decides what the schema holds and how it is read.
_HERE = Path(__file__).resolve().parent
SOURCES = (_HERE / "args.py", _HERE / "settings_schema.py", _HERE / "validate.py")
_PLAIN = (str, int, float, bool, type(None))
_KINDS = {"union", "none", "literal", "bool", "int", "float", "str", "enum", "list", "mapping", "any"}


def cache_dir() -> Path | None:
    """Where the schema is kept (None when there is no home to keep it in)."""
    base = os.environ.get("XDG_CACHE_HOME")
    try:
        return Path(base or Path.home() / ".cache") / "slurm-gpu"
    except RuntimeError:  # no HOME and no passwd entry
        return None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cache_key() -> dict:
    """What the schema depends on: the libraries' installed versions (from their metadata, no import)
    and the code of the modules in SOURCES."""
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return {"format": FORMAT, "python": "{}.{}".format(*sys.version_info[:2]),
            "libraries": {name: _version(name) for name in LIBRARIES}, "sources": digest.hexdigest()}


def cache_file(key: dict) -> Path | None:
    where = cache_dir()
    if where is None:
        return None
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return where / f"training-settings-{name}.json"


def describe(hint) -> str:
    """What a value must be, for the message: 'true or false', 'one of: no, steps, epoch', 'int'."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
    if enums:
        return "one of: " + ", ".join(str(m.value) for m in enums[0])
    if args == [bool]:
        return "true or false"
    names = [getattr(a, "__name__", None) or str(a).replace("typing.", "") for a in args]
    words = {"int": "a whole number", "float": "a number", "str": "a string", "list": "a list", "dict": "a mapping"}
    return " or ".join(words.get(n.split("[")[0], n) for n in names)


def form(hint) -> dict:
    """The shape of type hint `hint` that training/validate.py's `_fits` checks a value against."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return {"kind": "union", "of": [form(a) for a in args]}
    if hint is type(None):
        return {"kind": "none"}
    if origin is typing.Literal:
        return {"kind": "literal", "values": list(args)}
    if hint is bool:
        return {"kind": "bool"}
    if hint in (int, float):
        return {"kind": hint.__name__}
    if hint is str:
        return {"kind": "str"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"kind": "enum", "values": [m.value for m in hint], "names": [m.name for m in hint]}
    if origin is list:
        return {"kind": "list", "item": form(args[0]) if args else None}
    if origin is dict or hint is dict:
        return {"kind": "mapping"}
    return {"kind": "any"}


def _dataclasses():
    from training.args import DataArguments, ModelArguments, TrainConfig  # TRL, transformers, torch: seconds

    return (DataArguments, ModelArguments, TrainConfig)


def field_default(f: dataclasses.Field):
    """A field's default: its value, or what its default_factory makes (lora_target_modules' list); None
    when it has neither."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def live_default(key: str):
    """The default of setting `key`, read from the dataclasses (None when it has none)."""
    for cls in _dataclasses():
        for f in dataclasses.fields(cls):
            if f.name == key:
                return field_default(f)
    return None


def is_plain(value) -> bool:
    """Whether `value` comes back from JSON as itself: str, int, float, bool, None, lists and str-keyed
    dicts of them (a str-valued enum member or a tuple would come back as something else)."""
    if type(value) in _PLAIN:
        return True
    if type(value) is list:
        return all(is_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and is_plain(v) for k, v in value.items())
    return False


def generate() -> dict:
    """The schema, read from training/args.py's dataclasses (imports TRL, transformers and torch).

    settings: name -> {"type": form, "describe": text, "choices": [...]}, for the fields the parser
    accepts (init fields; the first class that has a name wins, as TrlParser's order); defaults: name ->
    default of every field (None for a default_factory), except those that are not plain data, which are
    named in opaque_defaults and read from the dataclasses when asked for."""
    settings, defaults, opaque = {}, {}, []
    for cls in _dataclasses():
        try:
            resolved = typing.get_type_hints(cls)
        except Exception:  # noqa: BLE001 - an unresolvable hint is then not type-checked
            resolved = {}
        for f in dataclasses.fields(cls):
            if f.init and f.name not in settings:
                hint = resolved.get(f.name, object)
                settings[f.name] = {"type": form(hint), "describe": describe(hint),
                                    "choices": list(f.metadata.get("choices") or [])}
            if f.name not in defaults and f.name not in opaque:
                value = field_default(f)
                if is_plain(value):
                    defaults[f.name] = value
                else:
                    opaque.append(f.name)
    return {"settings": settings, "defaults": defaults, "opaque_defaults": opaque}


def _form_ok(f) -> bool:
    if not isinstance(f, dict) or f.get("kind") not in _KINDS:
        return False
    kind = f["kind"]
    if kind == "union":
        return set(f) == {"kind", "of"} and isinstance(f["of"], list) and all(_form_ok(a) for a in f["of"])
    if kind == "literal":
        return set(f) == {"kind", "values"} and isinstance(f["values"], list) and is_plain(f["values"])
    if kind == "enum":
        return (set(f) == {"kind", "values", "names"} and isinstance(f["values"], list) and is_plain(f["values"])
                and isinstance(f["names"], list) and all(isinstance(n, str) for n in f["names"]))
    if kind == "list":
        return set(f) == {"kind", "item"} and (f["item"] is None or _form_ok(f["item"]))
    return set(f) == {"kind"}


def valid(data, key: dict) -> bool:
    """Whether `data` (a cache file's contents) is a schema made under `key`."""
    if not isinstance(data, dict) or set(data) != {"key", "settings", "defaults", "opaque_defaults"}:
        return False
    settings, defaults, opaque = data["settings"], data["defaults"], data["opaque_defaults"]
    if data["key"] != key or not isinstance(settings, dict) or not settings:
        return False
    for entry in settings.values():
        if not (isinstance(entry, dict) and set(entry) == {"type", "describe", "choices"}
                and _form_ok(entry["type"]) and isinstance(entry["describe"], str)
                and isinstance(entry["choices"], list) and all(isinstance(c, str) for c in entry["choices"])):
            return False
    return (isinstance(defaults, dict) and is_plain(defaults) and isinstance(opaque, list)
            and all(isinstance(n, str) for n in opaque))


def _read(path: Path, key: dict) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, unreadable, not JSON (a truncated or foreign file)
        return None
    return data if valid(data, key) else None


def _write(path: Path, data: dict) -> None:
    """Write `data` to `path` atomically (a temporary file in the same folder, then a rename); a cache that
    cannot be written (read-only home, full disk) only means the next run reads the dataclasses again."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name + ".", suffix=".tmp",
                                         delete=False) as out:
            tmp = out.name
            json.dump(data, out)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


@functools.cache
def schema() -> dict:
    """The schema: from the cache when it holds a valid one for this key, else generated (and cached)."""
    key = cache_key()
    path = cache_file(key)
    data = _read(path, key) if path is not None else None
    if data is None:
        data = {"key": key, **generate()}
        if path is not None and valid(data, key):  # a hint that is not plain data: not cached, read each run
            _write(path, data)
    return data
