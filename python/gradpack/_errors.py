"""The exception of the gradpack package (raised by its native module too)."""


class Error(ValueError):
    """A gradpack error: a malformed or corrupted frame, a bad codec spec or parameter, a
    buffer of the wrong size, a peer that failed. The message is the Rust crate's own. A
    subclass of ValueError."""

    __module__ = "gradpack"
