"""The one error of the model sources: the model cannot be found, fetched, built or read as configured."""
from __future__ import annotations


class ModelSourceError(RuntimeError):
    """A model folder cannot be had as asked; the message says what to do (the engine reports it as a
    startup error)."""
