"""Checks for one chapter's exercises (filled in with the chapter)."""

__all__: list[str] = []
