"""File names a checkpoint's own metadata gives (index shards, tokenizer files): plain names inside its directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

# JSON files in a model directory whose "*_file" entries name other files that transformers may open.
_METADATA_FILES = ("config.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "preprocessor_config.json", "processor_config.json")
_MAX_METADATA_BYTES = 64 * 2**20


def member_path(directory: Path, name: Any, where: str) -> Path:
    """`directory / name` for a plain relative `name` from the checkpoint's metadata; refuse anything else.

    A name from a downloaded checkpoint must not reach outside its directory: absolute paths, `..`,
    backslashes, empty parts and NUL bytes are refused before a byte is read. Symbolic links that the
    directory itself holds are followed as usual (the Hugging Face cache's snapshots point into blobs/).
    """
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where} names {name!r}, which is not a file name; re-save the checkpoint")
    parts = name.split("/")
    bad = ("\\" in name or "\0" in name or ":" in parts[0] or any(p in ("", ".", "..") for p in parts))
    if bad:
        raise CheckpointError(
            f"{where} names {name!r}, which is not a plain file name inside the model directory; "
            "devmap never reads outside it (fix the entry or re-save the checkpoint)"
        )
    return Path(directory) / name


def check_metadata_paths(directory: Path) -> None:
    """Every "*_file" / "*_files" entry of the directory's JSON metadata must be a plain name inside it."""
    for filename in _METADATA_FILES:
        path = Path(directory) / filename
        try:
            if not path.is_file():
                continue
            if path.stat().st_size > _MAX_METADATA_BYTES:
                raise CheckpointError(f"{path} is over {_MAX_METADATA_BYTES >> 20} MiB: "
                                      "not metadata transformers writes")
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            continue  # unreadable metadata is reported by whoever reads it for its content
        for key, value in _file_entries(data):
            values = value if isinstance(value, list) else [value]
            for item in values:
                if isinstance(item, str):
                    member_path(directory, item, f"{filename} entry {key!r}")


def _file_entries(data: Any) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if isinstance(key, str) and (key.endswith("_file") or key.endswith("_files")) and value is not None:
                    found.append((key, value))
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found
