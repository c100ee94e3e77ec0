"""Part of the xprof stand-in (see xprof/__init__.py): only what tokamax's import needs."""
