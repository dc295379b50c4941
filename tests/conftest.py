"""Shared pytest setup: import zbpipe once so a missing build fails loudly and early."""

import zbpipe  # noqa: F401
