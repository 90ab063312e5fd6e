"""Checks that an exported library and its metadata are what they claim, before loading.

``dlopen`` of a truncated shared library maps pages past the end of the file and the process
dies with SIGBUS on first touch; a foreign or corrupt file fails deep inside TVM. So the loader
first checks the file here and raises :class:`~pit_tvm.errors.UserError` naming the problem:

* :func:`check_elf_library`: an ELF shared object of this machine whose headers, segments and
  sections all lie inside the file (catches truncation without any metadata);
* :func:`read_metadata`: the ``.json`` written by ``CompiledModel.export`` parses and has the
  fields the loader uses, of the right types;
* :func:`check_library_digest`: the library's SHA-256 equals the one the metadata recorded at
  export (catches a modified or replaced library).

Runtime side: no imports beyond the standard library.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import struct
import sys

from ..errors import UserError

METADATA_FORMAT = "pit-tvm/1"
META_SUFFIX = ".json"
LIBRARY_SUFFIX = ".so"

_ELF_MAGIC = b"\x7fELF"
_ET_DYN = 3
_SHT_NOBITS = 8
_MACHINES = {"x86_64": 62, "amd64": 62, "aarch64": 183, "arm64": 183, "ppc64le": 21, "riscv64": 243}
EXPORT_HINT = "a library written by `pit-tvm compile` / CompiledModel.export"


def library_digest(path) -> str:
    """Hex SHA-256 of the file at ``path`` (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_library_file(path) -> None:
    """``path`` exists and is a regular file, else a ``UserError`` naming what it is."""
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory, not {EXPORT_HINT}")
    if not os.path.isfile(path):
        raise UserError(f"{path}: not a regular file")


def check_elf_library(path) -> None:
    """Raise ``UserError`` unless ``path`` is a complete 64-bit ELF shared object of this machine.

    Complete: the program and section header tables, every segment's file bytes and every
    section's bytes end inside the file (a truncated copy fails here instead of with SIGBUS in
    ``dlopen``)."""
    check_library_file(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != _ELF_MAGIC:
            if str(path).lower().endswith(".onnx"):
                raise UserError(f"{path}: is an ONNX model, not a compiled library; compile it first "
                                f"(pit-tvm compile {path} -o MODEL.so)")
            raise UserError(f"{path}: not a shared library (no ELF header); expected {EXPORT_HINT}")
        if len(head) < 64:
            raise UserError(f"{path}: truncated library ({size} bytes, shorter than an ELF header)")
        if head[4] != 2:
            raise UserError(f"{path}: a 32-bit ELF file; this runtime loads 64-bit libraries")
        order = {1: "little", 2: "big"}.get(head[5])
        if order != sys.byteorder:
            raise UserError(f"{path}: an ELF file of {order or 'unknown'} byte order; this machine is "
                            f"{sys.byteorder}-endian")
        end = "<" if order == "little" else ">"
        (e_type, e_machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
         _) = struct.unpack(end + "HHIQQQIHHHHHH", head[16:64])
        want = _MACHINES.get(platform.machine().lower())
        if want is not None and e_machine != want:
            raise UserError(f"{path}: built for another CPU architecture (ELF machine {e_machine}); this "
                            f"machine is {platform.machine()}")
        if e_type != _ET_DYN:
            raise UserError(f"{path}: an ELF file but not a shared library (ELF type {e_type}); expected "
                            f"{EXPORT_HINT}")

        def _truncated(what, stop):
            if stop > size:
                raise UserError(f"{path}: truncated or corrupt library: its {what} ends at byte {stop}, the "
                                f"file has {size} bytes; export it again")

        def _table(offset, entsize, count, what, fmt):
            if count == 0:
                return []
            if entsize < struct.calcsize(fmt):
                raise UserError(f"{path}: corrupt library: {what} entries of {entsize} bytes")
            _truncated(what, offset + entsize * count)
            rows = []
            for i in range(count):
                f.seek(offset + i * entsize)
                rows.append(struct.unpack(end + fmt, f.read(struct.calcsize(fmt))))
            return rows

        for p_type, _, p_offset, _, _, p_filesz, _, _ in _table(phoff, phentsize, phnum, "program header table",
                                                                "IIQQQQQQ"):
            _truncated(f"segment (type {p_type})", p_offset + p_filesz)
        for _, sh_type, _, _, sh_offset, sh_size, *_ in _table(shoff, shentsize, shnum, "section header table",
                                                               "IIQQQQIIQQ"):
            if sh_type != _SHT_NOBITS:
                _truncated("section data", sh_offset + sh_size)


def _field_error(meta_path, message):
    return UserError(f"{meta_path}: not valid pit-tvm metadata: {message}; export the model again")


# dtypes numpy may not know by name (ml_dtypes' bfloat16, float8 variants)
_EXTRA_DTYPE = re.compile(r"^(bfloat16|float8_e\w+|float6_e\w+|float4_e\w+)$")


def _is_dtype(text) -> bool:
    import numpy as np  # noqa: PLC0415

    if _EXTRA_DTYPE.match(text):
        return True
    try:
        np.dtype(text)
    except TypeError:
        return False
    return True


def read_metadata(lib_path) -> dict | None:
    """The metadata ``lib_path + ".json"`` written at export, checked; ``None`` when there is none.

    Raises ``UserError`` naming the problem when it cannot be read, is not JSON, is not pit-tvm
    metadata (``"format"``) or a field the loader uses has the wrong type."""
    meta_path = str(lib_path) + META_SUFFIX
    if not os.path.exists(meta_path):
        return None
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{meta_path}: cannot read the metadata: {err}") from err
    except json.JSONDecodeError as err:
        raise UserError(f"{meta_path}: the metadata is not valid JSON ({err}); export the model again") from err
    if not isinstance(meta, dict):
        raise _field_error(meta_path, f"a JSON {type(meta).__name__}, expected an object")
    if meta.get("format") != METADATA_FORMAT:
        raise _field_error(meta_path, f"format is {meta.get('format')!r}, expected {METADATA_FORMAT!r}")
    if not isinstance(meta.get("target"), str):
        raise _field_error(meta_path, f"'target' is {meta.get('target')!r}, expected a target name")
    inputs = meta.get("inputs")
    if not isinstance(inputs, list):
        raise _field_error(meta_path, "'inputs' is not a list")
    for i, item in enumerate(inputs):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise _field_error(meta_path, f"inputs[{i}] is {item!r}, expected {{'name': str, 'dtype', 'shape'}}")
        dtype, shape = item.get("dtype"), item.get("shape")
        if dtype is not None and not (isinstance(dtype, str) and _is_dtype(dtype)):
            raise _field_error(meta_path, f"inputs[{i}] ({item['name']!r}) has dtype {dtype!r}")
        if shape is not None and not (isinstance(shape, list) and all(
                isinstance(d, str) or (isinstance(d, int) and not isinstance(d, bool)) for d in shape)):
            raise _field_error(meta_path, f"inputs[{i}] ({item['name']!r}) has shape {shape!r}")
    outputs = meta.get("outputs", [])
    if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        raise _field_error(meta_path, f"'outputs' is {outputs!r}, expected a list of names")
    if not isinstance(meta.get("annotations", []), list):
        raise _field_error(meta_path, "'annotations' is not a list")
    digest = meta.get("library_sha256")
    if digest is not None and not (isinstance(digest, str) and len(digest) == 64):
        raise _field_error(meta_path, f"'library_sha256' is {digest!r}, expected 64 hex digits")
    return meta


def check_library_digest(lib_path, meta: dict | None) -> None:
    """Raise ``UserError`` when ``meta`` records a SHA-256 the library at ``lib_path`` does not have.
    (Metadata without one, written before export recorded it, is not checked.)"""
    want = (meta or {}).get("library_sha256")
    if want is None:
        return
    got = library_digest(lib_path)
    if got != want.lower():
        raise UserError(f"{lib_path}: the library does not match the checksum recorded in "
                        f"{lib_path}{META_SUFFIX} (modified, truncated or replaced after export); "
                        "export the model again")
