"""User-facing errors: the CLI prints these as one line and exits 2; the server maps them to 4xx."""


class KilnError(Exception):
    """A mistake the user can fix (bad path, bad flag value, corrupt file, prompt too long)."""
