"""The store's own errors."""


class StoreError(Exception):
    """Base class of the store's own errors."""


class UnknownRun(StoreError, LookupError):
    """No run with that id in this database."""


class CorruptCheckpoint(StoreError):
    """A checkpoint's payload does not match its sha256, or cannot be decoded."""
