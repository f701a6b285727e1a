"""A text stage in Python on the stage SDK (guest-sdk/python): a `@setup` that reads the
configuration once and a `@stage` function per request.

TEXT (BYTES [batch, 1]) -> TOKENS (BYTES [batch, max_tokens], padded with "") and
TOKEN_COUNT (INT64 [batch, 1]). Parameters in config.pbtxt: `max_tokens` (default 8) and
`lowercase` (default "true").

Build: wasmtron stage build examples/python/tokenize (or `make stages`).
"""
import re

from wasmtron_stage import InvalidArgument, Tensor, log, setup, stage

WORD = re.compile(r"[\w']+")
settings = {"max_tokens": 8, "lowercase": True}


@setup
def configure(config):
    settings["max_tokens"] = config.parameter("max_tokens", 8, int)
    settings["lowercase"] = config.parameter("lowercase", True, bool)
    log.info(f"{config.name or 'tokenize'}: up to {settings['max_tokens']} tokens per text")


@stage
def infer(TEXT: Tensor):
    width = settings["max_tokens"]
    tokens, counts = [], []
    for item in TEXT.strings():
        try:
            words = WORD.findall(item.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidArgument("TEXT must be UTF-8") from None
        if settings["lowercase"]:
            words = [w.lower() for w in words]
        kept = words[:width]
        tokens += kept + [""] * (width - len(kept))
        counts.append(len(words))
    rows = len(counts)
    return {
        "TOKENS": Tensor.from_strings("TOKENS", (rows, width), tokens),
        "TOKEN_COUNT": Tensor.from_values("TOKEN_COUNT", "INT64", (rows, 1), counts),
    }
