"""Repository tools run by the Makefile (`python -m tools.<name>`); not part of the installed package."""
