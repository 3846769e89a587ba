"""ddtree: DFlash drafters and lossless draft-tree decoding (DDTree). From Python:

    from ddtree import Decoder

    reply = Decoder("smollm2-135m", drafter="outputs/smollm2-135m/<run>/drafter").generate("Hello")

`Decoder` and `Reply` (ddtree/decoder.py) load torch and transformers when first named, not on `import ddtree`: the
`ddtree` command answers --help and bad flags before they load.
"""

__all__ = ["Decoder", "Reply"]


def __getattr__(name: str):
    if name in __all__:
        from . import decoder

        return getattr(decoder, name)
    raise AttributeError(f"module 'ddtree' has no attribute {name!r}")
