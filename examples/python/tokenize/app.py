"""A text stage in Python, written the way a Triton Python-backend model is: an `init` that
reads the configuration once, and an `execute` that loops over the requests of a batch.

TEXT (BYTES [batch, 1]) -> TOKENS (BYTES [batch, max_tokens], padded with "") and
TOKEN_COUNT (INT64 [batch, 1]). Parameters in config.pbtxt: `max_tokens` (default 8) and
`lowercase` (default "true").

Build: componentize-py -d wit -w stage componentize app -p examples/python/tokenize -o model.wasm
"""
import json
import re
import struct
from typing import List, Tuple

from wit_world import exports
from componentize_py_types import Err, Ok
from wit_world.imports import host, types

WORD = re.compile(r"[\w']+")


def unpack_bytes(data: bytes) -> List[bytes]:
    """Splits a BYTES tensor's data (4-byte little-endian length + bytes per element)."""
    items, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        items.append(data[offset + 4:offset + 4 + length])
        offset += 4 + length
    return items


def pack_bytes(items: List[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(item)) + item for item in items)


def invalid(message: str) -> Err:
    return Err(types.Error(types.ErrorCode.INVALID_ARGUMENT, message))


class Settings:
    """Read once by `init`. componentize-py may create a fresh `Model` object per call, so
    per-instance state lives at module level (the module lives as long as the instance)."""

    max_tokens = 8
    lowercase = True


class Model(exports.Model):
    def init(self, config_json: str, parameters: List[Tuple[str, str]]) -> None:
        name = json.loads(config_json).get("name", "tokenize")
        params = dict(parameters)
        try:
            Settings.max_tokens = int(params.get("max_tokens", "8"))
        except ValueError:
            raise Err(types.Error(types.ErrorCode.INVALID_ARGUMENT, "parameter 'max_tokens' must be an integer"))
        Settings.lowercase = params.get("lowercase", "true") == "true"
        host.log(host.LogLevel.INFO, f"{name}: up to {Settings.max_tokens} tokens per text")

    def execute(self, requests: List[types.Request]):
        responses = []
        for request in requests:
            text = next((t for t in request.inputs if t.name == "TEXT"), None)
            if text is None:
                responses.append(invalid("missing input 'TEXT'"))
                continue
            tokens, counts = [], []
            for item in unpack_bytes(text.data):
                try:
                    words = WORD.findall(item.decode("utf-8"))
                except UnicodeDecodeError:
                    responses.append(invalid("TEXT must be UTF-8"))
                    break
                if Settings.lowercase:
                    words = [w.lower() for w in words]
                kept = words[: Settings.max_tokens]
                tokens.extend(w.encode() for w in kept)
                tokens.extend(b"" for _ in range(Settings.max_tokens - len(kept)))
                counts.append(len(words))
            else:
                rows = len(counts)
                produced = {
                    "TOKENS": types.Tensor("TOKENS", types.Datatype.BYTES, [rows, Settings.max_tokens], pack_bytes(tokens)),
                    "TOKEN_COUNT": types.Tensor(
                        "TOKEN_COUNT", types.Datatype.INT64, [rows, 1], struct.pack(f"<{rows}q", *counts)
                    ),
                }
                responses.append(Ok([produced[name] for name in request.requested_outputs]))
        return responses
