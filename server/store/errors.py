"""The store's own errors."""


class StoreError(Exception):
    """Base class of the store's own errors."""


class UnknownRun(StoreError, LookupError):
    """No run with that id in this database."""


class CorruptCheckpoint(StoreError):
    """A checkpoint's payload does not match its sha256, or cannot be decoded."""


class StoreUnavailable(StoreError, ValueError):
    """The database URL cannot be used: unsupported, its driver missing, its server not
    reachable, or (when asked not to create one) no store there."""
